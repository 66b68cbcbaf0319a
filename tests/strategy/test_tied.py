"""Tied parameters (one parameter used by layers on several stages) through the strategy.

Unit tests cut ``CharGPT`` (head tied to the token embedding) and a module reachable under two
names without processes. The slow tests launch ``tied_script.py`` on 2 and 3 ranks: ``flush`` and
``gpipe`` equal one device, ``2bw``, ``async`` and ``vertical_sync`` the oracle extended with the
tie rule (on 3 ranks the tie spans stages 0 and 2), the copies in the shards are bit-identical
and the consolidated dict loads strictly into the LightningModule.
SGD keeps these comparisons exact: with Adam, the key bias of attention (whose gradient is zero
up to rounding) takes +-lr steps from rounding noise alone, tie or no tie.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from pl_pipedream.core.checkpoint import merge_states
from pl_pipedream.core.stage import cut_stage, pipeline_layers
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.ties import check_ties
from pl_pipedream.schedule.modes import SyncMode
from tests.runtime import oracle
from tests.strategy import tied_script
from tests.strategy.tied_script import CLIP, tied_batches, tied_loader, tied_model

TIED = ("embed.wte.weight", "head.out.weight")


def cut_every_rank(make, plan: Plan):  # type: ignore[no-untyped-def]
    """Each rank's module and LocalStage, as setup leaves them (one fresh module per rank)."""
    out = []
    for rank in range(plan.num_workers):
        module = make()
        out.append((module, cut_stage(module, pipeline_layers(module), plan, rank)))
    return out


def test_cut_stage_finds_the_tie_and_keeps_a_copy_on_every_holder() -> None:
    plan = Plan.from_balance([1, 2, 1])
    for module, local in cut_every_rank(tied_model, plan):
        index = local.stage.index
        assert [(t.names, t.stages, t.ranks) for t in local.ties] == [(TIED, (0, 2), (0, 2))]
        holds = index in (0, 2)
        assert local.ties[0].stage_names == ("0.wte.weight", "3.out.weight")
        assert local.ties[0].name_in(index) == {0: "0.wte.weight", 2: "3.out.weight"}.get(index)
        wte = module.embed.wte.weight
        assert (wte.device.type != "meta") == holds
        assert module.head.out.weight is wte  # still one parameter on this rank
        assert module.embed.wpe.weight.device.type == ("cpu" if index == 0 else "meta")
        if index == 1:
            assert module.blocks[0].qkv.weight.device.type == "cpu"
            assert module.head.ln.weight.device.type == "meta"


def test_the_stages_state_holds_every_name_and_loads_strictly() -> None:
    plan = Plan.from_balance([1, 3])
    ranks = cut_every_rank(tied_model, plan)
    states = [local.state_dict(module) for module, local in ranks]
    assert all(name in states[0] and name in states[1] for name in TIED)
    merged = merge_states(states)
    fresh = tied_model()
    assert sorted(merged) == sorted(fresh.state_dict())
    fresh.load_state_dict(merged, strict=True)


class TwoNames(LightningModule):
    """A module that is an attribute twice: ``self.embed`` and ``self.pipe[0]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 4)
        self.pipe = nn.Sequential(self.embed, nn.Tanh(), nn.Linear(4, 2))
        self.scale = nn.Parameter(torch.ones(()))  # outside the pipeline

    def configure_pipeline(self) -> nn.Sequential:
        return self.pipe


def test_a_module_under_two_names_is_saved_under_both() -> None:
    plan = Plan.from_balance([1, 2])
    ranks = cut_every_rank(TwoNames, plan)
    merged = merge_states(local.state_dict(module) for module, local in ranks)
    assert {"embed.weight", "pipe.0.weight", "scale"} <= set(merged)
    fresh = TwoNames()
    fresh.load_state_dict(merged, strict=True)
    assert ranks[0][1].ties == []  # used by one stage only: not a tie


@pytest.mark.parametrize("sync", [SyncMode.ASYNC, SyncMode.VERTICAL_SYNC])
def test_per_minibatch_modes_refuse_ties_with_replicas_at_setup_naming_the_fix(
    sync: SyncMode,
) -> None:
    tie = ["embed.wte.weight = head.out.weight on stages [0, 1]"]
    with pytest.raises(ValueError, match="tied parameters.*replicas: \\[2, 1\\].*use PipeDream"):
        check_ties(sync, tie, [2, 1])
    check_ties(sync, tie, [1, 1])  # a straight pipeline: the tie has versions of its own
    for ok in (SyncMode.FLUSH, SyncMode.GPIPE, SyncMode.TWO_BW):
        check_ties(ok, tie, [2, 1])


# ----- end to end -----------------------------------------------------------------------------


def launch(tmp_path: Path, balance, replicas, configs, m: int = 2) -> None:  # type: ignore[no-untyped-def]
    """``tied_script``'s fits, the ranks forked from this process."""
    argv = ["--balance", *map(str, balance), "--microbatches", str(m), "--out", str(tmp_path)]
    argv += ["--configs", *configs, *(["--replicas", *map(str, replicas)] if replicas else [])]
    tied_script.main(argv, start_method="fork")


def one_device(m: int, clip: float | None = None) -> dict[str, torch.Tensor]:
    model = tied_model("sgd")
    Trainer(
        gradient_clip_val=clip,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    ).fit(model, tied_loader(m))
    return {k: v.detach() for k, v in model.state_dict().items()}


def the_oracle(plan: Plan, sync: str, m: int) -> dict[str, torch.Tensor]:
    """The oracle's result under the LightningModule's names."""
    model = tied_model("sgd")
    pipe = model.configure_pipeline()
    pipe_names = {}
    for name, tensor in pipe.state_dict(keep_vars=True).items():
        pipe_names.setdefault(id(tensor), name)

    def sgd(params):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)

    trained = oracle.train(copy.deepcopy(pipe), plan, sync, tied_batches(m), m, model.loss, sgd)
    return {
        name: trained[pipe_names[id(t)]] for name, t in model.state_dict(keep_vars=True).items()
    }


def check_run(out: Path, plan: Plan, expected: dict[str, torch.Tensor], label: str) -> None:
    assert json.loads((out / "done.json").read_text())["global_step"] == 4
    got = torch.load(out / "weights.pt")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        diff = (got[name] - tensor).abs().max().item()
        assert diff <= 1e-5, f"{label} {name}: {diff}"
    shards = [
        torch.load(out / "run.ckpt" / f"stage-{s:02d}.pt", weights_only=False)["state_dict"]
        for s in range(plan.num_stages)
    ]
    copies = [shard[name] for shard in shards for name in TIED if name in shard]
    assert len(copies) == 4  # both names, in the shards of both holding stages
    assert all(torch.equal(copies[0], c) for c in copies[1:]), f"{label}: copies differ"
    tied_model().load_state_dict(got, strict=True)


@pytest.mark.slow
def test_two_stages_flush_and_gpipe_equal_one_device_2bw_async_the_oracle(tmp_path: Path) -> None:
    plan = Plan.from_balance([1, 3])
    configs = [
        "flush:sgd",
        "gpipe:sgd",
        "2bw:sgd",
        "flush:sgd:clip",
        "async:sgd",
        "vertical_sync:sgd",
    ]
    launch(tmp_path, [1, 3], None, configs)
    reference = one_device(2)
    for sync in ("flush", "gpipe"):
        check_run(tmp_path / f"{sync}-sgd", plan, reference, sync)
    # clipping by the norm over every stage counts the tied gradient once, as on one device
    check_run(tmp_path / "flush-sgd-clip", plan, one_device(2, CLIP), "flush clipped")
    check_run(tmp_path / "2bw-sgd", plan, the_oracle(plan, "2bw", 2), "2bw")
    # the per-minibatch modes: the tie uses version max(0, i - 1), one tied update per minibatch
    for sync in ("async", "vertical_sync"):
        check_run(tmp_path / f"{sync}-sgd", plan, the_oracle(plan, sync, 2), sync)


CASES3 = {"straight 1-2-1": ([1, 2, 1], None), "replicated 2-1": ([1, 3], [2, 1])}


@pytest.mark.slow
@pytest.mark.parametrize("label", list(CASES3))
def test_three_ranks_flush_equals_one_device_2bw_the_oracle(tmp_path: Path, label: str) -> None:
    balance, replicas = CASES3[label]
    plan = Plan.from_balance(balance, replicas=replicas)
    m = 4  # 2bw needs at least as many microbatches as stages
    # straight: the tie spans stages 0 and 2 and uses version max(0, i - 2) in the async modes
    asynchronous = ["async:sgd", "vertical_sync:sgd"] if replicas is None else []
    launch(tmp_path, balance, replicas, ["flush:sgd", "2bw:sgd", *asynchronous], m)
    check_run(tmp_path / "flush-sgd", plan, one_device(m), f"{label} flush")
    check_run(tmp_path / "2bw-sgd", plan, the_oracle(plan, "2bw", m), f"{label} 2bw")
    for config in asynchronous:
        sync = config.split(":")[0]
        check_run(tmp_path / f"{sync}-sgd", plan, the_oracle(plan, sync, m), f"{label} {sync}")


def test_automatic_plans_count_the_ties_traffic() -> None:
    from dataclasses import replace

    from pl_pipedream.core.planning import _count_ties
    from pl_pipedream.planner.topology import Topology

    plan = replace(Plan.from_balance([1, 3]), slowest_stage_time=0.01)
    counted = _count_ties(plan, tied_model().configure_pipeline(), Topology.flat(2, 1e9))
    wte_bytes = 128 * 16 * 4
    assert counted.slowest_stage_time == pytest.approx(0.01 + wte_bytes / 1e9)
    assert f"{wte_bytes} B" in counted.meta["tied"]

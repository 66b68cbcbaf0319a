"""Choosing the plan at setup: which plan wins, the sample input, planning on rank 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.planning import plan_profile
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy.planning import (
    announce,
    choose_plan,
    elastic,
    plan_automatically,
    sample_input,
)
from tests.core.test_planning import six_equal_layers
from tests.runtime.distributed import one_rank_group

GIVEN = Plan.from_balance([1, 3])
PREVIOUS = Plan.from_balance([2, 2])
RESUMED = Plan.from_balance([3, 1])
AUTOMATIC = Plan.from_balance([1, 1, 2])


def automatic() -> Plan:
    return AUTOMATIC


def never() -> Plan:
    raise AssertionError("planned automatically although a plan was at hand")


def choose(given=None, balance=None, previous=None, resumed=None, plan=never, world=2) -> Plan:  # type: ignore[no-untyped-def]
    return choose_plan(given, balance, previous, resumed, 4, world, plan)


def test_the_given_plan_wins() -> None:
    assert choose(GIVEN, previous=PREVIOUS, resumed=RESUMED) is GIVEN


def test_an_earlier_setups_plan_comes_next() -> None:
    """A validate/test/predict after fit keeps the training layout."""
    assert choose(previous=PREVIOUS, resumed=RESUMED) is PREVIOUS
    assert choose(balance=[3, 1], previous=PREVIOUS) is PREVIOUS


def test_a_resumed_checkpoints_plan_comes_next() -> None:
    assert choose(resumed=RESUMED) is RESUMED


def test_a_resumed_plan_for_another_number_of_processes_gives_way_to_an_automatic_one() -> None:
    """The checkpoint's plan is information only: 2 workers saved it, 3 resume it."""
    assert choose(resumed=Plan.from_balance([2, 2]), plan=automatic, world=3) is AUTOMATIC


def test_a_plan_for_other_devices_names_the_checkpoints_plan_and_how_to_resume() -> None:
    with pytest.raises(PipelineSetupError) as error:
        choose(balance=[1, 1, 2], resumed=RESUMED, world=2)
    assert (
        "the plan needs one process per worker (plan workers: 3, devices: 2, the checkpoint's "
        "plan: 1-1 on 2 workers); use Trainer(devices=3) or a plan for 2 workers; a checkpoint "
        "resumes under any plan: leave out balance= and plan= to plan for 2 automatically"
    ) in str(error.value)


def test_balance_comes_before_the_resumed_plan() -> None:
    """``balance=`` given with a checkpoint wins; the checkpoint's layout is checked on load."""
    assert choose(balance=[1, 3], resumed=RESUMED) == Plan.from_balance([1, 3])


def test_balance_builds_a_plan_over_the_layer_indices() -> None:
    plan = choose(balance=[1, 3])
    assert [stage.nodes for stage in plan.stages] == [("0",), ("1", "2", "3")]


def test_without_any_plan_it_plans_automatically() -> None:
    assert choose(plan=automatic, world=3) is AUTOMATIC


def test_balance_and_a_plan_together_are_refused() -> None:
    with pytest.raises(PipelineSetupError, match="either balance= or plan="):
        choose(GIVEN, balance=[2, 2])


def test_the_plan_needs_one_process_per_worker() -> None:
    with pytest.raises(PipelineSetupError) as error:
        choose(plan=automatic, world=2)
    assert (
        "the plan needs one process per worker (plan workers: 3, devices: 2); use "
        "Trainer(devices=3) or a plan for 2 workers"
    ) in str(error.value)


class Model(LightningModule):
    def __init__(self, example: bool = True) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        if example:
            self.example_input_array = torch.ones(3, 4)

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(tmp_path: Path, **kwargs) -> Trainer:  # type: ignore[no-untyped-def]
    return Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


def test_outside_fit_the_sample_is_the_example_input_array(tmp_path: Path) -> None:
    sample = sample_input(trainer(tmp_path), Model(), 2, lambda x: x * 2)
    assert torch.equal(sample, torch.full((3, 4), 2.0))  # moved with to_device


def test_a_tuple_example_holds_forwards_arguments_as_in_lightning(tmp_path: Path) -> None:
    """``example_input_array = ((a, b),)`` means ``forward((a, b))`` (Seq2Seq's): the sample is
    the pair, not the 1-tuple around it; several arguments cannot feed one first layer."""
    module = Model()
    pair = (torch.ones(2, 3), torch.zeros(2, 3))
    module.example_input_array = (pair,)
    sample = sample_input(trainer(tmp_path), module, 2, lambda x: x)
    assert isinstance(sample, tuple) and len(sample) == 2 and torch.equal(sample[0], pair[0])
    module.example_input_array = pair
    with pytest.raises(PipelineSetupError, match=r"example_input_array: a tuple of 2\); set it"):
        sample_input(trainer(tmp_path), module, 2, lambda x: x)


def test_without_a_sample_planning_names_the_ways_to_give_one(tmp_path: Path) -> None:
    with pytest.raises(
        PipelineSetupError, match="example_input_array .* or pass balance= or plan="
    ):
        sample_input(trainer(tmp_path), Model(example=False), 2, lambda x: x)


class RecordSample(Callback):
    """What ``sample_input`` sees at setup, where the strategy calls it."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.sample = sample_input(trainer, pl_module, 2, lambda batch: batch)


def test_while_fitting_the_sample_is_one_microbatch_of_the_first_batch(tmp_path: Path) -> None:
    x = torch.arange(32.0).reshape(8, 4)
    data = DataLoader(TensorDataset(x, torch.zeros(8)), batch_size=4)
    record = RecordSample()
    trainer(tmp_path, max_steps=1, callbacks=[record]).fit(Model(), data)
    assert torch.equal(record.sample, x[:2])


def test_plan_automatically_announces_the_plan_beside_the_logs(tmp_path: Path) -> None:
    with one_rank_group():
        plan, _ = plan_automatically(trainer(tmp_path), Model(), None, 1, lambda x: x)
    written = Plan.from_dict(json.loads((tmp_path / "pipedream_plan.json").read_text()))
    assert written == plan and plan.num_workers == 1


def test_the_printed_plan_says_it_is_slower_than_data_parallelism(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    chosen = plan_profile(six_equal_layers(), Topology.flat(4, 1e10), microbatches=3)
    with one_rank_group(), caplog.at_level("INFO"):
        announce(trainer(tmp_path), chosen, 0.5)
    assert "slower than DP       predicted slower than data parallelism (0.90x)" in caplog.text
    assert "microbatches=4 admits" in caplog.text


def test_a_resumed_plan_for_another_number_of_processes_is_dropped_with_a_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO"):
        assert elastic(RESUMED, 2) is RESUMED
        assert caplog.text == ""
        assert elastic(Plan.from_balance([2, 2, 2]), 2) is None
    assert (
        "PipeDreamStrategy: the checkpoint's plan (1-1-1 on 3 workers) is for another number of "
        "processes (2): planning afresh for 2"
    ) in caplog.text


@pytest.mark.slow
def test_a_checkpoint_of_3_processes_resumes_on_2_with_a_fresh_plan(tmp_path: Path) -> None:
    """Elastic restart: saved at step 5 by a 3-stage flush run, resumed on 2 processes with no
    balance given, it plans for 2 (and writes that plan) and ends where one device does."""
    from tests.strategy.test_resume import FLUSH, assert_equal_weights, fit, strategy

    alone = fit(tmp_path / "alone", 2, 1)
    fit(tmp_path / "three", 1, 3, strategy=strategy("flush", [2, 2, 2]))
    fresh = PipeDreamStrategy(sync="flush", microbatches=2, start_method="fork", timeout=60)
    last = tmp_path / "three" / "last.ckpt"
    resumed = fit(tmp_path / "two", 2, 2, last, strategy=fresh, default_root_dir=tmp_path)
    saved = json.loads((tmp_path / "two" / "last.ckpt" / "pipeline.json").read_text())
    assert Plan.from_dict(saved["plan"]).num_workers == 2
    written = Plan.from_json((tmp_path / "pipedream_plan.json").read_text())
    assert written.num_workers == 2
    assert_equal_weights(resumed.state_dict(), alone.state_dict(), FLUSH)


@pytest.mark.slow
def test_a_balance_for_another_number_of_processes_than_the_resumed_run_names_the_fix(
    tmp_path: Path,
) -> None:
    from tests.strategy.test_resume import fit, strategy

    fit(tmp_path / "three", 1, 3, strategy=strategy("flush", [2, 2, 2]))
    with pytest.raises(Exception) as error:
        fit(
            tmp_path / "two",
            2,
            2,
            tmp_path / "three" / "last.ckpt",
            strategy=strategy("flush", [2, 2, 2]),
        )
    assert (
        "the plan needs one process per worker (plan workers: 3, devices: 2, the checkpoint's "
        "plan: 1-1-1 on 3 workers); use Trainer(devices=3) or a plan for 2 workers; a "
        "checkpoint resumes under any plan: leave out balance= and plan= to plan for 2 "
        "automatically"
    ) in str(error.value)


def test_a_plan_of_several_stages_per_rank_runs_in_its_chunked_mode_only() -> None:
    chunked = Plan.from_balance([1] * 4, placement="v")
    with pytest.raises(
        PipelineSetupError, match=r"^sync='flush' runs plans placed 'contiguous', and this plan"
    ) as error:
        choose(chunked)
    assert "use PipeDreamStrategy(sync='zbv') for this plan" in str(error.value)
    assert choose_plan(chunked, None, None, None, 4, 2, never, SyncMode.ZBV) is chunked
    placed = choose_plan(None, [1, 1, 1, 1], None, None, 4, 2, never, SyncMode.INTERLEAVED)
    assert [s.ranks for s in placed.stages] == [(0,), (1,), (0,), (1,)]


def test_chunks_per_rank_picks_the_resumed_plan_and_checks_a_balance() -> None:
    """A resumed plan of other chunks per rank gives way to an automatic one; a balance must
    give every rank the chunks asked for."""
    resumed = Plan.from_balance([1] * 4, placement="interleaved", num_ranks=2)  # 2 per rank
    planned = Plan.from_balance([1] * 6, placement="interleaved", num_ranks=2)  # 3 per rank
    mode = SyncMode.INTERLEAVED
    assert choose_plan(None, None, None, resumed, 6, 2, never, mode, 2) is resumed
    assert choose_plan(None, None, None, resumed, 6, 2, never, mode) is resumed
    assert choose_plan(None, None, None, resumed, 6, 2, lambda: planned, mode, 3) is planned
    with pytest.raises(PipelineSetupError, match=r"\(chunks_per_rank: 3, plan: 4 stages on 2 r"):
        choose_plan(None, [2, 1, 2, 1], None, None, 6, 2, never, mode, 3)


@pytest.mark.slow
def test_a_fit_without_a_layout_plans_the_chunked_modes_and_equals_one_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PipeDreamStrategy(sync="zbv")`` and ``"interleaved"`` without balance= or plan=: rank 0
    profiles and cuts 4 stages for 2 ranks (``planner.chunk_plan``), Lightning trains them."""
    from tests.runtime import oracle
    from tests.runtime.test_executor import NUM_BATCHES, OPTIMIZERS, loss_fn
    from tests.runtime.test_executor import make_batches as batches_of
    from tests.runtime.test_executor import make_model as model_of
    from tests.strategy.test_fit import fork

    monkeypatch.chdir(tmp_path)  # the plan is written beside the logs: here, without a logger
    configs = ["zbv:sgd", "interleaved:sgd"]
    fork(tmp_path, [0], None, 2, configs)
    expected = oracle.train(
        model_of(), Plan.from_balance([3, 3]), "flush", batches_of(2), 2, loss_fn, OPTIMIZERS["sgd"]
    )
    for config in configs:
        out = tmp_path / config.replace(":", "-")
        assert json.loads((out / "done.json").read_text())["global_step"] == NUM_BATCHES
        got = torch.load(out / "weights.pt")
        for key, tensor in expected.items():
            diff = (got[f"net.{key}"] - tensor).abs().max().item()
            assert diff <= 1e-5, f"{config} {key}: {diff}"
    plan = Plan.from_json((tmp_path / "pipedream_plan.json").read_text())  # the last fit's
    assert (plan.placement, plan.num_stages, plan.num_workers) == ("interleaved", 4, 2)

"""A rank of several stages: the layers of each, the V's turn handed over in memory, the rank's
update applied once all of its stages stepped, and whole pipelines on one rank (every message
handed over) equal to one device. Multi-rank runs: tests/engine/test_pipeline.py and
tests/strategy/test_fit.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pl_pipedream
from pl_pipedream import Pipeline
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.chunks import Loopback, RankUpdate, chunk_of
from pl_pipedream.runtime.frames import Message
from pl_pipedream.runtime.lookahead import ExecutorError
from pl_pipedream.runtime.tags import Tag
from tests.engine.test_pipeline import build_model, make_batches, make_model, one_device, sgd
from tests.runtime.distributed import one_rank_group


def test_chunk_of_takes_a_stages_layers_under_their_names() -> None:
    layers = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2), nn.Linear(2, 2))
    plan = Plan.from_balance([1, 1, 1, 1], placement="v")
    rank_layers = nn.Sequential()
    for node in ("1", "2"):  # rank 1 holds stages 1 and 2 (layers 1 and 2)
        rank_layers.add_module(node, layers[int(node)])
    second = chunk_of(rank_layers, plan.stages[2])
    assert list(second._modules) == ["2"] and second[0] is layers[2]
    assert [n for n, _ in second.named_parameters()] == ["2.weight", "2.bias"]


def test_the_turn_of_a_v_is_handed_over_as_a_copy_in_order() -> None:
    with one_rank_group():
        channel = Channel(0, torch.device("cpu"), 5.0, "rank 0 (stage 1)")
        loop = Loopback(channel)
        x = torch.ones(3, requires_grad=True) * 2  # a stage's output: part of its graph
        loop.send(Message([x], fingerprint=1.5), 0, Tag.ACTIVATION, "the activations of 0")
        loop.send(Message([x + 1]), 0, Tag.ACTIVATION, "the activations of 1")
        got = loop.recv(0, Tag.ACTIVATION, "the activations of 0")
        assert got.fingerprint == 1.5 and torch.equal(got.tensors[0], x)
        received = got.tensors[0]
        assert received.is_leaf and received.requires_grad  # its gradient travels back
        assert received.data_ptr() != x.data_ptr()  # in-place use cannot reach the sender
        assert torch.equal(loop.recv(0, Tag.ACTIVATION, "1").tensors[0], x + 1)
        with pytest.raises(ExecutorError, match=r"only once it is sent \(rank 0: the grad"):
            loop.recv(0, Tag.GRAD, "the gradients of minibatch 0")
        channel.close()


def test_the_rank_update_waits_for_every_stage() -> None:
    applied = []

    def update(gradients: dict, storage: dict) -> int:
        applied.append(sorted(gradients))
        return 7

    rank = RankUpdate([0, 3])
    assert rank.of_stage(0, None) is None
    first, last = rank.of_stage(0, update), rank.of_stage(3, update)
    assert first is not None and last is not None
    assert first({"0.weight": torch.ones(1)}, {}) == 0 and rank.stepped == [0] and applied == []
    assert last({"5.weight": torch.ones(1)}, {}) == 7
    assert applied == [["0.weight", "5.weight"]] and rank.stepped == []
    first({}, {})
    with pytest.raises(ExecutorError, match=r"stage 0 stepped twice before stages \[3\]"):
        first({}, {})


@pytest.mark.parametrize(
    ("sync", "balance"), [("zbv", [3, 3]), ("interleaved", [2, 1, 2, 1])], ids=["zbv", "interl"]
)
def test_a_whole_pipeline_on_one_rank_equals_one_device(sync: str, balance: list[int]) -> None:
    """Every stage on rank 0: every message between stages is handed over in memory."""
    with one_rank_group():
        with Pipeline(
            make_model(), nn.functional.mse_loss, sgd, sync=sync, microbatches=2, balance=balance
        ) as pipeline:
            assert len(pipeline.local.stages) == len(balance)
            losses = [pipeline.train_step(batch).item() for batch in make_batches()]
            weights = pipeline.state_dict()["model"]
    expected_losses, expected = one_device(make_batches())
    assert losses == pytest.approx(expected_losses, abs=1e-6)
    for name, tensor in expected.items():
        assert torch.allclose(weights[name], tensor, rtol=0, atol=1e-6), name


def test_the_chunked_modes_refuse_a_tie_and_re_planning_at_construction() -> None:
    tied = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    tied[2].weight = tied[0].weight  # one parameter on stages 0 and 1
    with one_rank_group():
        with pytest.raises(ValueError, match=r"^sync='zbv' trains without tied parameters"):
            Pipeline(tied, nn.functional.mse_loss, sgd, sync="zbv", balance=[2, 1])
        with pytest.raises(ValueError, match=r"^sync='interleaved' keeps the plan it starts wi"):
            Pipeline(make_model(), nn.functional.mse_loss, sgd, sync="interleaved", replan="auto")


def _trained(sync: str, balance: list[int], options: dict) -> tuple[list[float], dict]:
    with Pipeline(
        make_model(), nn.functional.mse_loss, sgd, sync=sync, microbatches=2, balance=balance,
        **options,
    ) as pipeline:  # fmt: skip
        losses = [pipeline.train_step(batch).item() for batch in make_batches()]
        return losses, pipeline.state_dict()["model"]


@pytest.mark.parametrize(
    "options",
    [{"recompute": True}, {"clip_grad_norm": 0.5}, {"precision": "bf16-mixed"}],
    ids=["recompute", "clip", "bf16"],
)
def test_recompute_clipping_and_mixed_precision_compose_with_chunks(options: dict) -> None:
    """Each as one stage trains with it: recompute replays each chunk's forward, the norm
    counts every chunk's gradients once, autocast wraps each chunk's forward."""
    with one_rank_group():
        expected_losses, expected = _trained("flush", [6], options)
        for sync, balance in (("zbv", [3, 3]), ("interleaved", [2, 1, 2, 1])):
            losses, weights = _trained(sync, balance, options)
            assert losses == expected_losses, sync
            for name, tensor in expected.items():
                assert torch.equal(weights[name], tensor), (sync, name)


def test_a_checkpoint_saved_in_a_v_resumes_interleaved_and_in_one_stage(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The rank's stages save under the model's names: any plan over the layers resumes."""
    batches = make_batches()
    expected_losses, expected = one_device(batches)
    with one_rank_group():
        with Pipeline(
            make_model(), nn.functional.mse_loss, sgd, sync="zbv", microbatches=2, balance=[3, 3]
        ) as pipeline:
            for batch in batches[:2]:
                pipeline.train_step(batch)
            pipeline.save(tmp_path / "checkpoint")
        # one shard per rank, named after the last stage the rank holds (docs/checkpoints.md)
        assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [
            "pipeline.json",
            "stage-01.pt",
        ]
        for sync, balance in (("interleaved", [1, 2, 1, 2]), ("flush", [6])):
            with Pipeline(
                make_model(), nn.functional.mse_loss, sgd, sync=sync, microbatches=2,
                balance=balance,
            ) as pipeline:  # fmt: skip
                pipeline.load(tmp_path / "checkpoint")
                losses = [pipeline.train_step(batch).item() for batch in batches[2:]]
                weights = pipeline.state_dict()["model"]
            assert losses == pytest.approx(expected_losses[2:], abs=1e-6), sync
            for name, tensor in expected.items():
                assert torch.allclose(weights[name], tensor, rtol=0, atol=1e-6), (sync, name)


def test_the_timeline_switch_reaches_every_stage_and_records_in_the_ranks_order() -> None:
    with one_rank_group():
        with Pipeline(
            make_model(), nn.functional.mse_loss, sgd, sync="zbv", microbatches=2, balance=[3, 3]
        ) as pipeline:
            executor = pipeline.runner.executor  # type: ignore[union-attr]
            assert not executor.record_timeline
            executor.record_timeline = True
            pipeline.train_step(make_batches()[0])
            events = executor.take_timeline()
    assert {e.action[0] for e in events if e.kind == "FORWARD"} == {"0", "1"}  # "<stage>F..."
    assert [e.start for e in events] == sorted(e.start for e in events)


def test_pretrained_weights_reach_every_stage_of_the_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trained = make_model()
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(1.0)
    torch.save(trained.state_dict(), tmp_path / "weights.pt")
    with one_rank_group():
        with Pipeline(
            make_model(), nn.functional.mse_loss, sgd, sync="zbv", balance=[3, 3],
            pretrained=tmp_path / "weights.pt",
        ) as pipeline:  # fmt: skip
            weights = pipeline.state_dict()["model"]
    for name, tensor in trained.state_dict().items():
        assert torch.equal(weights[name], tensor), name


def test_an_empty_build_creates_every_stage_of_the_rank() -> None:
    """Built on ``meta``: the rank creates the layers of each stage it holds, as the whole
    build would (the record replays the same draws), and trains as one device."""
    torch.manual_seed(0)
    with pl_pipedream.empty_build() as build:
        layers = build_model()
    with one_rank_group():
        with Pipeline(
            layers, nn.functional.mse_loss, sgd, sync="zbv", microbatches=2, balance=[3, 3],
            empty_build=build,
        ) as pipeline:  # fmt: skip
            losses = [pipeline.train_step(batch).item() for batch in make_batches()]
            weights = pipeline.state_dict()["model"]
    expected_losses, expected = one_device(make_batches())
    assert losses == pytest.approx(expected_losses, abs=1e-6)
    for name, tensor in expected.items():
        assert torch.allclose(weights[name], tensor, rtol=0, atol=1e-6), name

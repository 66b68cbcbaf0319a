"""Several tensors per stage boundary: tuples, lists, dicts and namedtuples of tensors, with
``None``, integer tensors and Python scalars, in one message per boundary.

In-process: the structure survives ``flatten``/``unflatten`` and the frame; what cannot cross
stops the sending stage with an error naming the layer, the stage and the value. Over gloo: the
Seq2Seq example's layers and a toy chain, every sync mode, against the oracle (which calls each
layer with one argument, as ``nn.Sequential`` does).
"""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pl_pipedream.data.sequences import PAD, SequenceDataModule
from pl_pipedream.models.seq2seq import Seq2Seq
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.boundary import CrossingError, flatten, unflatten
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.executor import ExecutorError, StageExecutor
from pl_pipedream.runtime.feed import Feed
from pl_pipedream.runtime.frames import Message, layout_of, pack, unpack
from pl_pipedream.schedule import build
from pl_pipedream.schedule.actions import Action, ActionKind
from pl_pipedream.schedule.modes import SyncMode, update_settings
from tests.runtime import oracle
from tests.runtime.distributed import run
from tests.runtime.test_executor import MODES, optimizer_update

Pair = namedtuple("Pair", "left right")
NUM_BATCHES = 4


def roundtrip(value: Any) -> Any:
    """``value`` through flatten, a frame and unflatten, as a receiving stage gets it."""
    tensors, structure = flatten(value)
    message = Message(tensors, structure=structure)
    layout = layout_of(message)
    assert layout[2] % 8 == 0  # whole words: a view of any dtype can be saved and loaded back
    frame = pack(message, layout, layout[2], torch.device("cpu"))
    received = unpack(frame, frame[:512].view(torch.int64).tolist())
    return unflatten(received.tensors, received.structure)


def test_a_lone_tensor_has_no_structure_and_keeps_asking_for_its_gradient() -> None:
    tensor = torch.randn(3, 2, requires_grad=True) * 2
    tensors, structure = flatten(tensor)
    assert structure is None and tensors[0] is tensor
    back = roundtrip(tensor)
    assert torch.equal(back, tensor) and back.requires_grad


def test_nested_structures_cross_with_none_scalars_and_integer_tensors() -> None:
    grad = torch.randn(2, 3, requires_grad=True) + 0
    value = (
        grad,
        {"ids": torch.arange(4), "mask": torch.tensor([True, False]), 7: None, "k": 2},
        [Pair(torch.ones(1, dtype=torch.float16), "tag"), 0.5, True, None],
    )
    back = roundtrip(value)
    assert isinstance(back, tuple) and isinstance(back[2], list)
    assert isinstance(back[2][0], Pair) and back[2][0].right == "tag"
    assert back[1][7] is None and back[1]["k"] == 2 and back[2][1:] == [0.5, True, None]
    assert torch.equal(back[0], grad) and back[0].requires_grad
    assert back[1]["ids"].dtype == torch.int64 and not back[1]["ids"].requires_grad
    assert torch.equal(back[1]["mask"], value[1]["mask"])
    assert list(back[1]) == ["ids", "mask", 7, "k"]


@pytest.mark.parametrize(
    ("value", "where", "what"),
    [
        ((torch.ones(1), nn.Linear(1, 1)), r"output\[1\]", "an object of type Linear"),
        ({"x": object()}, r"output\['x'\]", "an object of type object"),
        ([torch.zeros(2, dtype=torch.complex64)], r"output\[0\]", "dtype torch.complex64"),
        ((torch.eye(2).to_sparse(),), r"output\[0\]", "sparse_coo"),
    ],
)
def test_what_cannot_cross_is_located_inside_the_output(value: Any, where: str, what: str) -> None:
    with pytest.raises(CrossingError, match=rf"^{where}: .*{what}"):
        flatten(value)


class Handover(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, nn.Module]:
        return x, self


def test_the_sending_stage_names_the_layer_the_stage_and_what_it_returned() -> None:
    module = nn.Sequential(OrderedDict([("0", nn.Linear(2, 2)), ("1", Handover())]))
    executor = StageExecutor(
        module, 0, 0, 2, Channel(0, torch.device("cpu")), update_settings(SyncMode("flush"), 1, 1)
    )
    forward = Action(ActionKind.FORWARD, 0, 0, 0, minibatch=0, batch=0, version=0)
    feed = Feed(lambda i: torch.ones(1, 2), lambda out, i: out.sum())
    with pytest.raises(ExecutorError) as error:
        executor.execute([forward], feed)
    text = str(error.value)
    assert "(layer 1: Handover, on rank 0 (stage 0), returned output[1]: an object of type " in text
    assert "Handover); return only such values from the layers of configure_pipeline()" in text


# ----- over gloo, against the oracle --------------------------------------------------------------


class Split(nn.Module):
    """Returns a list holding a tensor and a dict of everything else that may ride along."""

    def forward(self, h: torch.Tensor) -> list[Any]:
        constant = torch.full_like(h[:, :1], 0.5)  # floating, but asks for no gradient
        extras = {"rest": h[:, 3:], "k": 2, "tag": "a", "on": True, "none": None}
        return [h[:, :3], {**extras, "ids": torch.arange(h.shape[0]), "constant": constant}]


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, value: list[Any]) -> torch.Tensor:
        head, extras = value
        assert extras["tag"] == "a" and extras["on"] is True and extras["none"] is None
        assert extras["ids"].dtype == torch.int64 and not extras["constant"].requires_grad
        return self.linear(head * extras["k"] + extras["rest"] + extras["constant"])


def toy_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), Split(), Merge())


def toy_batches(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2 * m, 4, generator=generator), torch.randn(2 * m, 2, generator=generator))
        for _ in range(NUM_BATCHES)
    ]


def toy_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def seq2seq_model() -> nn.Sequential:
    torch.manual_seed(0)
    net = Seq2Seq((6,), 12, hidden=8)
    return nn.Sequential(*net.configure_pipeline())


def seq2seq_batches(m: int) -> list[tuple[Any, torch.Tensor]]:
    data = SequenceDataModule(num_examples=2 * m * NUM_BATCHES, vocab=12, length=6, min_length=3)
    source, decoder_input, target = data.tensors()
    rows = [slice(b * 2 * m, (b + 1) * 2 * m) for b in range(NUM_BATCHES)]
    return [((source[r], decoder_input[r]), target[r]) for r in rows]


def seq2seq_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, 12), target.reshape(-1), ignore_index=PAD)


MODELS = {
    "toy": (toy_model, toy_batches, toy_loss, {2: [2, 1], 3: [1, 1, 1]}),
    "seq2seq": (seq2seq_model, seq2seq_batches, seq2seq_loss, {2: [1, 4], 3: [2, 1, 2]}),
}


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.5)


def _train_stage(rank: int, name: str, plan: Plan, sync: str, m: int) -> dict[str, torch.Tensor]:
    make_model, make_batches, loss_fn, _ = MODELS[name]
    model = make_model()
    stage = plan.stage_of_rank(rank)
    module = nn.Sequential(OrderedDict((n, model[int(n)]) for n in stage.nodes))
    optimizer = sgd(list(module.parameters())) if list(module.parameters()) else None
    batches = make_batches(m)
    xs = [x for batch in batches for x in oracle.chunk(batch[0], m)]
    ys = [y for batch in batches for y in oracle.chunk(batch[1], m)]

    apply_update = optimizer_update(module, optimizer)
    executor = StageExecutor(
        module,
        rank,
        stage.index,
        plan.num_stages,
        Channel(rank, torch.device("cpu"), timeout=60.0),
        update_settings(SyncMode(sync), m, 1),
    )
    feed = Feed(lambda i: xs[i], lambda out, i: loss_fn(out, ys[i]))
    executor.execute(build(plan, sync, NUM_BATCHES, m).actions[rank], feed, apply_update)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _all(rank: int, world: int) -> dict:
    out = {}
    for name, (*_, balances) in MODELS.items():
        plan = Plan.from_balance(balances[world])
        for sync in MODES:
            out[name, sync] = _train_stage(rank, name, plan, sync, world)
            dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_structured_boundaries_train_as_the_oracle_in_every_mode(world: int) -> None:
    results = run(world, _all, timeout=240.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    for name, (make_model, make_batches, loss_fn, balances) in MODELS.items():
        plan = Plan.from_balance(balances[world])
        for sync in MODES:
            batches = make_batches(world)  # as many microbatches as stages (2bw needs them)
            expected = oracle.train(make_model(), plan, sync, batches, world, loss_fn, sgd)
            for rank in range(world):
                for key, tensor in results[rank][1][name, sync].items():
                    diff = (tensor - expected[key]).abs().max().item()
                    assert diff <= 1e-5, f"{name} {sync} rank {rank} {key}: {diff}"
            before = make_model().state_dict()
            assert any(not torch.equal(before[k], expected[k]) for k in expected)

"""A split backward on one stage, in one process: the input half gives the received tensors the
gradient a whole backward gives them, at once; the weight half later adds the weight gradients a
whole backward adds, running only the Linear layers' weight products; a weight half without its
input half is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.executor import ExecutorError, StageExecutor
from pl_pipedream.runtime.feed import Feed
from pl_pipedream.runtime.frames import Message
from pl_pipedream.schedule.actions import Action, ActionKind
from pl_pipedream.schedule.modes import SyncMode, update_settings

aten = torch.ops.aten
K = ActionKind
M = 2


def make_stage() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 3, generator=generator) for _ in range(M)]
    ys = [torch.randn(5, 2, generator=generator) for _ in range(M)]
    return xs, ys


def last_stage(module: nn.Module, fused_from: int | None = 0) -> StageExecutor:
    """Stage 1 of 2 (it receives activations that require grad and computes the loss); its
    Linear layers hold their products from ``fused_from`` elements (0: these small ones too;
    None: the default, above them)."""
    settings = update_settings(SyncMode.ZERO_BUBBLE, M, 1, fused_from)
    return StageExecutor(module, 1, 1, 2, Channel(1, torch.device("cpu"), timeout=5.0), settings)


def action(kind: ActionKind, i: int | None, version: int) -> Action:
    batch = None if i is None else i // M
    return Action(kind, rank=1, stage=1, replica=0, minibatch=i, batch=batch, version=version)


@pytest.mark.parametrize("fused_from", [0, None])
def test_the_halves_give_what_a_whole_backward_gives(fused_from: int | None) -> None:
    """With the products held (``fused_from`` 0) and without (None: layers below the default:
    the input half computes every gradient, the weight half adds none)."""
    xs, ys = data()
    reference = make_stage()
    expected_inputs = []
    for x, y in zip(xs, ys, strict=True):
        given = x.clone().requires_grad_()
        (nn.functional.mse_loss(reference(given), y) / M).backward()
        expected_inputs.append(given.grad)

    module = make_stage()
    executor = last_stage(module, fused_from)
    received = [x.clone().requires_grad_() for x in xs]
    for i, tensor in enumerate(received):
        executor._received[i] = Message([tensor])
    applied: dict[str, torch.Tensor] = {}

    def update(gradients: dict[str, torch.Tensor], storage: dict) -> int:
        applied.update({k: v.clone() for k, v in gradients.items()})
        return 0

    feed = Feed(lambda i: None, lambda out, i: nn.functional.mse_loss(out, ys[i]))
    first = [action(K.FORWARD, 0, 0), action(K.FORWARD, 1, 0), action(K.BACKWARD_INPUT, 0, 0)]
    executor.execute(first, feed, update, flush=False)
    assert torch.allclose(received[0].grad, expected_inputs[0], rtol=0, atol=1e-7)
    assert received[1].grad is None and not applied
    rest = [
        action(K.BACKWARD_INPUT, 1, 0),
        action(K.BACKWARD_WEIGHT, 0, 0),
        action(K.BACKWARD_WEIGHT, 1, 0),
        action(K.STEP, None, 1),
    ]
    executor.execute(rest, feed, update)
    assert torch.allclose(received[1].grad, expected_inputs[1], rtol=0, atol=1e-7)
    assert applied.keys() == dict(reference.named_parameters()).keys()
    for name, param in reference.named_parameters():
        assert torch.allclose(applied[name], param.grad, rtol=0, atol=1e-7), name
    # nothing owed; the flights wait only for their SEND_GRAD (left out here), weights released
    assert not executor._owed and all(not f.params for f in executor._flight.values())


def test_a_weight_half_before_its_input_half_is_refused() -> None:
    xs, ys = data()
    executor = last_stage(make_stage())
    executor._received[0] = Message([xs[0].clone().requires_grad_()])
    feed = Feed(lambda i: None, lambda out, i: nn.functional.mse_loss(out, ys[i]))
    with pytest.raises(
        ExecutorError,
        match=r"the weight half of minibatch 0 follows its input half on the forward's weights "
        r"\(input half run: False",
    ):
        executor.execute([action(K.FORWARD, 0, 0), action(K.BACKWARD_WEIGHT, 0, 0)], feed)


class Products(TorchDispatchMode):
    """Counts the matrix products run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (aten.mm, aten.addmm, aten.bmm, aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def counted(executor: StageExecutor, actions: list[Action], feed: Feed, update) -> int:  # type: ignore[no-untyped-def]
    with Products() as products:
        executor.execute(actions, feed, update, flush=False)
    return products.count


def test_the_halves_run_the_products_of_one_backward_and_no_more() -> None:
    """Two Linear layers, the input's gradient wanted: a whole backward runs 4 matrix products
    per minibatch (2 for the input gradients, 2 for the weights). The input half runs the 2 of
    the input gradients, the weight half the 2 of the weights, without walking the graph again.
    """
    xs, ys = data()
    executor = last_stage(make_stage())
    for i, x in enumerate(xs):
        executor._received[i] = Message([x.clone().requires_grad_()])
    feed = Feed(lambda i: None, lambda out, i: nn.functional.mse_loss(out, ys[i]))
    update = lambda gradients, storage: 0  # noqa: E731
    executor.execute([action(K.FORWARD, 0, 0), action(K.FORWARD, 1, 0)], feed, flush=False)
    inputs = [counted(executor, [action(K.BACKWARD_INPUT, i, 0)], feed, update) for i in (0, 1)]
    weights = [counted(executor, [action(K.BACKWARD_WEIGHT, i, 0)], feed, update) for i in (0, 1)]
    assert inputs == [2, 2] and weights == [2, 2]
    executor.execute([action(K.STEP, None, 1)], feed, update)


def test_small_layers_hold_nothing_the_input_half_runs_a_whole_backwards_products() -> None:
    """Layers below the default size (``linear_sums.fused_from``): the input half runs the 4
    products of a whole backward, the weight half none (holding them would cost more than it
    saves)."""
    xs, ys = data()
    executor = last_stage(make_stage(), None)
    for i, x in enumerate(xs):
        executor._received[i] = Message([x.clone().requires_grad_()])
    feed = Feed(lambda i: None, lambda out, i: nn.functional.mse_loss(out, ys[i]))
    update = lambda gradients, storage: 0  # noqa: E731
    executor.execute([action(K.FORWARD, 0, 0), action(K.FORWARD, 1, 0)], feed, flush=False)
    inputs = [counted(executor, [action(K.BACKWARD_INPUT, i, 0)], feed, update) for i in (0, 1)]
    weights = [counted(executor, [action(K.BACKWARD_WEIGHT, i, 0)], feed, update) for i in (0, 1)]
    assert inputs == [4, 4] and weights == [0, 0]
    executor.execute([action(K.STEP, None, 1)], feed, update)


class FirstStage(nn.Module):
    """An embedding whose weight a Linear reuses (a tie inside the stage), a LayerNorm, a Linear
    with a bias and one without: the input (tokens) needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(7, 4)
        self.norm = nn.LayerNorm(4)
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 4, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embedding(tokens))
        x = x + self.down(torch.tanh(self.up(x)))
        return nn.functional.linear(x, self.embedding.weight)  # (rows, 3, 7)


@pytest.mark.parametrize("fused_from", [0, None])
def test_a_first_stage_with_a_tie_and_a_layer_norm_gets_a_whole_backwards_gradients(
    fused_from: int | None,
) -> None:
    """Stage 0 of 2 receives the output's gradients: the weights a held Linear covers come from
    the weight half, the others (LayerNorm, the embedding's own use) from the input half; their
    sum is a whole backward's. Without held products (small layers), all from the input half."""
    generator = torch.Generator().manual_seed(3)
    tokens = [torch.randint(7, (5, 3), generator=generator) for _ in range(M)]
    seeds = [torch.randn(5, 3, 7, generator=generator) for _ in range(M)]
    reference = FirstStage()
    for t, g in zip(tokens, seeds, strict=True):
        reference(t).backward(g)

    settings = update_settings(SyncMode.ZERO_BUBBLE, M, 1, fused_from)
    channel = Channel(0, torch.device("cpu"), timeout=5.0)
    executor = StageExecutor(FirstStage(), 0, 0, 2, channel, settings)
    for i, g in enumerate(seeds):
        executor._gradients[i] = Message([g])
    applied: dict[str, torch.Tensor] = {}

    def update(gradients: dict[str, torch.Tensor], storage: dict) -> int:
        applied.update({k: v.clone() for k, v in gradients.items()})
        return 0

    def first(kind: ActionKind, i: int | None, version: int) -> Action:
        batch = None if i is None else i // M
        return Action(kind, rank=0, stage=0, replica=0, minibatch=i, batch=batch, version=version)

    feed = Feed(lambda i: tokens[i], lambda out, i: out.sum())
    actions = [first(K.FORWARD, i, 0) for i in range(M)]
    actions += [first(K.BACKWARD_INPUT, i, 0) for i in range(M)]
    actions += [first(K.BACKWARD_WEIGHT, i, 0) for i in range(M)]
    executor.execute([*actions, first(K.STEP, None, 1)], feed, update)
    assert applied.keys() == dict(reference.named_parameters()).keys()
    for name, param in reference.named_parameters():
        # summed, not averaged: the last stage's seeds carry the 1/M (gradients near 30 here)
        assert torch.allclose(applied[name], param.grad, rtol=1e-6, atol=1e-6), name
    assert not executor._owed

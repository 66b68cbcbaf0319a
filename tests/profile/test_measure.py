"""profile_layers times real layers on CPU, counts bytes exactly and leaves the model alone."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys

import pytest
import torch
from torch import Tensor, nn

from pl_pipedream.profile import profile_layers
from pl_pipedream.profile.graph import Profile, ProfileError
from pl_pipedream.profile.measure import profile_layers_one_at_a_time

BATCH = 6


class Split(nn.Module):
    """Returns a tuple: the input and its row sums."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x.sum(dim=1, keepdim=True)


class Join(nn.Module):
    """Takes the tuple from ``Split`` as one argument."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width + 1, width)

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return self.linear(torch.cat(pair, dim=1))


class AddOne(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + 1


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(inplace=True),
        nn.Dropout(0.5),
        nn.Linear(32, 4),
    )


def profile(model: nn.Sequential, sample: Tensor | tuple, **kwargs: object) -> Profile:
    return profile_layers(model, sample, warmup=1, repeats=3, **kwargs)  # type: ignore[arg-type]


# ----- what is measured -----------------------------------------------------------------------


def test_chain_of_nodes_with_exact_bytes() -> None:
    model = mlp()
    result = profile(model, torch.randn(BATCH, 8))
    assert [n.node_id for n in result.nodes] == [f"layer{i}" for i in range(5)]
    assert result.is_chain()
    assert [n.activation_bytes for n in result.nodes] == [
        (BATCH * 32 * 4.0,),
        (BATCH * 32 * 4.0,),
        (BATCH * 32 * 4.0,),
        (BATCH * 32 * 4.0,),
        (BATCH * 4 * 4.0,),
    ]
    # BatchNorm's running statistics are buffers, not parameters.
    assert [n.parameter_bytes for n in result.nodes] == [
        (8 * 32 + 32) * 4.0,
        2 * 32 * 4.0,
        0.0,
        0.0,
        (32 * 4 + 4) * 4.0,
    ]
    assert result.batch_size == BATCH
    assert result.nodes[0].desc == "Linear(in_features=8, out_features=32, bias=True)"
    assert result.meta["device"] == "cpu"
    assert result.meta["torch"] == torch.__version__
    assert result.meta["repeats"] == "3"


def test_bytes_follow_the_dtype() -> None:
    model = nn.Sequential(nn.Linear(3, 5)).double()
    result = profile(model, torch.randn(BATCH, 3, dtype=torch.float64))
    assert result.nodes[0].activation_bytes == (BATCH * 5 * 8.0,)
    assert result.nodes[0].parameter_bytes == (3 * 5 + 5) * 8.0


def test_compute_layers_have_positive_finite_times() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    result = profile(model, torch.randn(BATCH, 3, 8, 8))
    for node in result.nodes:
        assert math.isfinite(node.forward_ms) and node.forward_ms > 0
        assert math.isfinite(node.backward_ms) and node.backward_ms > 0


def test_layer_returning_a_tuple_passes_it_on_as_one_argument() -> None:
    model = nn.Sequential(nn.Linear(8, 16), Split(), Join(16))
    result = profile(model, torch.randn(BATCH, 8))
    assert result.nodes[1].activation_bytes == (BATCH * 16 * 4.0, BATCH * 1 * 4.0)
    assert result.nodes[1].output_bytes == BATCH * 17 * 4.0
    assert result.nodes[1].backward_ms > 0
    assert result.nodes[2].activation_bytes == (BATCH * 16 * 4.0,)
    again = Profile.from_graph_txt(result.to_graph_txt())
    assert again.nodes == result.nodes


class Fields(dict):  # type: ignore[type-arg]
    """A dict subclass a layer returns (as Hugging Face's ``ModelOutput`` is one)."""


class ToFields(nn.Module):
    def forward(self, x: Tensor) -> Fields:
        return Fields(hidden=x * 2)


class FromFields(nn.Module):
    def forward(self, fields: Fields) -> Tensor:
        assert type(fields) is Fields, type(fields)  # the next layer gets what was returned
        return fields["hidden"].sum(dim=1)


def test_a_dict_subclass_between_layers_keeps_its_type() -> None:
    result = profile(
        nn.Sequential(nn.Linear(4, 4), ToFields(), FromFields()), torch.randn(BATCH, 4)
    )
    assert result.nodes[1].output_bytes == BATCH * 4 * 4.0


def test_tuple_sample_reaches_the_first_layer_as_one_argument() -> None:
    model = nn.Sequential(Join(4))
    result = profile(model, (torch.randn(BATCH, 4), torch.randn(BATCH, 1)))
    assert result.batch_size == BATCH
    assert result.nodes[0].activation_bytes == (BATCH * 4 * 4.0,)


def test_layers_without_a_gradient_get_no_backward_time() -> None:
    # Integer tokens: AddOne has nothing to differentiate; Embedding's weights do.
    model = nn.Sequential(AddOne(), nn.Embedding(12, 4), nn.ReLU())
    result = profile(model, torch.randint(0, 10, (BATCH, 5)))
    assert result.nodes[0].backward_ms == 0.0
    assert result.nodes[0].activation_bytes == (BATCH * 5 * 8.0,)
    assert result.nodes[1].backward_ms > 0
    assert result.nodes[2].backward_ms > 0


def test_first_layer_input_needs_a_gradient_only_if_the_sample_does() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 2))
    plain = profile(model, torch.randn(BATCH, 3, 4))
    assert plain.nodes[0].backward_ms == 0.0  # no parameters, no gradient into the data
    wanted = profile(model, torch.randn(BATCH, 3, 4, requires_grad=True))
    assert wanted.nodes[0].backward_ms > 0


def test_long_multi_line_reprs_become_one_short_line() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    desc = profile(model, torch.randn(BATCH, 4)).nodes[0].desc
    assert "\n" not in desc
    assert len(desc) <= 80
    assert desc.startswith("Sequential( (0): Linear(") and desc.endswith("...")


def test_explicit_device() -> None:
    result = profile(mlp(), torch.randn(BATCH, 8), device="cpu")
    assert result.meta["device"] == "cpu"


# ----- the model is left alone ------------------------------------------------------------------


def snapshot(model: nn.Module) -> dict[str, object]:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "grad_ids": [id(p.grad) for p in model.parameters()],
        "modes": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
    }


def assert_unchanged(model: nn.Module, before: dict[str, object]) -> None:
    after = snapshot(model)
    state_before, state_after = before["state"], after["state"]
    assert isinstance(state_before, dict) and isinstance(state_after, dict)
    assert state_before.keys() == state_after.keys()
    assert all(torch.equal(state_before[k], state_after[k]) for k in state_before)
    for old, new in zip(before["grads"], after["grads"], strict=True):  # type: ignore[call-overload]
        assert (old is None and new is None) or torch.equal(old, new)
    for key in ("grad_ids", "modes", "requires_grad"):
        assert before[key] == after[key], key


@pytest.mark.parametrize("mode", ["train", "eval", "mixed"])
def test_parameters_buffers_grads_modes_and_rng_are_unchanged(mode: str) -> None:
    model = mlp()
    model.train(mode == "train")
    if mode == "mixed":
        model[1].train()
    first, last = model[0], model[4]
    assert isinstance(first, nn.Linear) and isinstance(last, nn.Linear)
    first.weight.grad = torch.full_like(first.weight, 0.5)  # an existing gradient
    last.bias.requires_grad_(False)  # a frozen parameter
    sample = torch.randn(BATCH, 8)
    before = snapshot(model)
    rng = torch.get_rng_state()
    profile(model, sample)
    assert_unchanged(model, before)
    assert torch.equal(rng, torch.get_rng_state())


def test_sample_is_unchanged_by_in_place_layers() -> None:
    sample = torch.randn(BATCH, 8)
    kept = sample.clone()
    profile(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 2)), sample)
    assert torch.equal(sample, kept)


def test_model_is_restored_when_a_layer_fails() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(8, 4))
    model.eval()
    before = snapshot(model)
    with pytest.raises(ProfileError):
        profile(model, torch.randn(BATCH, 8))
    assert_unchanged(model, before)


# ----- errors ---------------------------------------------------------------------------------


def test_empty_sequential_is_rejected() -> None:
    with pytest.raises(ProfileError, match="at least one layer"):
        profile_layers(nn.Sequential(), torch.randn(2, 2))


def test_failing_layer_is_named_by_index_and_type_with_the_layer_before_and_its_input() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(8, 4))
    found = (
        r"layer 2: Linear, after layer 1: ReLU, on cpu, while profiling; passed: Tensor\(6, 16\)"
    )
    with pytest.raises(ProfileError, match=found) as info:
        profile(model, torch.randn(BATCH, 8))
    assert isinstance(info.value.__cause__, RuntimeError)


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def test_a_tuple_the_next_layer_cannot_take_names_the_boundary_one_layer_at_a_time_too() -> None:
    model = nn.Sequential(nn.Linear(8, 16), _Pair(), nn.Linear(16, 4))
    found = r"\(layer 2: Linear, after layer 1: _Pair, .*passed: tuple\(Tensor\(6, 16\) float32, "
    for run in (
        lambda: profile(model, torch.randn(BATCH, 8)),
        lambda: profile_layers_one_at_a_time(
            model, torch.randn(BATCH, 8), contextlib.nullcontext, device="cpu"
        ),
    ):
        with pytest.raises(ProfileError, match=found) as info:
            run()
        assert type(info.value.__cause__) is TypeError


def test_not_a_sequential_is_rejected() -> None:
    with pytest.raises(TypeError, match="nn.Sequential"):
        profile_layers(nn.Linear(2, 2), torch.randn(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize(("warmup", "repeats"), [(-1, 5), (2, 0)])
def test_bad_counts_are_rejected(warmup: int, repeats: int) -> None:
    with pytest.raises(ProfileError, match="repeats >= 1"):
        profile_layers(mlp(), torch.randn(2, 8), warmup=warmup, repeats=repeats)


# ----- packaging ------------------------------------------------------------------------------


def test_importing_the_profile_package_does_not_import_torch() -> None:
    code = (
        "import sys, pl_pipedream.profile as p; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "from pl_pipedream.profile.graph import Profile; "
        "assert callable(p.profile_layers) and 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_tensor_crossing_a_cut_is_measured_and_reaches_the_planner() -> None:
    """The Seq2Seq example's boundaries are dicts and tuples holding float and int64 tensors,
    an LSTM state pair, None and a float; the profile sums every tensor's bytes, and the plan
    charges a stage for all of them at the cut before it."""
    from pl_pipedream.models.seq2seq import Seq2Seq
    from pl_pipedream.planner import Topology
    from pl_pipedream.planner.optimize import plan

    batch, length, hidden = 4, 6, 8
    layers = Seq2Seq((length,), 12, hidden=hidden).configure_pipeline()
    tokens = torch.randint(2, 12, (batch, length))
    result = profile(layers, (tokens, tokens))
    sequence = batch * length * hidden * 4.0
    assert sorted(result.nodes[0].activation_bytes) == sorted(
        (sequence, sequence, batch * length * 8.0)  # memory, stream, int64 source; state None
    )
    encoder = result.nodes[1].activation_bytes  # memory, stream, source, (h, c)
    assert sorted(encoder) == sorted(
        (sequence, sequence, batch * length * 8.0, *[batch * hidden * 4.0] * 2)
    )
    assert result.nodes[2].output_bytes == 2 * sequence + batch * length * 8.0  # + a float
    chosen = plan(result, Topology.flat(2, 1e6), straight=True)
    by_id = {node.node_id: node for node in result.nodes}
    assert chosen.stages[1].input_bytes == by_id[chosen.stages[0].nodes[-1]].output_bytes


# ----- one layer at a time --------------------------------------------------------------------


def test_one_layer_at_a_time_measures_what_the_whole_chain_measures() -> None:
    """A model on ``meta`` is profiled with each layer loaded alone: the same chain, bytes and
    descriptions as the whole model's profile, times for every layer, and never two layers
    holding memory at once."""
    whole = mlp()
    with torch.device("meta"):
        empty = mlp()
    loaded_at_once: list[int] = []

    @contextlib.contextmanager
    def load(layer: nn.Module):  # type: ignore[no-untyped-def]
        layer.to_empty(device="cpu")
        for tensor in (*layer.parameters(), *layer.buffers()):
            nn.init.uniform_(tensor) if tensor.is_floating_point() else tensor.zero_()
        loaded_at_once.append(sum(any(not t.is_meta for t in m.parameters()) for m in empty))
        yield layer
        layer.to("meta")

    sample = torch.randn(BATCH, 8)
    alone = profile_layers_one_at_a_time(empty, sample, load, device="cpu", warmup=1, repeats=3)
    reference = profile(whole, sample)
    assert [n.node_id for n in alone.nodes] == [n.node_id for n in reference.nodes]
    assert [n.activation_bytes for n in alone.nodes] == [
        n.activation_bytes for n in reference.nodes
    ]
    assert [n.parameter_bytes for n in alone.nodes] == [n.parameter_bytes for n in reference.nodes]
    assert [n.desc for n in alone.nodes] == [n.desc for n in reference.nodes]
    assert alone.nodes[0].forward_ms > 0 and alone.nodes[0].backward_ms > 0
    assert max(loaded_at_once) <= 1 and len(loaded_at_once) == len(empty)
    assert all(t.is_meta for t in empty.parameters())


def test_identical_layers_get_equal_times() -> None:
    """Layers of one structure on inputs of one shape get their mean times (profile.alike);
    the first Linear, whose input needs no gradient, and a wider one are kept apart."""
    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 16)
    )
    profile = profile_layers(layers, torch.randn(BATCH, 8), warmup=3, repeats=15)
    nodes = profile.nodes
    assert nodes[1].forward_ms == nodes[3].forward_ms
    assert nodes[1].backward_ms == nodes[3].backward_ms
    assert nodes[2].forward_ms == nodes[4].forward_ms
    assert (
        nodes[0].backward_ms != nodes[1].backward_ms or nodes[0].forward_ms != nodes[1].forward_ms
    )

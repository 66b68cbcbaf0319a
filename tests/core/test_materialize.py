"""An empty build and the materialisation of one stage (``core.materialize``).

One process: the local stage's values against a whole build with the same seed (ties, buffers,
a module outside the pipeline, ``nn.MultiheadAttention``'s ``_reset_parameters``), how many
layers of other stages are alive at once, and every refusal. Through Lightning (slow): the
empty builds train exactly like the whole build, and a model larger than a per-process memory
cap (``RLIMIT_DATA``) trains on 2 ranks (planned by profiling one layer at a time; one layer in
16 trained, since half the parameters and their gradients would not fit under a cap below the
parameters) and on 4 ranks (every layer trained), the ranks forked from one process under the
cap that imported torch and Lightning once.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.materialize import EmptyBuild, materialize
from tests.runtime.launched import launch
from tests.strategy import big_script

SCRIPT = Path(__file__).parents[1] / "strategy" / "big_script.py"


class Model(nn.Module):
    """An embedding tied to the head, layers with buffers and a module outside the pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.BatchNorm1d(8))
        self.attention = nn.MultiheadAttention(8, 2)  # outside the pipeline: every rank keeps it
        self.head = nn.Linear(8, 10)
        self.head.weight = self.embed.weight

    def pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.embed, self.blocks[0], self.blocks[1], self.blocks[2], self.head)


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def empty(build_model=Model, seed: int = 0) -> tuple[nn.Module, EmptyBuild]:  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    build = EmptyBuild()
    with build.record():
        model = build_model()
    return model, build


@pytest.mark.parametrize("local", [[0], [1, 2], [3], [4], [0, 4]])
def test_the_local_stage_equals_a_whole_build_with_the_same_seed(local: list[int]) -> None:
    torch.manual_seed(0)
    whole = Model()
    after_whole = torch.rand(3)
    model, build = empty()
    assert all(t.is_meta for t in state(model).values())
    created = materialize(model, model.pipeline(), local, torch.device("cpu"), build)
    expected = state(whole)
    kept = {n for n, t in state(model).items() if not t.is_meta}
    layers = model.pipeline()
    wanted = {
        n
        for n, t in state(model).items()
        if any(t is u for i in local for u in state(layers[i]).values())
    }
    wanted |= {n for n in expected if n.startswith("attention.")}
    assert kept == wanted and created == len({id(state(model)[n]) for n in wanted})
    for name in kept:
        assert torch.equal(state(model)[name], expected[name]), name
    assert model.head.weight is model.embed.weight  # the tie is one parameter still
    # Nothing drew from the generator since the build: it is where the whole build left it.
    assert torch.equal(torch.rand(3), after_whole)


def test_a_generator_used_after_the_build_is_left_alone() -> None:
    model, build = empty()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    materialize(model, model.pipeline(), [1], torch.device("cpu"), build)
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(0)
    assert torch.equal(model.blocks[0].weight, Model().blocks[0].weight)


class Watched(nn.Linear):
    """A Linear whose reset reports how many layers of the chain hold memory at that moment."""

    chain: list[nn.Module] = []
    alive: list[int] = []

    def reset_parameters(self) -> None:
        super().reset_parameters()
        Watched.alive.append(sum(not layer.weight.is_meta for layer in Watched.chain))


def test_at_most_one_layer_of_another_stage_holds_memory_at_a_time() -> None:
    def chain() -> nn.Sequential:
        return nn.Sequential(*(Watched(16, 16) for _ in range(8)))

    layers, build = empty(chain)
    Watched.chain, Watched.alive = list(layers), []
    materialize(layers, layers, [2, 3], torch.device("cpu"), build)
    # Replaying layer k: the local layers created so far, plus layer k itself when it is foreign.
    assert Watched.alive == [1, 1, 1, 2, 3, 3, 3, 3]
    assert [not layer.weight.is_meta for layer in layers] == [False, False, True, True] + [
        False
    ] * 4
    torch.manual_seed(0)
    whole = chain()
    assert torch.equal(layers[3].weight, whole[3].weight)


class CustomInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        for layer in self.layers:  # a user's init outside any reset_parameters
            nn.init.normal_(layer.weight, std=0.02)


class MaskBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(4, 4).tril())  # set by no reset_parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.mask


class RandomParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.scale = nn.Parameter(torch.randn(4))  # drawn outside any reset_parameters


class ResetsAll(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.reset_parameters()

    def reset_parameters(self) -> None:  # one reset for several pipeline layers
        for layer in self.layers:
            nn.init.zeros_(layer.bias)


@pytest.mark.parametrize(
    ("build_model", "message"),
    [
        (CustomInit, "only initialisation inside a module's reset_parameters()"),
        (lambda: nn.Sequential(nn.Linear(4, 4), MaskBuffer()), "(not set: 1.mask)"),
        (RandomParameter, "(outside: torch.randn in __init__"),
        (ResetsAll, "may initialise at most one pipeline layer"),
    ],
)
def test_what_cannot_be_replayed_is_refused_with_the_fix(build_model, message: str) -> None:  # type: ignore[no-untyped-def]
    model, build = empty(build_model)
    layers = getattr(model, "layers", model)
    with pytest.raises(PipelineSetupError, match="build the model whole|reset_parameters") as info:
        materialize(model, layers, [1], torch.device("cpu"), build)
    assert message in str(info.value)


def test_two_empty_builds_with_draws_between_them_are_refused() -> None:
    build = EmptyBuild()
    with build.record():
        first = nn.Linear(4, 4)
    torch.rand(1)  # the whole build's second part would start from another state
    with build.record():
        second = nn.Linear(4, 4)
    layers = nn.Sequential(first, second)
    with pytest.raises(PipelineSetupError, match="a second empty build after draws"):
        materialize(layers, layers, [1], torch.device("cpu"), build)


def test_a_model_put_on_meta_by_the_user_is_refused() -> None:
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(PipelineSetupError, match="trainer.init_module\\(empty_init=True\\)"):
        materialize(layers, layers, [0], torch.device("cpu"), EmptyBuild())


def test_the_strategy_builds_empty_only_when_asked() -> None:
    strategy = PipeDreamStrategy()
    strategy._parallel_devices = [torch.device("cpu")]
    with strategy.tensor_init_context(empty_init=True):
        empty_layer = nn.Linear(4, 4)
    with strategy.tensor_init_context():  # init_module(): no module connected, a whole build
        whole_layer = nn.Linear(4, 4)
    assert empty_layer.weight.is_meta and not whole_layer.weight.is_meta
    assert [r.module for r in strategy.empty_build.resets] == [empty_layer]


# ----- through Lightning -----------------------------------------------------------------------

WIDE = ["--width", "2048", "--layers", "128", "--trainable", "16"]  # 128 x 16 MiB = 2 GiB
CAP_MB = 1950  # a stage of up to ~75 of the 128 layers fits (torch, Lightning, gloo: ~0.45 GiB)
PARAMETER_MB = 128 * (2048 * 2048 + 2048) * 4 / 2**20


def run(tmp_path: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tmp_path.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def reports(tmp_path: Path, ranks: int) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]


def ended(tmp_path: Path) -> dict:  # type: ignore[type-arg]
    """How a ``--case`` run of ``big_script.py`` ended: its ``status`` and ranks' ``errors``."""
    return json.loads((tmp_path / "ended.json").read_text())


@pytest.mark.slow
def test_empty_builds_train_exactly_like_the_whole_build(tmp_path: Path) -> None:
    weights = {}
    # init_module(empty_init=True) builds through the same recorder (the fast tests check both the
    # recorder's values and that the strategy uses it there), and it trains in the 4-rank
    # memory-cap test below.
    builds = ("whole", "configure")  # fitted in turn on 2 ranks forked from this process
    argv = ["--builds", *builds, "--balance", "4", "4", "--steps", "3", "--save", "--tie"]
    argv = [*argv, "--out", str(tmp_path)]
    ranks = launch(2, lambda _: big_script.main(argv), folder=tmp_path / "ranks", cwd=tmp_path)
    for r, rank in enumerate(ranks):
        assert rank.code == 0, f"rank {r}: {rank.error}\n{rank.stderr[-3000:]}"
    for build in builds:
        out = tmp_path / build
        assert [r["built_on_meta"] for r in reports(out, 2)] == [build != "whole"] * 2
        weights[build] = [torch.load(out / f"weights-rank{r}.pt") for r in range(2)]
    torch.manual_seed(0)
    first = nn.Linear(64, 64)  # the script's layer 0, as built whole with seed 0
    for build in ("configure",):
        for rank in range(2):
            whole, empty_built = weights["whole"][rank], weights[build][rank]
            assert whole.keys() == empty_built.keys() and len(whole) == 8
            for name in whole:
                assert torch.equal(whole[name], empty_built[name]), (build, rank, name)
    assert not torch.equal(weights["whole"][0]["layers.0.weight"], first.weight)  # it trained
    for build in weights:  # the tie (layer 7's weight is layer 0's) holds the same on both stages
        assert torch.equal(
            weights[build][0]["layers.0.weight"], weights[build][1]["layers.0.weight"]
        )


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:  # type: ignore[type-arg]
    """One process under the cap (``RLIMIT_DATA``, inherited by its children) runs in turn: the
    whole build alone, in a child (``alone/``); a fit on 2 ranks forked from it, planned
    (``two/``); a fit on 4 forked ranks, every layer trained (``four/``)."""
    out = tmp_path_factory.mktemp("capped")
    wide = " ".join(WIDE)
    four = "--balance 32 32 32 32 --trainable 1 --devices 4 --steps 1"
    cases = [
        f"--build alone {wide} --out {shlex.quote(str(out / 'alone'))}",
        f"--build configure {wide} --steps 2 --out {shlex.quote(str(out / 'two'))}",
        f"--build init_module {wide} {four} --out {shlex.quote(str(out / 'four'))}",
    ]
    command = ["--cap-mb", str(CAP_MB)] + [arg for case in cases for arg in ("--case", case)]
    return out, run(out, *command, timeout=900)


@pytest.mark.slow
def test_a_model_larger_than_the_memory_cap_trains_on_2_ranks_planned_layer_by_layer(
    capped: tuple[Path, subprocess.CompletedProcess],  # type: ignore[type-arg]
) -> None:
    out, done = capped
    assert PARAMETER_MB > CAP_MB  # the parameters alone do not fit under the cap
    alone = ended(out / "alone")
    assert alone["status"] == 3 and "OUT OF MEMORY" in done.stdout, done.stdout + done.stderr
    assert ended(out / "two") == {"status": 0, "errors": ""}, done.stderr[-3000:]
    assert "to profile and plan" in done.stderr + done.stdout  # planned, not given a balance
    for report in reports(out / "two", 2):
        print(f"rank {report['rank']}: peak RSS {report['peak_rss'] / 2**20:.0f} MiB, "
              f"balance {report['balance']}, cap {CAP_MB} MiB")  # fmt: skip
        assert report["built_on_meta"] and sum(report["balance"]) == 128
        assert report["peak_rss"] < CAP_MB * 2**20


@pytest.mark.slow
def test_a_model_larger_than_the_memory_cap_trains_on_4_ranks(
    capped: tuple[Path, subprocess.CompletedProcess],  # type: ignore[type-arg]
) -> None:
    """Every layer trained: a quarter of the parameters and their gradients fit."""
    out, done = capped
    assert ended(out / "four") == {"status": 0, "errors": ""}, done.stderr[-3000:]
    for report in reports(out / "four", 4):
        peak = report["peak_rss"] / 2**20
        print(f"rank {report['rank']}: peak RSS {peak:.0f} MiB, cap {CAP_MB} MiB")
        assert report["built_on_meta"] and report["peak_rss"] < CAP_MB * 2**20

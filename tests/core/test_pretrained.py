"""Pretrained weights into one stage (``core.pretrained``), in one process.

Each stage of an empty build, filled from a ``torch.save`` state dict, a ``.safetensors`` file
and a sharded Hugging Face directory, equals the saved model on the tensors it keeps, reads only
those (a tied weight on each stage that holds it), and leaves the others on ``meta``; names
mapped with ``prefix``, ``rename`` and ``convert``; every mismatch listed in one error. Through
Lightning on 2 ranks (slow): fine-tuning from either file equals one device loading the same
weights, a mismatch stops every rank at setup, and ``fit(ckpt_path=...)`` wins over
``pretrained=`` (a module built empty continues from the checkpoint's weights).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pl_pipedream.core import pretrained
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.materialize import EmptyBuild
from pl_pipedream.core.pretrained import Pretrained, load_stage, open_weights
from tests.runtime import launched
from tests.runtime.launched import Rank

safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")


class Model(nn.Module):
    """An embedding tied to the head, layers with buffers and a module outside the pipeline;
    initialised outside any reset_parameters (an empty build could not replay it)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.BatchNorm1d(8))
        self.extra = nn.Linear(2, 2)  # outside the pipeline: every rank keeps it
        self.head = nn.Linear(8, 10)
        self.head.weight = self.embed.weight
        for param in self.parameters():
            nn.init.normal_(param, std=0.5)  # as a user's _init_weights does

    def pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.embed, self.blocks[0], self.blocks[1], self.blocks[2], self.head)


def saved() -> nn.Module:
    torch.manual_seed(1)
    model = Model()
    model.blocks[2].running_mean.normal_()
    model.blocks[2].num_batches_tracked.fill_(7)
    return model


def empty() -> tuple[nn.Module, EmptyBuild]:
    build = EmptyBuild()
    with build.record():
        model = Model()
    return model, build


def write(model: nn.Module, tmp_path: Path, form: str) -> Path:
    state = model.state_dict()
    if form == "torch":
        torch.save(state, tmp_path / "weights.pt")
        return tmp_path / "weights.pt"
    unique = {k: v for k, v in state.items() if k != "head.weight"}  # safetensors: no shared
    if form == "safetensors":
        safetensors_torch.save_file(unique, tmp_path / "model.safetensors")
        return tmp_path / "model.safetensors"
    names = sorted(unique)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    for shard, keys in shards.items():
        safetensors_torch.save_file({k: unique[k] for k in keys}, tmp_path / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


@pytest.mark.parametrize("form", ["torch", "safetensors", "hf-directory"])
@pytest.mark.parametrize("local", [[0, 1], [2, 3, 4]])
def test_a_stage_reads_and_holds_only_its_own_tensors(tmp_path, form, local) -> None:
    source = saved()
    path = write(source, tmp_path, form)
    model, build = empty()
    layers = model.pipeline()
    read = load_stage(Pretrained(path), model, layers, local, CPU, build)
    held = {n for i in local for n, _ in layers[i].state_dict().items()}
    kept = {
        name
        for name, tensor in model.state_dict(keep_vars=True).items()
        if any(tensor is t for i in local for t in layers[i].state_dict(keep_vars=True).values())
    } | {"extra.weight", "extra.bias"}
    assert len(held) > 0
    assert {n for n, t in model.state_dict(keep_vars=True).items() if not t.is_meta} == kept
    expected = source.state_dict()
    for name in kept:
        assert torch.equal(model.state_dict()[name], expected[name]), name
    tied = {"embed.weight", "head.weight"}
    assert set(read) - tied == kept - tied  # nothing of the other stage was read
    assert model.head.weight is model.embed.weight
    if 4 in local and 0 not in local:  # the head's stage holds the tied copy too
        assert set(read) & tied


@pytest.mark.parametrize("form", ["torch", "safetensors"])
def test_the_file_is_opened_again_after_each_budget_of_bytes_read(tmp_path, form, monkeypatch):  # type: ignore[no-untyped-def]
    """Pages of a mapped file stay resident while it is mapped: reading reopens it (here after
    every tensor, with a budget of one byte), and still gives the file's values."""
    monkeypatch.setattr(pretrained, "MAPPED_BYTES", 1)
    opened = []
    with open_weights(write(saved(), tmp_path, form)) as weights:
        reopen = weights._open_reader
        weights._open_reader = lambda: opened.append(1) or reopen()  # type: ignore[method-assign]
        names = sorted(weights.shapes)[:3]
        values = [weights.read(name) for name in names]
    assert len(opened) == 3
    for name, value in zip(names, values, strict=True):
        assert torch.equal(value, saved().state_dict()[name])


def test_a_lightning_checkpoint_file_gives_its_state_dict(tmp_path) -> None:
    source = saved()
    torch.save({"state_dict": source.state_dict(), "epoch": 3}, tmp_path / "run.ckpt")
    model, build = empty()
    load_stage(Pretrained(tmp_path / "run.ckpt"), model, model.pipeline(), [1], CPU, build)
    assert torch.equal(model.blocks[0].weight, source.blocks[0].weight)


def test_prefix_rename_and_convert_map_another_model_s_names(tmp_path) -> None:
    source = saved()
    state = {"transformer." + k: v for k, v in source.state_dict().items()}
    state["transformer.blocks.0.weight"] = state["transformer.blocks.0.weight"].t().contiguous()
    state["transformer.mask"] = torch.ones(3)  # a buffer the module does not have
    torch.save(state, tmp_path / "hf.pt")

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Model()

    build = EmptyBuild()
    with build.record():
        wrapped = Wrapped()
    spec = Pretrained(
        tmp_path / "hf.pt",
        prefix="model.",
        rename=lambda n: None if n.endswith(".mask") else n.removeprefix("transformer."),
        convert=lambda n, t: t.t() if n == "model.blocks.0.weight" else t,
    )
    load_stage(spec, wrapped, wrapped.model.pipeline(), [1], CPU, build)
    assert torch.equal(wrapped.model.blocks[0].weight, source.blocks[0].weight)


def test_names_and_shapes_that_do_not_match_are_listed_in_one_error(tmp_path) -> None:
    state = saved().state_dict()
    del state["blocks.0.bias"]
    state["blocks.0.bais"] = torch.zeros(8)
    state["blocks.1.weight"] = torch.zeros(9)
    torch.save(state, tmp_path / "weights.pt")
    model, build = empty()
    with pytest.raises(PipelineSetupError) as error:
        load_stage(Pretrained(tmp_path / "weights.pt"), model, model.pipeline(), [0], CPU, build)
    message = str(error.value)
    assert "missing: ['blocks.0.bias']" in message
    assert "unexpected: ['blocks.0.bais']" in message
    assert "blocks.1.weight: file (9,), module (8,)" in message
    assert all(t.is_meta for t in model.state_dict().values())  # nothing created


def test_tied_names_that_differ_in_the_file_are_refused(tmp_path) -> None:
    state = saved().state_dict()
    state["head.weight"] = state["head.weight"] + 1
    torch.save(state, tmp_path / "weights.pt")
    model, build = empty()
    with pytest.raises(PipelineSetupError, match="tied parameter's names"):
        load_stage(Pretrained(tmp_path / "weights.pt"), model, model.pipeline(), [4], CPU, build)


def test_without_safetensors_the_error_names_the_extra(tmp_path, monkeypatch) -> None:
    safetensors_torch.save_file({"a": torch.zeros(1)}, tmp_path / "model.safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(PipelineSetupError, match=r'pip install "pl-pipedream\[hf\]"'):
        with open_weights(tmp_path / "model.safetensors"):
            pass


def test_paths_that_hold_no_weights_are_refused(tmp_path) -> None:
    with pytest.raises(PipelineSetupError, match="model.safetensors.index.json"):
        with open_weights(tmp_path):
            pass
    with pytest.raises(PipelineSetupError, match="not found"):
        with open_weights(tmp_path / "none.pt"):
            pass
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(PipelineSetupError, match="must be a state dict"):
        with open_weights(tmp_path / "list.pt"):
            pass


def test_parse_takes_a_path_or_a_pretrained() -> None:
    assert Pretrained.parse("w.pt") == Pretrained("w.pt")
    assert Pretrained.parse(None) is None
    with pytest.raises(PipelineSetupError, match="path or a Pretrained"):
        Pretrained.parse(3)  # type: ignore[arg-type]


# ----- through Lightning, 2 ranks forked from here (slow): tests/strategy/pretrained_script.py ---


def script_rank(rank: int, argv: list[str]) -> None:
    from tests.strategy import pretrained_script

    pretrained_script.main(argv)


def launch(*args: object, folder: Path) -> list[Rank]:
    """``pretrained_script`` on two ranks forked from this process as a launcher starts them,
    each running the script's ``main`` (a user's script, its output kept per rank)."""
    return launched.launch(2, script_rank, [str(arg) for arg in args], folder=folder, timeout=240)


def fork(*args: object) -> None:
    """``pretrained_script``'s fits in this process, the ranks forked from it."""
    from tests.strategy import pretrained_script

    pretrained_script.main([str(arg) for arg in args], start_method="fork")


def pipelined(out: Path) -> dict[str, torch.Tensor]:
    """The stages' states after training, merged (each rank wrote its own)."""
    return {**torch.load(out / "rank0.pt"), **torch.load(out / "rank1.pt")}


def tiny_weights(tmp_path: Path) -> tuple[Path, Path]:
    """A trained-looking ``Tiny`` as a ``torch.save`` state dict and as safetensors (the tied
    head under its embedding's name only, as Hugging Face writes GPT-2)."""
    from tests.strategy.pretrained_script import Tiny

    torch.manual_seed(3)
    model = Tiny("whole")
    for param in model.parameters():
        nn.init.normal_(param, std=0.3)
    state = model.state_dict()
    torch.save(state, tmp_path / "tiny.pt")
    unique = {k: v for k, v in state.items() if k != "head.weight"}
    safetensors_torch.save_file(unique, tmp_path / "tiny.safetensors")
    return tmp_path / "tiny.pt", tmp_path / "tiny.safetensors"


def one_device(weights: Path, epochs: int) -> dict[str, torch.Tensor]:
    """The oracle: the same weights loaded on one device, trained as a user would."""
    from lightning.pytorch import Trainer

    from tests.strategy.pretrained_script import Tiny, loader, settings

    model = Tiny("whole")
    model.load_state_dict(torch.load(weights))
    Trainer(**settings(devices=1, max_epochs=epochs, enable_checkpointing=False)).fit(
        model, loader()
    )
    return model.state_dict()


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        diff = (actual[name] - tensor).abs().max().item()
        assert diff <= 1e-6, f"{name}: {diff}"


@pytest.mark.slow
def test_two_stages_fine_tune_from_pretrained_weights_as_one_device(tmp_path) -> None:
    torch_file, safetensors_file = tiny_weights(tmp_path)
    fork("--weights", torch_file, safetensors_file, "--out", tmp_path / "run")
    expected = one_device(torch_file, epochs=2)
    start = torch.load(torch_file)
    assert max((expected[k] - start[k]).abs().max().item() for k in start) > 1e-2  # it trained
    assert_close(pipelined(tmp_path / "run" / "0"), expected)
    assert_close(pipelined(tmp_path / "run" / "1"), expected)


@pytest.mark.slow
def test_names_that_do_not_match_stop_every_rank_before_training(tmp_path) -> None:
    torch_file, _ = tiny_weights(tmp_path)
    state = torch.load(torch_file)
    state["blocks.1.1.bias"] = state.pop("blocks.1.1.weight")  # misnamed, and misshapen
    torch.save(state, tmp_path / "bad.pt")
    args = ("--weights", tmp_path / "bad.pt", "--out", tmp_path / "run")
    ranks = launch(*args, folder=tmp_path / "ranks")
    assert all(rank.code != 0 for rank in ranks)
    stderr = "".join(rank.stderr for rank in ranks)
    assert "missing: ['blocks.1.1.weight']" in stderr
    assert "blocks.1.1.bias: file (8, 8), module (8,)" in stderr
    assert not (tmp_path / "run" / "0" / "rank0.pt").exists()


@pytest.mark.slow
def test_resuming_wins_over_pretrained_weights_and_continues_the_checkpoint(tmp_path) -> None:
    """``fit(ckpt_path=...)`` with ``pretrained=`` still given (the same command re-run after a
    preemption) continues from the checkpoint; the model is built empty with an initialisation
    no replay can redo, so only the checkpoint's weights can fill it."""
    torch_file, _ = tiny_weights(tmp_path)
    fork("--weights", torch_file, "--out", tmp_path / "a", "--epochs", 1, "--save-last")
    last = tmp_path / "a" / "0" / "ckpts" / "last.ckpt"
    args = ("--weights", torch_file, "--out", tmp_path / "b", "--epochs", 2, "--resume", last)
    resumed = launch(*args, folder=tmp_path / "ranks")  # a user's script: the checkpoint wins
    assert [rank.code for rank in resumed] == [0, 0], [rank.stderr[-2000:] for rank in resumed]
    assert "the pretrained weights (" in "".join(rank.output for rank in resumed)
    assert_close(pipelined(tmp_path / "b" / "0"), one_device(torch_file, epochs=2))


@pytest.mark.slow
def test_a_module_built_empty_resumes_from_the_checkpoint_s_weights(tmp_path) -> None:
    """Without pretrained weights: Lightning restores a checkpoint before the strategy's setup,
    into the ``meta`` tensors of a module built in ``configure_model()``; the stage must still
    continue from the checkpoint's weights, not from a fresh initialisation."""
    common = ("--weights", "none", "--init", "reset")
    fork(*common, "--out", tmp_path / "straight", "--epochs", 2)
    fork(*common, "--out", tmp_path / "a", "--epochs", 1, "--save-last")
    last = tmp_path / "a" / "0" / "ckpts" / "last.ckpt"
    fork(*common, "--out", tmp_path / "b", "--epochs", 2, "--resume", last)
    assert_close(pipelined(tmp_path / "b" / "0"), pipelined(tmp_path / "straight" / "0"))

"""Pretrained weights into one rank's stage: each rank reads only the tensors its stage holds.

``Pretrained`` names a file of weights and how its names map onto the module's: a plain
``torch.save(model.state_dict())`` file (or a Lightning ``.ckpt`` file, its ``state_dict``), a
Hugging Face ``.safetensors`` file, or a directory holding ``model.safetensors``, the shards of
``model.safetensors.index.json`` or ``pytorch_model.bin``. ``load_stage`` first matches the
whole module against the file's names and shapes, read from its header alone (torch files are
opened memory-mapped, ``torch.load(mmap=True, weights_only=True)``; safetensors through
``safe_open``), and refuses any missing, unexpected or misshapen tensor in one error, on every
rank alike. Then it reads, one tensor at a time, only the tensors this rank keeps: the layers
of its stage (a tied parameter on every stage that holds it) and the state outside the pipeline.

A model built empty (``configure_model()``) is never built whole: the kept tensors the file
covers are created on the rank's device and filled from it, without running their
initialisation; ``materialize`` creates the rest (buffers that ``state_dict`` leaves out), and
the layers of other stages stay on ``meta``. A parameter under several names (a tied weight)
needs one of them in the file; where the file has several, they must hold the same values.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import swap_tensors

from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.materialize import EmptyBuild, materialize, model_tensors

__all__ = ["Pretrained", "WeightsFile", "load_stage", "match", "open_weights"]

INDEX = "model.safetensors.index.json"
SHOWN = 8  # names listed per kind of mismatch
MAPPED_BYTES = 64 * 2**20  # read through one opening of a file (WeightsFile)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class Pretrained:
    """Weights to start from, and the module name of each of the file's names.

    A file name ``n`` loads into the module's ``prefix + rename(n)`` (``rename`` returning None
    skips it, as for Hugging Face GPT-2's ``attn.bias`` masks); ``convert(module_name, tensor)``
    then reshapes its value (Hugging Face's ``Conv1D`` weights are ``nn.Linear``'s transposed).
    """

    # a mapping: a state dict already loaded; a WeightsFile: a resumed checkpoint's shards
    path: str | os.PathLike | Mapping[str, Tensor] | WeightsFile
    prefix: str = ""
    rename: Callable[[str], str | None] | None = None
    convert: Callable[[str, Tensor], Tensor] | None = None

    @classmethod
    def parse(cls, value: str | os.PathLike | Pretrained | None) -> Pretrained | None:
        """``PipeDreamStrategy(pretrained=...)``: a path or a ``Pretrained``."""
        if value is None or isinstance(value, Pretrained):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls(value)
        raise PipelineSetupError(
            f"pretrained must be a path or a Pretrained (pretrained: {type(value).__name__}); "
            "pass pretrained='model.safetensors' or pretrained=Pretrained(...)"
        )

    def describe(self) -> str:
        if isinstance(self.path, WeightsFile):
            return "the resumed checkpoint"
        return "a state dict" if isinstance(self.path, Mapping) else str(self.path)

    def module_name(self, name: str) -> str | None:
        renamed = self.rename(name) if self.rename is not None else name
        return None if renamed is None else self.prefix + renamed


class WeightsFile:
    """The tensors of a weights file by name: their shapes (the header only) and values, read
    one at a time; ``read`` records every name it read.

    A page of a memory-mapped file that was read stays in the resident set for as long as the
    file is mapped, so ``read`` opens the file again (``open_reader``, dropping the previous
    mapping) once it has read ``MAPPED_BYTES`` since the last opening: at most about that much
    of the file, plus the tensor being read, is resident beside the stage's own tensors.
    """

    def __init__(
        self, shapes: dict[str, Tensor], open_reader: Callable[[], Callable[[str], Tensor]]
    ) -> None:
        self.shapes = shapes  # name -> a meta tensor of the file's shape and dtype
        self._open_reader = open_reader
        self._reader: Callable[[str], Tensor] | None = None
        self._mapped = 0
        self.read_names: list[str] = []

    def read(self, name: str) -> Tensor:
        self.read_names.append(name)
        if self._reader is None or self._mapped >= MAPPED_BYTES:
            self._reader = None  # unmaps what was read through it
            self._reader, self._mapped = self._open_reader(), 0
        value = self._reader(name)
        self._mapped += value.nbytes
        return value


@contextlib.contextmanager
def open_weights(
    source: str | os.PathLike | Mapping[str, Tensor] | WeightsFile,
) -> Iterator[WeightsFile]:
    """The weights at ``source`` (see the module docstring for the forms; or a state dict
    already in memory, as a resumed checkpoint's), open for the block."""
    if isinstance(source, WeightsFile):  # a resumed checkpoint's shards (core.resume)
        yield source
        return
    if isinstance(source, Mapping):
        yield _tensors(source)
        return
    path = Path(source)
    if path.is_dir():
        path = _file_in(path)
    if not path.is_file():
        raise PipelineSetupError(
            f"pretrained weights must be a file or a directory of them (path: {path}: not "
            "found); pass the path of a torch.save state dict, a .safetensors file or a "
            "Hugging Face model directory"
        )
    safetensors = path.name.endswith((".safetensors", ".safetensors.index.json"))
    yield _safetensors(path) if safetensors else _torch_file(path)


def match(module: nn.Module, weights: WeightsFile, spec: Pretrained) -> dict[int, list[str]]:
    """The file's names for each tensor of ``module``'s state dict (by tensor id), checked for
    the whole module: every tensor named once or more, no name left over, every shape equal.
    Raises one ``PipelineSetupError`` listing every mismatch."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    owner = {name: key for key, group in names.items() for name in group}
    found: dict[int, list[str]] = {}
    unexpected, misshapen = [], []
    for file_name, meta in weights.shapes.items():
        mapped = spec.module_name(file_name)
        if mapped is None:
            continue
        name = mapped
        if name not in owner:
            unexpected.append(name if name == file_name else f"{file_name} (as {name})")
            continue
        found.setdefault(owner[name], []).append(file_name)
        shape = _converted(spec, name, meta).shape
        if shape != tensors[owner[name]].shape:
            expected = tuple(tensors[owner[name]].shape)
            misshapen.append(f"{name}: file {tuple(shape)}, module {expected}")
    missing = [group[0] for key, group in names.items() if key not in found]
    if missing or unexpected or misshapen:
        raise PipelineSetupError(
            "pretrained weights must hold every tensor of the module's state dict under its name "
            f"and shape ({_listed('missing', missing)}, {_listed('unexpected', unexpected)}, "
            f"{_listed('shape mismatches', misshapen)}; file: {spec.describe()}); map the file's "
            "names with Pretrained(path, prefix=..., rename=...) and reshape with convert=... "
            "(docs/pretrained.md)"
        )
    return found


def load_stage(
    spec: Pretrained,
    module: nn.Module,
    layers: nn.Sequential,
    local: Sequence[int],
    device: torch.device,
    build: EmptyBuild,
) -> list[str]:
    """Fill the tensors this rank keeps (the layers ``local`` and the state outside the
    pipeline) from ``spec``'s file, after ``match`` checked the whole module; ``materialize``
    creates the kept tensors the file does not cover. Returns the file names read."""
    in_pipeline = {id(t) for layer in layers for t in model_tensors(layer)}
    keep = {id(t) for i in local for t in model_tensors(layers[i])}
    keep |= {id(t) for t in model_tensors(module) if id(t) not in in_pipeline}
    with open_weights(spec.path) as weights:
        found = match(module, weights, spec)
        targets = [t for t in model_tensors(module) if id(t) in keep and id(t) in found]
        for tensor in targets:
            if tensor.is_meta:
                _create(tensor, device)
        materialize(module, layers, local, device, build)
        with torch.no_grad():
            for tensor in targets:
                tensor.copy_(_value(spec, weights, found[id(tensor)]))
        return weights.read_names


def _value(spec: Pretrained, weights: WeightsFile, file_names: list[str]) -> Tensor:
    """The value of one tensor (the first of ``file_names``; any other must hold the same)."""
    value = _read(spec, weights, file_names[0])
    for other in file_names[1:]:
        if not torch.equal(_read(spec, weights, other), value):
            raise PipelineSetupError(
                "a tied parameter's names in the pretrained weights must hold the same values "
                f"(names: {file_names[0]}, {other}); keep one of them in the file, or skip the "
                "other with Pretrained(rename=...) returning None"
            )
    return value


def _read(spec: Pretrained, weights: WeightsFile, file_name: str) -> Tensor:
    name = spec.module_name(file_name)
    assert name is not None  # match() kept only the names that load
    return _converted(spec, name, weights.read(file_name))


def _converted(spec: Pretrained, name: str, tensor: Tensor) -> Tensor:
    return spec.convert(name, tensor) if spec.convert is not None else tensor


def _create(tensor: Tensor, device: torch.device) -> None:
    """Give a meta tensor memory on ``device`` in place (the same Python object)."""
    value = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    if isinstance(tensor, nn.Parameter):
        value = nn.Parameter(value, tensor.requires_grad)
    swap_tensors(tensor, value)


def _listed(kind: str, names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{kind}: {names[:SHOWN]}{more}"


def _file_in(directory: Path) -> Path:
    """The weights of a Hugging Face model directory."""
    for name in (INDEX, "model.safetensors", "pytorch_model.bin"):
        if (directory / name).is_file():
            return directory / name
    raise PipelineSetupError(
        "a pretrained model directory must hold model.safetensors, model.safetensors.index.json "
        f"or pytorch_model.bin (directory: {directory}); pass the weights file itself"
    )


def _torch_file(path: Path) -> WeightsFile:
    """A ``torch.save`` state dict, memory-mapped: a tensor's bytes are read when copied."""
    state = _torch_state(path)
    return WeightsFile(_shapes(state), lambda: _torch_state(path).__getitem__)


def _torch_state(path: Path) -> dict[str, Tensor]:
    try:
        state: Any = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as error:
        raise PipelineSetupError(
            f"pretrained torch weights are read memory-mapped, which needs torch.save's zip "
            f"format (path: {path}: {str(error).splitlines()[0]}); save them again with "
            "torch.save(state_dict, path)"
        ) from error
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a Lightning checkpoint file
    if not isinstance(state, dict):
        raise PipelineSetupError(
            f"pretrained torch weights must be a state dict (path: {path} holds a "
            f"{type(state).__name__}); save model.state_dict()"
        )
    return {name: t for name, t in state.items() if isinstance(t, Tensor)}


def _tensors(state: Mapping[str, Any]) -> WeightsFile:
    tensors = {name: t for name, t in state.items() if isinstance(t, Tensor)}
    return WeightsFile(_shapes(tensors), lambda: tensors.__getitem__)


def _shapes(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {name: t.to("meta") for name, t in tensors.items()}


def _safetensors(path: Path) -> WeightsFile:
    """One ``.safetensors`` file, or the shards an ``index.json`` maps each name to, read
    through ``safe_open`` (which maps each file)."""
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise PipelineSetupError(
            f"reading .safetensors weights needs the safetensors package (path: {path}); "
            'pip install "pl-pipedream[hf]"'
        ) from error
    if path.name.endswith(".json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        files = {name: path.parent / shard for name, shard in weight_map.items()}
    else:
        files = dict.fromkeys(safe_open(str(path), framework="pt").keys(), path)
    shapes = {}
    for file in sorted(set(files.values())):
        handle = safe_open(str(file), framework="pt")
        for name in (n for n, f in files.items() if f == file):
            piece = handle.get_slice(name)
            dtype = SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.float32)
            shapes[name] = torch.empty(piece.get_shape(), dtype=dtype, device="meta")

    def open_reader() -> Callable[[str], Tensor]:
        handles: dict[Path, Any] = {}

        def read(name: str) -> Tensor:
            file = files[name]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt", device="cpu")
            return handles[file].get_tensor(name)

        return read

    return WeightsFile(shapes, open_reader)

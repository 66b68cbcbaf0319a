"""Profiles of the paper's seven models, measured on this machine, for ``pl-pipedream reproduce``.

``reproduce.predict`` plans every Table 1 row twice: from PipeDream's published profile and from
our own model (``pl_pipedream.models`` at full size) profiled here. This module does the second
part's measuring, the one module of ``reproduce`` that imports torch (``predict`` imports it only
when our profile is asked for): it builds the model, times its pipeline layers with
``profile.measure.profile_layers`` on a microbatch of ONE sample, on one CPU thread (the speed
factor applied to it is relative to one thread of this CPU), and caches the result as a JSON
profile so a second run reads it instead of measuring.

Activation and parameter bytes come from the tensors' shapes and are exact; times are this
CPU's. Scaling to the paper's per-GPU minibatch and to the target GPU is
``reproduce.epochs.scale_profile``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from pl_pipedream.models import AWDLM, GNMT8, GNMT16, S2VT, VGG16, AlexNet, ResNet50
from pl_pipedream.models.seq2seq import START
from pl_pipedream.profile.graph import Profile
from pl_pipedream.profile.measure import profile_layers

__all__ = ["MODELS", "ModelSpec", "gemm_gflops", "own_profile"]

CACHE_VERSION = "2"  # bump when what is measured changes, so old cache files are not read


class Pipelined(Protocol):
    """A model that lists its pipeline's layers (every model of ``pl_pipedream.models``)."""

    def configure_pipeline(self) -> nn.Sequential: ...


@dataclass(frozen=True)
class ModelSpec:
    """How to build one of the paper's models at full size and a one-sample input for it."""

    build: Callable[[], Pipelined]
    sample: Callable[[], Any]
    shape: str  # the one-sample input, for the cache key and the report


def _tokens(length: int, vocab: int) -> torch.Tensor:
    return torch.randint(START + 1, vocab, (1, length), generator=torch.Generator().manual_seed(0))


# Sequence shapes: GNMT as PipeDream's published GNMT profiles (24 tokens per sentence for
# GNMT-8, 50 for GNMT-16, vocabulary 32,320), AWD-LM the AWD-LSTM paper's Penn Treebank setting
# (70-token windows, 10,000 words), S2VT the S2VT paper's (80 frames of 4096 fc7 features,
# 20-word captions; vocabulary 13,000 is our round figure for MSVD's).
MODELS: dict[str, ModelSpec] = {
    "VGG-16": ModelSpec(VGG16, lambda: torch.randn(1, 3, 224, 224), "1x3x224x224"),
    "AlexNet": ModelSpec(AlexNet, lambda: torch.randn(1, 3, 224, 224), "1x3x224x224"),
    "ResNet-50": ModelSpec(ResNet50, lambda: torch.randn(1, 3, 224, 224), "1x3x224x224"),
    "GNMT-8": ModelSpec(
        lambda: GNMT8((24,), 32320),
        lambda: (_tokens(24, 32320), _tokens(24, 32320)),
        "1x24 tokens, vocabulary 32320",
    ),
    "GNMT-16": ModelSpec(
        lambda: GNMT16((50,), 32320),
        lambda: (_tokens(50, 32320), _tokens(50, 32320)),
        "1x50 tokens, vocabulary 32320",
    ),
    "AWD-LM": ModelSpec(
        lambda: AWDLM((70,), 10000), lambda: _tokens(70, 10000), "1x70 tokens, vocabulary 10000"
    ),
    "S2VT": ModelSpec(
        lambda: S2VT((80, 4096), 13000),
        lambda: (torch.randn(1, 80, 4096), torch.full((1, 20), START)),
        "1x80x4096 features + 1x20 tokens, vocabulary 13000",
    ),
}


def own_profile(model: str, cache: Path) -> tuple[Profile, bool]:
    """The one-sample profile of ``model`` (a Table 1 name) and whether it came from the cache.

    The cache file is ``cache/<model>.json``; it is used when its meta names the same input and
    cache version, otherwise the model is measured again and the file rewritten.
    """
    if model not in MODELS:
        raise KeyError(
            f"our own profile covers the paper's models (model: {model}); use one of "
            f"{', '.join(MODELS)}"
        )
    spec = MODELS[model]
    path = Path(cache) / f"{model.lower().replace('-', '')}.json"
    if path.is_file():
        cached = Profile.load(path)
        if cached.meta.get("input") == spec.shape and cached.meta.get("cache") == CACHE_VERSION:
            return cached, True
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        module = spec.build()
        start = time.perf_counter()
        measured = profile_layers(module.configure_pipeline(), spec.sample(), warmup=1, repeats=2)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    meta = {
        **measured.meta,
        "model": model,
        "input": spec.shape,
        "cache": CACHE_VERSION,
        "profiling_seconds": f"{seconds:.1f}",
        "gemm_gflops": f"{gemm_gflops():.1f}",
    }
    result = Profile(measured.nodes, measured.edges, measured.batch_size, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    result.save(path)
    return result, False


def gemm_gflops(size: int = 1024, repeats: int = 5) -> float:
    """This CPU's fp32 matrix-multiply rate on one thread (GFLOP/s), recorded with a profile."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator)
        b = torch.randn(size, size, generator=generator)
        a @ b
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        seconds = (time.perf_counter() - start) / repeats
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / seconds / 1e9

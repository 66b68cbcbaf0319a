"""What the strategy's modules read and write of ``PipeDreamStrategy``, as a type they can name.

``setup`` and ``replanning`` act on the strategy that calls them (its options, its session, the
state of a fit, and Lightning's parts of it). The class imports them, so they cannot import the
class to name its type without a cycle; ``Host`` declares what they use instead, and mypy checks
that ``PipeDreamStrategy`` is one wherever it passes itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision

from pl_pipedream.core.data import LoaderSeeds
from pl_pipedream.core.materialize import EmptyBuild
from pl_pipedream.core.memory_report import StageMemory
from pl_pipedream.core.preemption import Preemption
from pl_pipedream.core.pretrained import Pretrained
from pl_pipedream.core.resume import Resume
from pl_pipedream.engine.session import Session
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["Host"]


class Host(Protocol):
    """A ``PipeDreamStrategy`` as its modules see it."""

    # the options (PipeDreamStrategy.__init__)
    sync: SyncMode
    microbatches: int
    balance: list[int] | None
    _given_plan: Plan | None
    topology: Topology | None
    memory: float | None
    timeout: float
    timeline: Path | None
    recompute: bool
    pretrained: Pretrained | None
    weight_prediction: bool
    lr_warmup_per_delay: int
    delay_lr_updates: int | None
    chunks_per_rank: int | None
    retain_freed_memory: bool
    bind_cpus: bool
    _process_group_backend: str | None
    # the state of the pipeline and of a fit
    session: Session | None
    resume: Resume
    loader_seeds: LoaderSeeds
    preemption: Preemption
    empty_build: EmptyBuild
    replanning: Any  # strategy.replanning.Replanning (which names this type)
    steps: Any  # strategy.step.TrainingSteps
    setup_seconds: float
    memory_report: list[StageMemory]
    bubbles: dict[int, float]
    cpu_binding: frozenset[int] | None
    _unbound_cpus: frozenset[int] | None
    num_nodes: int
    optimizers: list[Any]

    # Lightning's ParallelStrategy, and the class's own properties
    @property
    def plan(self) -> Plan | None: ...
    @property
    def lightning_module(self) -> pl.LightningModule | None: ...
    @property
    def precision_plugin(self) -> Precision: ...
    @property
    def cluster_environment(self) -> ClusterEnvironment | None: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def batch_to_device(self, batch: Any, device: torch.device | None = None, /) -> Any: ...
    def setup_optimizers(self, trainer: pl.Trainer) -> None: ...
    def setup_precision_plugin(self) -> None: ...
    def drain(self) -> None: ...

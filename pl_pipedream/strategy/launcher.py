"""The launchers of ``PipeDreamStrategy``.

``start_method="popen"``: rank 0 starts the other ranks by re-running the user's script, as
Lightning's script launcher does, but watches them and reports how they ended itself
(``runtime.processes``): Lightning's observer thread, which SIGKILLs every rank within 5 s of one
failing and leaves the command with status 137 and no report, is never started.

``start_method="spawn"`` (or ``"fork"``): Lightning's spawn launcher sends rank 0's
``state_dict`` back to the parent. Under ``PipeDreamStrategy`` rank 0 holds only its own stage,
so every rank contributes its stage first and the parent receives all of them merged under the
LightningModule's names.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from pl_pipedream.core.checkpoint import merge_states
from pl_pipedream.core.placement import share_threads
from pl_pipedream.runtime.processes import RankProcesses, record_uncaught_errors, script_command
from pl_pipedream.strategy.lightning_patches import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    WorkerOutput,
)

__all__ = ["PipelineScriptLauncher", "PipelineSpawnLauncher", "hydra_child_command"]


def hydra_child_command(local_rank: int) -> tuple[list[str], str] | None:
    """The command and working directory of local rank ``local_rank`` of a script that runs
    under Hydra (``HydraConfig``, Hydra's public API), as Lightning's script launcher builds
    them: the same script or module and overrides, in the same run directory, without a second
    copy of the config; None when Hydra is not running."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.utils import get_original_cwd, to_absolute_path
    except ImportError:
        return None
    if not HydraConfig.initialized():
        return None
    import __main__

    spec = getattr(__main__, "__spec__", None)
    script = [to_absolute_path(sys.argv[0])] if spec is None else ["-m", spec.name]
    command = [sys.executable, *script, *sys.argv[1:]]
    command += [
        f'hydra.run.dir="{HydraConfig.get().run.dir}"',
        f"hydra.job.name=train_ddp_process_{local_rank}",
        "hydra.output_subdir=null",
    ]
    return command, get_original_cwd()


class PipelineScriptLauncher(SubprocessScriptLauncher):
    """``start_method="popen"``: the other ranks of this node re-run the script, started,
    watched and reported by ``runtime.processes.RankProcesses``; the command exits 1 when any rank
    failed, hung or was stopped, and its last lines name the rank that failed first."""

    def __init__(
        self, cluster_environment: Any, num_processes: int, num_nodes: int, timeout: float
    ):
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.timeout = timeout
        self.ranks: RankProcesses | None = None

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        environment = self.cluster_environment
        environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if environment.creates_processes_externally:
            record_uncaught_errors(self._first_rank() + environment.local_rank())
        else:
            self._start_other_ranks()
        share_threads(self.num_processes)
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        if self.ranks is not None:
            self.ranks.send_signal(signum)

    def _first_rank(self) -> int:
        return self.cluster_environment.node_rank() * self.num_processes

    def _start_other_ranks(self) -> None:
        environment = self.cluster_environment
        if self.ranks is not None or environment.local_rank() != 0:
            raise RuntimeError(
                "only local rank 0 starts the other ranks, once (local rank: "
                f"{environment.local_rank()}); check that LOCAL_RANK is not set by hand"
            )
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        os.environ["NODE_RANK"] = str(environment.node_rank())
        os.environ["LOCAL_RANK"] = "0"
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        commands, cwd = [], None
        for local_rank in range(1, self.num_processes):
            hydra = hydra_child_command(local_rank)  # a Hydra script
            command, cwd = hydra if hydra is not None else (script_command(), None)
            commands.append(command)
        self.ranks = RankProcesses.start(
            commands, os.environ, self.timeout, cwd=cwd, first_rank=self._first_rank()
        )
        self.procs = self.ranks.procs
        self.ranks.report_at_exit()


class PipelineSpawnLauncher(MultiProcessingLauncher):
    """``start_method="spawn"`` (or ``"fork"``) for ``PipeDreamStrategy``."""

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # A forked rank inherits this process's unreachable objects. A process group among them,
        # collected in the rank, would join threads the fork did not copy and hang the rank:
        # they are collected here first, where their threads exist.
        gc.collect()
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> WorkerOutput | None:
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        fitted = trainer.state.fn == TrainerFn.FITTING
        strategy, state = self._strategy, None
        if fitted:
            own = strategy.lightning_module_state_dict()
            state = _gather_state_dict(strategy.world_size, own)
        # This worker process ends next: close the process group first, so that no gloo thread
        # is still running when the interpreter exits (that aborts the process).
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if state is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".pipedream-weights.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state, weights_path)
        return WorkerOutput(
            best, weights_path, trainer.state, results, self.get_extra_results(trainer)
        )


def _gather_state_dict(world_size: int, own: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every stage's state (``own``: this rank's), merged under the LightningModule's names
    (all ranks call it)."""
    gathered: list[dict[str, Tensor]] = [{}] * world_size
    dist.all_gather_object(gathered, own)
    return merge_states(gathered)

"""``pl-pipedream-train``: the Hydra app that trains a pipelined model with ``PipeDreamStrategy``.

``train(cfg)`` builds the data module, the model, the strategy and the Trainer from the composed
config (each with ``_target_``), fits, validates and returns the final metrics; ``main`` only adds
Hydra and the start of the other ranks (``pl_pipedream.hydra_ranks``). The configs live in
the package ``pl_pipedream.configs`` so that an installed package finds them; one group per
swappable piece: ``model``, ``data``, ``cluster``, ``sync``, ``trainer``.

``ckpt_path`` resumes as ``trainer.fit(ckpt_path=...)`` does; ``ckpt_path=last`` takes the newest
checkpoint under the run's output directory (``checkpoint_to_resume``), so a requeued job given
the same ``hydra.run.dir`` goes on where it stopped, and its first run starts from the beginning.
The trainer configs' logger (``apps.metrics_log``) keeps ``metrics.csv`` across a resume, each
step once.

Before any rank starts, ``main`` merges ``smoke_settings`` over the config when ``smoke=true``
(``apply_smoke``: a recipe's reduced run for this machine) and refuses a config that asks for
hardware this machine does not have (``check_machine``). At the end of ``train`` rank 0 writes
``results.json`` (config, seed, metrics, plan, wall time, versions, git commit) into the output
directory (``apps.results.write_results``).

Cluster topologies describe the target machines, while ``trainer.devices`` says how many
processes actually run. When the two differ the plan is made for the part of the cluster those
processes would occupy, filled innermost first (``topology_for_devices``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from pl_pipedream.apps.results import write_results
from pl_pipedream.hydra_ranks import other_ranks
from pl_pipedream.planner.topology import Topology, TopologyError, fill_innermost

__all__ = [
    "MachineError",
    "apply_smoke",
    "check_machine",
    "checkpoint_to_resume",
    "main",
    "num_processes",
    "topology_for_devices",
    "train",
]

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit and validate as ``cfg`` says; return the final metrics (``val_acc``, ...).

    Every rank calls this (each is one process of the pipeline) and gets the same metrics.
    """
    import lightning.pytorch as pl

    from pl_pipedream.apps.metrics_log import KeepMetricsHistory

    started = time.perf_counter()
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = _build_model(cfg, datamodule)
    devices = num_processes(cfg.trainer)
    # Partial first: keyword arguments given to instantiate would be merged into the config,
    # which turns a Topology (a dataclass) into a DictConfig.
    strategy = instantiate(cfg.strategy, _partial_=True)(**_pipeline_arguments(cfg, devices))
    trainer = instantiate(cfg.trainer, strategy=strategy)
    trainer.callbacks.append(KeepMetricsHistory())  # metrics.csv goes on from a resumed step
    trainer.fit(model, datamodule=datamodule, ckpt_path=checkpoint_to_resume(cfg))
    metrics = _floats(trainer.callback_metrics)
    # The strategy runs validation through the pipeline; the last stage's metrics reach every rank.
    metrics.update(_floats(trainer.validate(model, datamodule=datamodule, verbose=False)[0]))
    if trainer.is_global_zero:
        shown = ", ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items()))
        log.info("Final metrics: %s", shown)
        plan = getattr(trainer.strategy, "plan", None)
        path = write_results(cfg, metrics, plan, time.perf_counter() - started)
        log.info("Outputs (metrics.csv, timeline.json, pipedream_plan.json): %s", cfg.output_dir)
        log.info("Results: %s", path)
    return metrics


@hydra.main(version_base="1.3", config_path="pkg://pl_pipedream.configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Entry point of ``pl-pipedream-train``; returns ``val_acc`` for Hydra sweepers."""
    cfg = apply_smoke(cfg)
    try:
        check_machine(cfg)
    except MachineError as error:  # the user's fix, without a traceback to read first
        print(f"pl-pipedream-train: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    # Several nodes need a launcher per node (torchrun, SLURM); one node starts its own ranks.
    single_node = int(cfg.trainer.get("num_nodes") or 1) == 1
    timeout = float(cfg.strategy.get("timeout") or 300)  # how long a rank waits for a peer
    with other_ranks(num_processes(cfg.trainer) if single_node else 1, timeout):
        _log_once()  # after the start of the other ranks: they import Lightning meanwhile
        try:
            metrics = train(cfg)
        finally:
            _leave_process_group()
    return metrics.get("val_acc")


def checkpoint_to_resume(cfg: DictConfig) -> str | None:
    """The checkpoint ``cfg.ckpt_path`` names: None, a path (passed on as given), or for
    ``last`` the newest checkpoint under ``cfg.output_dir`` (a ``*.ckpt`` file, or a sharded
    checkpoint's directory, dated by its description), None when there is none yet. Every rank
    resolves it alike, before any of them writes."""
    wanted = cfg.get("ckpt_path")
    if wanted is None or str(wanted) != "last":
        return None if wanted is None else str(wanted)
    found = [(_written(path), str(path)) for path in Path(cfg.output_dir).rglob("*.ckpt")]
    found = [(when, path) for when, path in found if when is not None]
    if not found:
        log.info(
            "ckpt_path=last: no checkpoint under %s yet; training starts afresh", cfg.output_dir
        )
        return None
    path = max(found)[1]
    log.info("ckpt_path=last: resuming from %s", path)
    return path


def _written(path: Path) -> float | None:
    """When the checkpoint at ``path`` was written; None for what is no checkpoint (a shard's
    staging or retired directory, a directory without a description)."""
    if path.is_file():
        return path.stat().st_mtime
    description = path / "pipeline.json"  # core.checkpoint.META_FILE, written last
    return description.stat().st_mtime if description.is_file() else None


# ----- smoke runs and the machine ---------------------------------------------------------------


class MachineError(RuntimeError):
    """The config asks for hardware this machine does not have."""


def apply_smoke(cfg: DictConfig) -> DictConfig:
    """With ``smoke=true``, ``cfg`` with its ``smoke_settings`` merged over it (in place).

    ``smoke_settings`` is a nested block of the config's own keys (``model.width``,
    ``data.input_shape``, ``trainer.max_steps``, ``cluster.topology``, ...), so a recipe carries
    the reduced run that fits this machine beside the full one. Merged before anything is built
    or any rank starts; every rank merges the same block (the children get ``smoke=true`` too).
    """
    if not cfg.get("smoke"):
        return cfg
    settings = cfg.get("smoke_settings")
    if settings is None:
        return cfg
    if not OmegaConf.is_dict(settings):
        raise ValueError(
            f"smoke_settings must be a block of config keys (smoke_settings: {settings!r}); "
            "write it as a mapping, e.g. smoke_settings: {trainer: {max_steps: 4}}"
        )
    block = OmegaConf.create(OmegaConf.to_container(settings, resolve=False))
    with open_dict(cfg):
        cfg.merge_with(block)
    return cfg


_NODE_RANK_VARIABLES = ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID")  # Lightning, torchrun, SLURM


def check_machine(
    cfg: DictConfig, cuda_devices: int | None = None, environ: Mapping[str, str] = os.environ
) -> None:
    """Refuse, before any rank starts, a run this machine cannot hold.

    GPUs without (enough) CUDA devices; several nodes without a launcher that set this node's
    rank (``NODE_RANK``, ``GROUP_RANK`` or ``SLURM_NODEID``); more processes per node than the
    cluster's innermost level (a server) holds, or more in all than the cluster has; processes
    that do not fill whole machines of the cluster (``topology_for_devices``), or a topology of
    another size than the run's processes (the strategy would stop every rank after they all
    started). ``cuda_devices`` defaults to what torch sees here.
    """
    trainer = cfg.trainer
    accelerator = str(trainer.get("accelerator") or "auto")
    nodes = int(trainer.get("num_nodes") or 1)
    per_node = num_processes(trainer)
    gpus = accelerator in ("gpu", "cuda")
    shown = (
        f"trainer.accelerator: {accelerator}, trainer.num_nodes: {nodes}, "
        f"trainer.devices: {per_node}"
    )
    needs = (
        f"this run needs {per_node * nodes} {'GPUs' if gpus else 'processes'} on {nodes} "
        f"node{'s' if nodes > 1 else ''}"
    )
    here = (
        "; smoke_settings must bring the run to this machine (trainer.accelerator: cpu, "
        "trainer.devices: 2, trainer.num_nodes: 1)"
        if cfg.get("smoke")
        else "; run it on the cluster (docs/reproducing.md: Recipes) or add smoke=true for the "
        "recipe's reduced CPU run"
    )
    if gpus:
        if cuda_devices is None:
            import torch

            cuda_devices = torch.cuda.device_count()
        if cuda_devices == 0:
            raise MachineError(f"{needs} ({shown}) and this machine has no CUDA device{here}")
        if per_node > cuda_devices:
            raise MachineError(
                f"{needs} ({shown}) and this machine has {cuda_devices} CUDA devices{here}"
            )
    if nodes > 1 and not any(environ.get(name) for name in _NODE_RANK_VARIABLES):
        raise MachineError(
            f"{needs} ({shown}) and no launcher set this node's rank (NODE_RANK, GROUP_RANK or "
            f"SLURM_NODEID){here}; on the cluster start one launcher per node (torchrun, srun)"
        )
    if cfg.get("cluster") is not None and cfg.cluster.get("topology"):
        topology = instantiate(cfg.cluster.topology)
        server = topology.levels[0].workers
        if per_node > server or per_node * nodes > topology.num_workers:
            raise MachineError(
                f"{needs} ({shown}) and the cluster's innermost level holds {server} workers, "
                f"the cluster {topology.num_workers} in all{here}"
            )
        try:  # the topology the strategy will plan for, checked before any rank starts
            part = _pipeline_arguments(cfg, per_node).get("topology")
        except TopologyError as error:
            raise MachineError(f"{error} ({shown})") from None
        if part is not None and part.num_workers != per_node * nodes:
            raise MachineError(
                f"the topology planned for must have one worker per process (topology workers: "
                f"{part.num_workers}, {shown}); give the layout by hand (strategy.balance=[...]) "
                "or plan for this machine's links (cluster=local)"
            )


# ----- topology and pipeline ----------------------------------------------------------------------


def topology_for_devices(topology: Topology, devices: int) -> Topology:
    """The part of ``topology`` that ``devices`` processes occupy, filled innermost first.

    Each level keeps as many of its components as the processes need, so 2 processes on
    servers of 4 GPUs are 2 GPUs of one server (the innermost bandwidth only), 8 processes are
    2 full servers, 16 processes on 4 servers of 4 are the whole cluster. The processes must
    fill whole components (6 on servers of 4 raises) and must not outnumber the cluster.
    """
    if devices < 1 or devices > topology.num_workers:
        raise TopologyError(
            f"the processes must fit on the cluster (devices: {devices}, cluster workers: "
            f"{topology.num_workers}); lower trainer.devices or pick a larger cluster"
        )
    part = fill_innermost(topology, devices)
    if part.num_workers != devices:
        sizes = [level.workers for level in topology.levels]
        raise TopologyError(
            f"the processes must fill whole machines of the cluster (devices: {devices}, "
            f"workers per level: {sizes}); use trainer.devices={part.num_workers} or a divisor "
            f"of {sizes[0]}"
        )
    return part


def num_processes(trainer_cfg: DictConfig) -> int:
    """Processes per node that ``trainer.devices`` asks for (a number or a list of ids)."""
    devices = trainer_cfg.get("devices", 1)
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(
            f"trainer.devices must be a positive number of processes or a list of device ids "
            f"(devices: {devices!r}); for example trainer.devices=2"
        )
    return devices


def _pipeline_arguments(cfg: DictConfig, devices: int) -> dict[str, Any]:
    """The topology the strategy plans for, scaled to the processes; none with a balance.

    An explicit ``strategy.balance`` wins over planning. Otherwise rank 0 profiles the model
    and plans for the cluster's topology (``topology=None``: links measured on this machine).
    """
    if cfg.strategy.get("balance") is not None:
        return {}
    if not cfg.cluster.get("topology"):
        return {"topology": None}
    return {"topology": topology_for_devices(instantiate(cfg.cluster.topology), devices)}


def _build_model(cfg: DictConfig, datamodule: Any) -> Any:
    """The model, told the data's ``input_shape`` and ``num_classes``; a model takes one kind
    of data (its class's ``data_kind``: images unless it says otherwise)."""
    wanted = getattr(get_class(cfg.model._target_), "data_kind", "images")
    given = getattr(datamodule, "data_kind", "images")
    if wanted != given:
        raise ValueError(
            f"the model and the data must be of one kind (model: {cfg.model._target_} takes "
            f"{wanted}, data: {cfg.data._target_} gives {given}); pick a data config that gives "
            f"{wanted}, e.g. model=seq2seq with data=sequences"
        )
    return instantiate(
        cfg.model,
        input_shape=list(datamodule.input_shape),
        num_classes=int(datamodule.num_classes),
    )


# ----- Hydra job plumbing -------------------------------------------------------------------------


def _log_once() -> None:
    """Let Hydra's handlers alone print and file Lightning's messages.

    Importing ``lightning`` adds a console handler to its logger, whose records also reach the
    root logger Hydra configured: every message would be printed twice. The CSV logger's warning
    that the output directory is not empty is dropped too: it always holds Hydra's own files.
    """
    import lightning  # noqa: F401  (adds the handler being removed)

    logger = logging.getLogger("lightning")
    if logging.getLogger().handlers:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
    warnings.filterwarnings("ignore", message="Experiment logs directory .* is not empty")


def _leave_process_group() -> None:
    """End the job's process group (Lightning leaves it open): the next job of a sweep starts
    its own ranks and needs a fresh one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _floats(metrics: Any) -> dict[str, float]:
    return {str(name): float(value) for name, value in dict(metrics).items()}


if __name__ == "__main__":
    main()

"""``pl-pipedream-train``: the Hydra app that trains a pipelined model with ``PipeDreamStrategy``.

``train(cfg)`` builds the data module, the model, the strategy and the Trainer from the composed
config (each with ``_target_``), fits, validates and returns the final metrics; ``main`` only adds
Hydra and the start of the other ranks (``pl_pipedream.hydra_ranks``). The configs live in
``pl_pipedream/configs`` so that an installed package finds them; one group per swappable piece:
``model``, ``data``, ``cluster``, ``sync``, ``trainer``.

Cluster topologies describe the target machines, while ``trainer.devices`` says how many
processes actually run. When the two differ the plan is made for the part of the cluster those
processes would occupy, filled innermost first (``topology_for_devices``).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import hydra
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from pl_pipedream.hydra_ranks import other_ranks
from pl_pipedream.planner.topology import Topology, TopologyError, fill_innermost

__all__ = ["main", "num_processes", "topology_for_devices", "train"]

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit and validate as ``cfg`` says; return the final metrics (``val_acc``, ...).

    Every rank calls this (each is one process of the pipeline) and gets the same metrics.
    """
    import lightning.pytorch as pl

    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = _build_model(cfg, datamodule)
    devices = num_processes(cfg.trainer)
    # Partial first: keyword arguments given to instantiate would be merged into the config,
    # which turns a Topology (a dataclass) into a DictConfig.
    strategy = instantiate(cfg.strategy, _partial_=True)(**_pipeline_arguments(cfg, devices))
    trainer = instantiate(cfg.trainer, strategy=strategy)
    trainer.fit(model, datamodule=datamodule)
    metrics = _floats(trainer.callback_metrics)
    # The strategy runs validation through the pipeline; the last stage's metrics reach every rank.
    metrics.update(_floats(trainer.validate(model, datamodule=datamodule, verbose=False)[0]))
    if trainer.is_global_zero:
        shown = ", ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items()))
        log.info("Final metrics: %s", shown)
        log.info("Outputs (metrics.csv, timeline.json, pipedream_plan.json): %s", cfg.output_dir)
    return metrics


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Entry point of ``pl-pipedream-train``; returns ``val_acc`` for Hydra sweepers."""
    # Several nodes need a launcher per node (torchrun, SLURM); one node starts its own ranks.
    single_node = int(cfg.trainer.get("num_nodes") or 1) == 1
    with other_ranks(num_processes(cfg.trainer) if single_node else 1):
        _log_once()  # after the start of the other ranks: they import Lightning meanwhile
        try:
            metrics = train(cfg)
        finally:
            _leave_process_group()
    return metrics.get("val_acc")


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

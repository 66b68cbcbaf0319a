"""Each Table 1 row planned on its cluster and simulated: our configuration and predicted speedup.

Each row is planned twice: from PipeDream's published profile, and (when a cache is given) from
our own model profiled on this machine (``reproduce.profiles``) and scaled to the paper's
per-GPU minibatch and GPU (``epochs.scale_profile``, ``speed_factor``). For each plan
``epochs.epochs`` simulates an epoch of data parallelism, PipeDream and GPipe from the planner's
cost model; the predicted speedup is the ratio of the epoch times. The paper measured epoch time
(or time to accuracy where that is all the table has) on real GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import yaml

from pl_pipedream.planner.optimize import plan as make_plan
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology, fill_innermost
from pl_pipedream.profile.graph import Profile
from pl_pipedream.published import load_profile
from pl_pipedream.reproduce.epochs import (
    DEFAULT_SPEED_FACTOR,
    DEVICE_TFLOPS,
    EPOCH_SAMPLES,
    PER_GPU_BATCH,
    Epochs,
    epochs,
    scale_profile,
)
from pl_pipedream.reproduce.table import PROFILE_OF, ReproduceError, Row

__all__ = ["Outcome", "cluster_topology", "predict", "render_config"]


@dataclass(frozen=True)
class Outcome:
    """A row with our plans for it (published profile, our profile) and their simulated epochs.

    ``plan`` is None where PipeDream published no profile of the model, ``own_plan`` where our
    own profile was not asked for.
    """

    row: Row
    plan: Plan | None = None
    epochs: Epochs | None = None
    own_plan: Plan | None = None
    own_epochs: Epochs | None = None
    own_meta: dict[str, str] | None = None  # the measured profile's (device, GEMM rate, ...)

    @property
    def config(self) -> str | None:
        return render_config(self.plan) if self.plan is not None else None

    @property
    def own_config(self) -> str | None:
        return render_config(self.own_plan) if self.own_plan is not None else None

    @property
    def predicted(self) -> float | None:
        return self.epochs.pipedream_speedup if self.epochs is not None else None

    @property
    def own_predicted(self) -> float | None:
        return self.own_epochs.pipedream_speedup if self.own_epochs is not None else None

    def _ratio(self, predicted: float | None) -> float | None:
        paper = self.row.paper_speedup
        if predicted is None or paper is None:
            return None
        return predicted / paper[0]

    @property
    def ratio(self) -> float | None:
        return self._ratio(self.predicted)

    @property
    def own_ratio(self) -> float | None:
        return self._ratio(self.own_predicted)

    def to_dict(self) -> dict[str, object]:
        paper = self.row.paper_speedup
        return {
            "row": self.row.id,
            "model": self.row.model,
            "cluster": self.row.cluster,
            "servers": self.row.servers,
            "gpus_per_server": self.row.gpus_per_server,
            "paper_config": self.row.config,
            "paper_speedup_epoch": self.row.speedup_epoch,
            "paper_speedup_tta": self.row.speedup_tta,
            "ratio_against": None if paper is None else paper[1],
            "profile": PROFILE_OF.get(self.row.model),
            "our_config": self.config,
            "predicted_speedup": self.predicted,
            "ratio": self.ratio,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "epochs": None if self.epochs is None else self.epochs.to_dict(),
            "own_config": self.own_config,
            "own_predicted_speedup": self.own_predicted,
            "own_ratio": self.own_ratio,
            "own_plan": None if self.own_plan is None else self.own_plan.to_dict(),
            "own_epochs": None if self.own_epochs is None else self.own_epochs.to_dict(),
        }


def cluster_topology(cluster: str, servers: int, gpus_per_server: int) -> Topology:
    """The part of a cluster (``configs/cluster/cluster_<x>.yaml``) a row's GPUs occupy.

    The GPUs fill the levels innermost first (``planner.topology.fill_innermost``): 4 GPUs of
    cluster A are one server (its PCIe bandwidth only), 16 are 4 servers of 4 joined by 10 Gbps
    Ethernet.
    """
    path = files("pl_pipedream.configs").joinpath("cluster", f"cluster_{cluster.lower()}.yaml")
    if not path.is_file():
        raise ReproduceError(
            f"the cluster must be one of the project's (cluster: {cluster}); add {path.name}"
        )
    spec = yaml.safe_load(path.read_text())["topology"]
    full = Topology.from_lists(spec["workers"], spec["bandwidths"])
    devices = servers * gpus_per_server
    part = fill_innermost(full, devices)
    if devices < 2 or part.num_workers != devices:
        raise ReproduceError(
            f"the row's GPUs must fill whole servers of its cluster (cluster: {cluster}, "
            f"servers x GPUs: {servers}x{gpus_per_server}); fix the row in the table"
        )
    return part


def render_config(result: Plan) -> str:
    """The plan as the paper writes configurations: ``16 (DP)``, ``straight`` or ``15-1``."""
    if result.num_stages == 1:
        return f"{result.num_workers} (DP)"
    if all(stage.replicas == 1 for stage in result.stages):
        return "straight"
    return result.shape


def predict(
    rows: list[Row],
    profiles: Path | None,
    cache: Path | None = None,
    speed_factor: float = DEFAULT_SPEED_FACTOR,
    microbatches: int | None = None,
) -> list[Outcome]:
    """Plan and simulate every row on its cluster, with the default planner options.

    From PipeDream's published profile where one covers the model (in ``profiles``, else the
    copy that ships with the package); from our own model profiled here when ``cache`` (where
    those profiles are kept) is given.
    """
    loaded: dict[str, Profile] = {}
    outcomes = []
    for row in rows:
        topology = cluster_topology(row.cluster, row.servers, row.gpus_per_server)
        samples, batch = EPOCH_SAMPLES.get(row.model), PER_GPU_BATCH.get(row.model)
        published = own = measured = None
        name = PROFILE_OF.get(row.model)
        if name is not None:
            if name not in loaded:
                loaded[name] = _published(profiles, name)
            published = make_plan(loaded[name], topology)
        if cache is not None and samples is not None and batch is not None:
            from pl_pipedream.reproduce.profiles import own_profile  # torch: only when asked

            measured, _ = own_profile(row.model, cache)
            factor = speed_factor * DEVICE_TFLOPS[row.cluster.upper()] / DEVICE_TFLOPS["A"]
            own = make_plan(scale_profile(measured, batch, factor), topology)
        outcomes.append(
            Outcome(
                row,
                published,
                _epochs(published, samples, batch, microbatches),
                own,
                _epochs(own, samples, batch, microbatches),
                None if measured is None else dict(measured.meta),
            )
        )
    return outcomes


def _published(profiles: Path | None, name: str) -> Profile:
    if profiles is None:
        return load_profile(name)
    path = profiles / f"{name}.txt"
    if not path.is_file():
        raise ReproduceError(
            f"the row's published profile must exist (--profiles: {profiles}, profile: "
            f"{path.name}); pass --profiles DIR holding it, or leave --profiles out"
        )
    return Profile.load(path)


def _epochs(
    result: Plan | None, samples: int | None, batch: int | None, microbatches: int | None
) -> Epochs | None:
    if result is None or samples is None or batch is None:
        return None
    return epochs(result, samples, batch, microbatches)

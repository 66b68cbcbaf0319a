"""The planner's decision as a value: stages, their layers, replicas and ranks.

A ``Plan`` is frozen, printable and JSON round-trips; the schedule, the runtime and the strategy
all read it and nothing else. Warm-up forwards and weight versions per stage follow PipeDream's
runtime (SOSP'19, 3.2-3.3): stage ``s`` of a pipeline over ``W`` workers admits
``(W - 1 - sum of replicas before s) // r_s`` warm-up forwards per replica and so keeps that many
plus one weight versions; the input stage's count is NOAM = ceil(W / r_0).

A plan may also give each rank several single-replica stages (chunks), interleaved or in a V
(module ``chunks``); only the chunked sync modes run such a plan, and ``stage_of_rank`` refuses
it (``stages_of_rank`` answers).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from pl_pipedream.planner.chunks import (
    CONTIGUOUS,
    PLACEMENTS,
    V_SHAPE,
    placement_of,
    stage_ranks,
)
from pl_pipedream.planner.topology import Topology

__all__ = ["Plan", "PlanError", "Stage"]


class PlanError(ValueError):
    """A plan that cannot drive a pipeline."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its layers (profile node ids), replicas and the ranks serving them.

    Times are per minibatch on one replica, in milliseconds; bytes are per minibatch.
    ``input_bytes`` is what the stage receives from the stage before it, ``output_bytes`` what it
    sends on (0 for the last stage); ``activation_bytes`` what its layers output, which the
    planner's memory model takes as what a minibatch in flight keeps for its backward pass.
    """

    index: int
    nodes: tuple[str, ...]
    replicas: int
    ranks: tuple[int, ...]
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    parameter_bytes: float = 0.0
    input_bytes: float = 0.0
    output_bytes: float = 0.0
    warmup: int = 0
    weight_versions: int = 1
    activation_bytes: float = 0.0  # the profile's outputs of the stage's layers, per minibatch

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms


@dataclass(frozen=True)
class Plan:
    """Stages in pipeline order plus what the planner predicted for them."""

    stages: tuple[Stage, ...]
    topology: Topology | None = None
    straight: bool = False
    memory: float | None = None
    slowest_stage_time: float = 0.0
    data_parallel_time: float = 0.0
    single_worker_time: float = 0.0
    meta: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.stages:
            raise PlanError("a plan needs at least one stage (stages: 0)")
        ranks = sorted({r for stage in self.stages for r in stage.ranks})
        if ranks != list(range(len(ranks))):
            raise PlanError(
                f"every rank from 0 to the number of workers - 1 must serve a stage "
                f"(ranks: {ranks}); renumber the stages' ranks"
            )
        for stage in self.stages:
            if stage.replicas != len(stage.ranks):
                raise PlanError(
                    f"a stage has one rank per replica (stage {stage.index}: replicas "
                    f"{stage.replicas}, ranks {list(stage.ranks)})"
                )
        if self.placement is None:
            mapping = [list(stage.ranks) for stage in self.stages]
            raise PlanError(
                f"every rank must serve exactly one stage, or each rank the same number of "
                f"single-replica stages interleaved (stage s on rank s mod p) or in a V (rank r: "
                f"stages r and 2p-1-r) (stage ranks: {mapping}); give each stage its own rank, "
                "or build it with Plan.from_balance(..., placement='interleaved' or 'v')"
            )

    # ----- derived values ---------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_workers(self) -> int:
        return len({rank for stage in self.stages for rank in stage.ranks})

    @property
    def placement(self) -> str | None:
        """How stages map to ranks: ``"contiguous"`` (one stage per rank), ``"interleaved"`` or
        ``"v"`` (several stages per rank, module ``chunks``); None only while checking."""
        return placement_of([stage.ranks for stage in self.stages])

    @property
    def chunks_per_rank(self) -> int:
        """Stages per rank: 1 in a contiguous plan."""
        return 1 if self.placement == CONTIGUOUS else self.num_stages // self.num_workers

    @property
    def noam(self) -> int:
        """Minibatches admitted to each input-stage replica in the startup phase."""
        return math.ceil(self.num_workers / self.stages[0].replicas)

    @property
    def throughput(self) -> float:
        """Predicted minibatches per second (1 / slowest stage time)."""
        return 1.0 / self.slowest_stage_time if self.slowest_stage_time > 0 else math.inf

    @property
    def speedup_over_data_parallel(self) -> float:
        if self.slowest_stage_time <= 0:
            return math.nan
        return self.data_parallel_time / self.slowest_stage_time

    @property
    def shape(self) -> str:
        """Replicas per stage joined by dashes, as the paper writes configurations: ``3-1``."""
        return "-".join(str(stage.replicas) for stage in self.stages)

    @property
    def layout(self) -> str:
        """Each stage's first and last layer and its replicas, in pipeline order: ``0-3|4-7``,
        ``0-7x2``."""
        return "|".join(
            (s.nodes[0] if len(s.nodes) == 1 else f"{s.nodes[0]}-{s.nodes[-1]}")
            + (f"x{s.replicas}" if s.replicas > 1 else "")
            for s in self.stages
        )

    def stages_of_rank(self, rank: int) -> tuple[Stage, ...]:
        """The stages ``rank`` serves, in pipeline order (one unless the plan is chunked)."""
        mine = tuple(stage for stage in self.stages if rank in stage.ranks)
        if not mine:
            raise PlanError(
                f"the rank must be one of the plan's workers (rank: {rank}, workers: "
                f"{self.num_workers}); launch as many processes as the plan has workers"
            )
        return mine

    def stage_of_rank(self, rank: int) -> Stage:
        """The one stage ``rank`` serves; a ``PlanError`` for a rank of several (chunks)."""
        mine = self.stages_of_rank(rank)
        if len(mine) > 1:
            raise PlanError(
                f"this needs one stage per rank, and the plan gives rank {rank} several "
                f"(stages: {[stage.index for stage in mine]}, placement: {self.placement}); "
                "use a plan of one stage per rank, or a chunked sync mode in "
                "pl-pipedream simulate"
            )
        return mine[0]

    # ----- construction -----------------------------------------------------------------------

    @classmethod
    def from_balance(
        cls,
        balance: Sequence[int],
        layer_ids: Sequence[str] | None = None,
        replicas: Sequence[int] | None = None,
        placement: str = CONTIGUOUS,
        num_ranks: int | None = None,
    ) -> Plan:
        """A pipeline of consecutive layers: ``balance[s]`` layers on stage ``s``.

        Ranks are given in stage order; ``replicas`` (default: 1 each) repeats a stage. With
        ``placement="interleaved"`` or ``"v"`` the stages are chunks spread over ``num_ranks``
        ranks (default: half the stages) as module ``chunks`` maps them.
        """
        if placement != CONTIGUOUS:
            return cls._chunked(balance, layer_ids, placement, num_ranks)
        counts = list(balance)
        if not counts or any(not isinstance(c, int) or c < 1 for c in counts):
            raise PlanError(
                f"every stage needs at least one layer (balance: {counts}); "
                "pass positive layer counts, e.g. balance=[2, 2]"
            )
        total = sum(counts)
        ids = list(layer_ids) if layer_ids is not None else [str(i) for i in range(total)]
        if total != len(ids):
            raise PlanError(
                f"the balance must cover every layer exactly once (layers: {len(ids)}, sum of "
                f"balance: {total}); change balance so that it sums to {len(ids)}"
            )
        reps = list(replicas) if replicas is not None else [1] * len(counts)
        if len(reps) != len(counts):
            raise PlanError(
                f"give one replica count per stage (stages: {len(counts)}, replicas: {reps})"
            )
        stages = []
        first_layer = first_rank = 0
        for index, (count, rep) in enumerate(zip(counts, reps, strict=True)):
            nodes = tuple(ids[first_layer : first_layer + count])
            ranks = tuple(range(first_rank, first_rank + rep))
            stages.append(Stage(index, nodes, rep, ranks))
            first_layer += count
            first_rank += rep
        return cls(with_warmup(stages), straight=all(r == 1 for r in reps))

    @classmethod
    def _chunked(
        cls,
        balance: Sequence[int],
        layer_ids: Sequence[str] | None,
        placement: str,
        num_ranks: int | None,
    ) -> Plan:
        """``from_balance`` with several stages per rank."""
        if placement not in PLACEMENTS:
            raise PlanError(
                f"placement must be one of {', '.join(PLACEMENTS)} (placement: {placement!r}); "
                "for example Plan.from_balance([1, 1, 1, 1], placement='interleaved')"
            )
        ranks = num_ranks if num_ranks is not None else max(1, len(balance) // 2)
        if not isinstance(ranks, int) or ranks < 1 or len(balance) % ranks:
            raise PlanError(
                f"a chunked plan gives every rank the same number of stages (stages: "
                f"{len(balance)}, num_ranks: {ranks!r}); pass a stage count that num_ranks "
                "divides"
            )
        chunks = len(balance) // ranks
        if chunks < 2 or (placement == V_SHAPE and chunks != 2):
            need = "2" if placement == V_SHAPE else "2 or more"
            raise PlanError(
                f"placement {placement!r} gives each rank {need} stages (stages: "
                f"{len(balance)}, num_ranks: {ranks}); pass {2 * ranks} stages"
            )
        flat = cls.from_balance(balance, layer_ids)
        mapping = stage_ranks(placement, ranks, chunks)
        stages = [
            Stage(**{**asdict(stage), "ranks": (rank,)})
            for stage, rank in zip(flat.stages, mapping, strict=True)
        ]
        return cls(with_warmup(stages))

    # ----- serialisation ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, object]:
        return {
            "stages": [asdict(stage) for stage in self.stages],
            "topology": self.topology.to_dict() if self.topology is not None else None,
            "straight": self.straight,
            "memory": self.memory,
            "slowest_stage_time": self.slowest_stage_time,
            "data_parallel_time": self.data_parallel_time,
            "single_worker_time": self.single_worker_time,
            "num_workers": self.num_workers,
            "shape": self.shape,
            "noam": self.noam,
            "throughput": self.throughput,
            "speedup_over_data_parallel": self.speedup_over_data_parallel,
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:  # type: ignore[type-arg]
        stages = tuple(
            Stage(**{**s, "nodes": tuple(s["nodes"]), "ranks": tuple(s["ranks"])})
            for s in data["stages"]
        )
        topology = Topology.from_dict(data["topology"]) if data.get("topology") else None
        return cls(
            stages,
            topology,
            bool(data.get("straight", False)),
            data.get("memory"),
            float(data.get("slowest_stage_time", 0.0)),
            float(data.get("data_parallel_time", 0.0)),
            float(data.get("single_worker_time", 0.0)),
            dict(data.get("meta") or {}),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    # ----- display ----------------------------------------------------------------------------

    def render(self) -> str:
        """A readable table: one row per stage, then the predictions."""
        header = f"{'stage':>5}  {'replicas':>8}  {'ranks':<14} {'layers':<28} {'compute ms':>10}"
        lines = [header, "-" * len(header)]
        for stage in self.stages:
            lines.append(
                f"{stage.index:>5}  {stage.replicas:>8}  {_span(stage.ranks):<14} "
                f"{_layers(stage.nodes):<28} {stage.compute_ms:>10.3f}"
            )
        lines.append("")
        lines.append(f"configuration        {self.shape} on {self.num_workers} workers")
        if self.placement != CONTIGUOUS:
            lines.append(
                f"placement            {self.placement}, {self.chunks_per_rank} stages per rank"
            )
        if self.slowest_stage_time > 0:
            slowest = "stage" if self.placement == CONTIGUOUS else "rank "  # a rank's stages
            lines.append(
                f"slowest {slowest}        {self.slowest_stage_time * 1e3:.4f} ms per minibatch"
            )
            lines.append(f"throughput           {self.throughput:.2f} minibatches/s (predicted)")
            lines.append(_against_data_parallel(self))
        if self.meta.get("advice"):
            lines.append(f"slower than DP       {self.meta['advice']}")
        lines.append(f"NOAM                 {self.noam}")
        if self.meta.get("tied"):
            lines.append(f"tied parameters      all-reduce per update ({self.meta['tied']})")
        if self.meta.get("cuts") == "topological":
            lines.append(
                "cuts                 prefixes of one topological order (too many antichains)"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def with_warmup(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """Fill in warm-up forwards and weight versions per stage as PipeDream's runtime does.

    In a chunked plan (several stages per rank) each stage gets its rank's 1F1B counts,
    ``p - 1 - r`` and one more; the chunked modes order their ranks themselves.
    """
    workers = len({rank for stage in stages for rank in stage.ranks})
    chunked = sum(stage.replicas for stage in stages) > workers
    before = 0
    out = []
    for stage in stages:
        if chunked:
            warmup = workers - 1 - stage.ranks[0]
        else:
            warmup = (workers - 1 - before) // stage.replicas
        out.append(Stage(**{**asdict(stage), "warmup": warmup, "weight_versions": warmup + 1}))
        before += stage.replicas
    return tuple(out)


def _against_data_parallel(plan: Plan) -> str:
    """The printed line comparing ``plan`` with data parallelism on the same workers, both
    predicted: a speedup, or a slowdown named as one."""
    speedup = plan.speedup_over_data_parallel
    where = (
        f"predicted; data parallel on the same workers: {plan.data_parallel_time * 1e3:.4f} ms "
        "per minibatch"
    )
    if speedup >= 1.0 - 1e-9:
        return f"speedup over DP      {speedup:.3f}x ({where})"
    return f"slowdown against DP  {speedup:.3f}x ({where}, faster than this plan)"


def _span(ranks: Sequence[int]) -> str:
    if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def _layers(nodes: Sequence[str]) -> str:
    if len(nodes) <= 3:
        return ",".join(nodes)
    return f"{nodes[0]}..{nodes[-1]} ({len(nodes)})"

"""The sync modes and what each one implies, stated once.

Every other module asks a ``SyncMode`` what it needs to know (does the pipeline flush after
every batch, how many updates a batch makes, who applies them, how few microbatches a batch may
have) instead of comparing mode names. The update rules themselves (which weight version a
minibatch uses) are in ``rules``; the order of forwards and backwards in ``build``.

Adding a mode: a member here with its properties, its row in ``rules.weight_version`` and
``rules.stash_limit``, and its order in ``build.replica_order`` (or, for a mode of several
stages per rank, in ``chunked``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from pl_pipedream.planner.chunks import CONTIGUOUS, INTERLEAVED, V_SHAPE

__all__ = [
    "CONTIGUOUS_MODES",
    "SYNC_MODES",
    "SyncMode",
    "UpdateSettings",
    "check_chunked",
    "check_chunks_per_rank",
    "update_settings",
]


class SyncMode(str, enum.Enum):
    """How a pipeline keeps its stages' weights consistent (docs/guide.md, "The sync modes")."""

    ASYNC = "async"  # weight stashing, one update per minibatch (PipeDream, SOSP'19 3.3)
    VERTICAL_SYNC = "vertical_sync"  # async, every stage on the input stage's version
    TWO_BW = "2bw"  # double-buffered weights, one update per batch (PipeDream-2BW)
    FLUSH = "flush"  # 1F1B, flushed after every batch (PipeDream-Flush)
    GPIPE = "gpipe"  # every forward, then every backward, flushed after every batch
    ZERO_BUBBLE = "zero_bubble"  # flush with split backwards, W steps in the bubbles (ZB-H1)
    INTERLEAVED = "interleaved"  # flush, several stages per rank interleaved (Megatron-LM, SC'21)
    ZBV = "zbv"  # flush, two stages per rank in a V, split backwards (ZB-V, ICLR'24)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value: str | SyncMode) -> SyncMode:
        """The mode named ``value``; a ``ValueError`` naming the choices for anything else."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"sync must be one of {', '.join(m.value for m in cls)} (sync: {value!r}); "
                "for example sync='async'"
            ) from None

    @property
    def updates_per_minibatch(self) -> bool:
        """One update per minibatch (per replica round); otherwise one per batch."""
        return self in (SyncMode.ASYNC, SyncMode.VERTICAL_SYNC)

    @property
    def flushes(self) -> bool:
        """The pipeline drains after every batch, so each batch starts on the newest weights."""
        return self in (
            SyncMode.FLUSH,
            SyncMode.GPIPE,
            SyncMode.ZERO_BUBBLE,
            SyncMode.INTERLEAVED,
            SyncMode.ZBV,
        )

    @property
    def splits_backward(self) -> bool:
        """Each backward runs as an input-gradient step, sent upstream at once, and a later
        weight-gradient step on the same weights (``ActionKind.BACKWARD_INPUT`` and
        ``BACKWARD_WEIGHT``); otherwise as one ``BACKWARD``."""
        return self in (SyncMode.ZERO_BUBBLE, SyncMode.ZBV)

    @property
    def placement(self) -> str:
        """The stage-to-rank mapping the mode's plans have (``planner.chunks``): one stage per
        rank, or several per rank interleaved (``interleaved``) or in a V (``zbv``)."""
        if self is SyncMode.INTERLEAVED:
            return INTERLEAVED
        return V_SHAPE if self is SyncMode.ZBV else CONTIGUOUS

    @property
    def chunked(self) -> bool:
        """Each rank holds several stages (``planner.chunks``; ``runtime.chunks`` runs them)."""
        return self.placement != CONTIGUOUS

    def chunks_per_rank(self, given: int | None = None) -> int:
        """The stages each rank holds in the mode's plans: 1 for a mode of one stage per rank;
        ``given`` (``check_chunks_per_rank``), else 2, for a chunked one (a V always has 2)."""
        if not self.chunked:
            return 1
        return 2 if given is None or self is SyncMode.ZBV else given

    @property
    def stale_weights(self) -> bool:
        """Some minibatches run on weights that lack the newest updates (``rules.update_delay``
        says by how many); the flushed modes update exactly as one device does."""
        return not self.flushes

    @property
    def updates_in_pipeline(self) -> bool:
        """The stages step their optimizers when the schedule says (inside a training step);
        otherwise the batch's mean gradient is handed to the trainer, which steps as on one
        device (clipping, accumulation and the optimizer hooks included)."""
        return not self.flushes

    @property
    def forwards_first(self) -> bool:
        """Every forward of a batch runs before its first backward (GPipe); otherwise 1F1B."""
        return self is SyncMode.GPIPE

    def min_microbatches(self, num_stages: int) -> int:
        """The fewest microbatches per batch the mode works with on ``num_stages`` stages:
        2BW's second buffer is free again only if a batch outlasts the pipeline's warm-up."""
        return num_stages if self is SyncMode.TWO_BW else 1


SYNC_MODES = tuple(mode.value for mode in SyncMode)
# The modes of plans with one stage per rank (every mode the runtime trains with).
CONTIGUOUS_MODES = tuple(mode.value for mode in SyncMode if mode.placement == CONTIGUOUS)


# The modes that flush the pipeline after every batch (every stage updates once, in step).
FLUSHED_MODES = tuple(mode.value for mode in SyncMode if mode.flushes)


def check_fp16(mode: SyncMode, call: str, bf16: str) -> None:
    """Raise for fp16 mixed precision in a mode that updates inside the pipeline: fp16 needs one
    loss scale for the whole pipeline, agreed among the stages at each update, which only the
    flushed modes take in step. ``call``: the front end's call, quoted in the fix with a mode's
    name in ``{sync}``; ``bf16``: how that front end asks for bf16 mixed precision."""
    if not mode.updates_in_pipeline:
        return
    raise ValueError(
        "fp16 mixed precision needs one loss scale for the whole pipeline, agreed among the "
        "stages at each update, which only the flushed modes take in step (precision: "
        f"'16-mixed', sync: {mode}); use {bf16}, or a flushed mode "
        f"({', '.join(FLUSHED_MODES)}), e.g. {call.format(sync=SyncMode.FLUSH)}"
    )


def check_chunked(mode: SyncMode, ties: Sequence[str], replan: bool, call: str) -> None:
    """Raise at setup for what a chunked mode (several stages per rank) does not train with:
    tied parameters (``ties``: each described), whose holders would include one rank twice, and
    re-planning, which moves one stage per rank (``core.relayout``). ``call``: the front end's
    call, quoted in the fix with a mode's name in ``{sync}``."""
    if not mode.chunked:
        return
    if ties:
        raise ValueError(
            f"sync='{mode}' trains without tied parameters (one parameter used by layers on "
            f"several stages; tied: {'; '.join(ties)}); use "
            f"{call.format(sync=SyncMode.ZERO_BUBBLE)} or untie them"
        )
    if replan:
        raise ValueError(
            f"sync='{mode}' keeps the plan it starts with (replan: 'auto'); use replan='off', "
            f"or {call.format(sync=SyncMode.ZERO_BUBBLE)} to re-plan"
        )


def check_chunks_per_rank(mode: SyncMode, chunks: object, call: str) -> None:
    """Raise for a ``chunks_per_rank`` that ``mode`` cannot take: an integer of at least 2, only
    with a chunked mode (a mode of one stage per rank would ignore it), and 2 in a V. None: the
    mode's default (``SyncMode.chunks_per_rank``). ``call``: the front end's call, quoted in
    the fix with its arguments in ``{args}``."""
    if chunks is None:
        return
    interleaved = call.format(args=f"sync='{SyncMode.INTERLEAVED}', chunks_per_rank={chunks!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
        example = call.format(args=f"sync='{SyncMode.INTERLEAVED}', chunks_per_rank=2")
        raise ValueError(
            f"chunks_per_rank must be an integer of at least 2, the stages each rank holds "
            f"(chunks_per_rank: {chunks!r}); for example {example}"
        )
    if not mode.chunked:
        raise ValueError(
            f"chunks_per_rank sets the stages per rank of the chunked modes, "
            f"{SyncMode.INTERLEAVED} and {SyncMode.ZBV}, and sync='{mode}' holds one stage per "
            f"rank (chunks_per_rank: {chunks}, sync: '{mode}'); use {interleaved}, or leave out "
            "chunks_per_rank"
        )
    if mode is SyncMode.ZBV and chunks != 2:
        raise ValueError(
            f"sync='{mode}' places two stages on each rank, in a V (chunks_per_rank: {chunks}); "
            f"leave out chunks_per_rank, or use {interleaved}"
        )


@dataclass(frozen=True)
class UpdateSettings:
    """How a stage turns its backward passes into the gradient an update applies.

    ``update_size``: the summed gradient is divided by this at the update. ``loss_scale``: the
    last stage seeds its backward with this instead of 1, so every stage sums gradients that are
    already divided. ``sum_linear_gradients``: several backward passes make one update, so Linear
    layers add their weight gradients into the sum inside the matrix product. ``split_backward``:
    the backward runs in two halves, and the Linear layers' weight products wait for the weight
    half (``runtime.linear_sums.HeldProducts``). ``fused_linear_min_elements``: a stage does
    either only if one of its 2-D weights has at least this many elements (None: the measured
    default of the weights' device, ``runtime.linear_sums.fused_from``; 0: always); otherwise
    autograd computes every gradient, and a split backward's input half the weights' too.
    """

    update_size: int
    loss_scale: float
    sum_linear_gradients: bool
    split_backward: bool = False
    fused_linear_min_elements: int | None = None


def update_settings(
    mode: SyncMode,
    microbatches: int,
    replicas: int,
    fused_linear_min_elements: int | None = None,
) -> UpdateSettings:
    """The settings of a stage with ``replicas`` replicas under ``mode``, its Linear layers'
    gradients fused from ``fused_linear_min_elements`` (``UpdateSettings``).

    An update averages its minibatches: one per replica in the per-minibatch modes (replicas
    sum their gradients, so divide by ``replicas``), the batch's ``microbatches`` otherwise.
    Dividing through the loss seed saves a pass over the gradients, and is exact only when
    ``1 / microbatches`` is (a power of two); otherwise the update divides.
    """
    if mode.updates_per_minibatch:
        return UpdateSettings(
            update_size=replicas,
            loss_scale=1.0,
            sum_linear_gradients=False,
            fused_linear_min_elements=fused_linear_min_elements,
        )
    exact = microbatches & (microbatches - 1) == 0
    return UpdateSettings(
        update_size=1 if exact else microbatches,
        loss_scale=1.0 / microbatches if exact else 1.0,
        sum_linear_gradients=microbatches > replicas,  # backward passes per update
        split_backward=mode.splits_backward,
        fused_linear_min_elements=fused_linear_min_elements,
    )

"""One fit's divergence check: the watch over the logged losses and the notes of the data fed.

Every rank logs the same training loss at the same step (``runtime.pipeline``) and holds the
same batches (``core.data``), so every rank reaches the same verdict at the same step, with the
same message, without a message between ranks. A verdict on a loss that is not finite names the
first batch and microbatch whose data held a NaN or inf (``core.finite_data``) when there is
one: bad data, not training gone wrong. What a verdict does is the front end's ``divergence``
option (``core.divergence.stops``): stop (raise the error on every rank) or warn once and stop
watching.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pl_pipedream.core.divergence import DivergenceWatch, bad_data_message, stops
from pl_pipedream.core.errors import BadData, TrainingDiverged
from pl_pipedream.core.finite_data import FiniteData

__all__ = ["LossWatch", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """What a diverged loss does: ``error`` raised on every rank when ``stop``, else its text
    warned once (the watch is then off for the rest of the fit)."""

    error: TrainingDiverged
    stop: bool


class LossWatch:
    """The divergence watch of one fit (none with ``divergence="off"``) and its notes of the
    batches fed since the last finite logged loss. ``rule``: ``DivergenceWatch``'s rise,
    patience and window (refused here when bad)."""

    def __init__(self, divergence: str, rule: tuple[float, int, int]) -> None:
        self.divergence = divergence
        watch = DivergenceWatch(*rule)  # refuses bad thresholds now
        self.watch: DivergenceWatch | None = watch if divergence != "off" else None
        self.finite_data = FiniteData()

    def note(self, fed: int, batch: Any, microbatches: int) -> None:
        """Note the ``fed``-th batch of the fit (``PipelineRunner.batches`` before it runs)."""
        if self.watch is not None:
            self.finite_data.note(fed, batch, microbatches)

    def judge(
        self, loss: float, batch: int | None, step: int, explain: Callable[[str], str]
    ) -> Verdict | None:
        """Take the logged ``loss`` of the ``batch``-th batch fed, at ``step``; a verdict when
        the run diverged. ``explain(reason)`` words a divergence that is not bad data
        (``core.divergence.divergence_message`` with the front end's values)."""
        if self.watch is None:
            return None
        found = self.watch.observe(loss)
        if found is None:
            if batch is not None:
                self.finite_data.forget_through(batch)
            return None
        bad = None if found.finite or batch is None else self.finite_data.first_bad(batch)
        if bad is not None:
            error: TrainingDiverged = BadData(bad_data_message(loss, step, *bad))
        else:
            error = TrainingDiverged(explain(found.reason))
        stop = stops(self.divergence, found)
        if not stop:
            self.watch = None  # warned once, not checked again in this fit
        return Verdict(error, stop)

    def check(
        self,
        loss: float,
        batch: int | None,
        step: int,
        explain: Callable[[str], str],
        drain: Callable[[], None],
        warn: Callable[[str], None],
    ) -> None:
        """``judge``, then act on the verdict as every front end does: to stop, ``drain`` (the
        messages in flight arrive first, on every rank at this step) and raise the error; else
        ``warn`` its text once."""
        verdict = self.judge(loss, batch, step, explain)
        if verdict is None:
            return
        if verdict.stop:
            drain()
            raise verdict.error
        warn(str(verdict.error) + " (not checked again in this fit)")

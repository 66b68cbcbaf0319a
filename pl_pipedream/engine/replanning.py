"""Re-planning while training, for every front end: the checks of a ``Replanner`` over a session.

``replan="auto"`` checks the plan every ``replan_every`` steps against the measured stage times
(``core.replanner``); ``ReplanChecks`` is the one driver of those checks, which ``Pipeline`` and
``PipeDreamStrategy`` call at their step boundaries: the first step after a start or a move is
warm-up (the actions since are dropped and the clocks reset), a due check takes the session's
actions since the last one (``Session.take_timeline``, so the record never holds more than one
interval), decides, and reports on rank 0 through the front end's ``info`` and ``warn``; after
the front end moved (``Session.move``), ``moved`` starts the warm-up again over the new stage.

``replan="off"`` (the default) builds a ``Replanner`` that is never due: the timeline is not
recorded and a step pays one comparison. The memory limit (``memory=``, else the device's) and
``topology`` also bound re-planning, so they are accepted beside a ``balance=`` or ``plan=`` when
``replan="auto"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from torch import nn

from pl_pipedream.core.replanner import Replanner, create_replanner, tied_straight
from pl_pipedream.engine.session import Session
from pl_pipedream.planner.replan import Decision
from pl_pipedream.planner.topology import Topology

__all__ = ["ReplanChecks", "log", "make_replanner"]

log = logging.getLogger(__name__)  # the engine's re-plan reports and moves


def make_replanner(
    options: tuple[str, int, float, Path | None],
    topology: Topology | None,
    memory: float | None,
    session: Session,
    module: nn.Module,
) -> Replanner:
    """A front end's ``Replanner`` (``core.replanner.create_replanner``, every rank at the same
    point) from its ``options`` (``replan``, ``replan_every``, ``replan_threshold``, the history
    file), bound by its ``topology`` and ``memory`` (bytes) over ``session``'s layers inside
    ``module``."""
    mode, every, threshold, history = options
    s = session.settings
    return create_replanner(
        mode,
        every,
        threshold,
        history=history,
        topology=topology,
        memory=memory,
        device=s.device,
        microbatches=s.microbatches,
        sync=s.sync,
        recompute=s.recompute,
        straight=tied_straight(s.sync, module, session.layers),
    )


class ReplanChecks:
    """The re-plan checks of ``replanner`` over ``session``; ``info`` and ``warn`` report on
    rank 0 (the front end's log and warnings)."""

    def __init__(
        self,
        replanner: Replanner,
        session: Session,
        info: Callable[[str], None],
        warn: Callable[[str], None],
    ) -> None:
        self.replanner, self.session = replanner, session
        self.info, self.warn = info, warn
        self.watch()

    def at(self, step: int, check: bool = True) -> Decision | None:
        """Every rank at the boundary before step ``step``: the warm-up's end, or a due check's
        decision (``check=False``: the front end moves anyway, so no check is taken)."""
        if self.replanner.starts(step):  # the steps before: warm-up
            self.session.take_timeline()
            self.replanner.reset()
            return None
        if not (check and self.replanner.due(step)):
            return None
        since = self.session.take_timeline()
        plan = self.session.plan
        assert plan is not None
        decision = self.replanner.check(step, plan, since, self.session.settings.rank)
        if decision is not None and self.session.settings.rank == 0:
            self.info(self.replanner.report)
            for warning in decision.warnings:
                self.warn(warning)
        return decision

    def moved(self, step: int, seconds: float) -> None:
        """After a move at ``step`` that took ``seconds``: the next step is warm-up again, over
        the layers this rank holds now; the move's own actions are not training."""
        self.replanner.moved(step, seconds)
        self.watch()
        self.session.take_timeline()

    def watch(self) -> None:
        """Time the layers this rank holds (named by their index, as the plan's nodes)."""
        assert self.session.local is not None
        self.replanner.watch(dict(self.session.local.module.named_children()))

    def close(self) -> None:
        """The history written, the hooks removed."""
        self.replanner.close()

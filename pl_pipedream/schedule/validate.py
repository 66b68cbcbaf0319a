"""Check a schedule against every rule the runtime relies on, before anything runs.

The checks (module ``checks``), in order: each list belongs to its rank and minibatches go to
their round-robin replica; every send has its receive; every forward has its backward on the
same replica with the same version, wrapped in its receive and send; versions follow the mode's
rule, exist when used and fit the weight stash; the lists do not deadlock when receives block
and sends do not; and no rank waits, inside one Lightning step's segment, for another rank's
later segment. The error shows the step x rank table with the failing cells marked.
"""

from __future__ import annotations

from pl_pipedream.schedule.actions import Schedule, ScheduleError
from pl_pipedream.schedule.checks import CHECKS
from pl_pipedream.schedule.render import render

__all__ = ["ScheduleError", "validate"]


def validate(schedule: Schedule, *, max_rows: int | None = 60) -> None:
    """Raise ``ScheduleError`` naming the first broken rule; the table shows ``max_rows`` steps."""
    for check in CHECKS:
        problem = check(schedule)
        if problem is not None:
            try:
                table = render(schedule, mark=problem.cells, max_rows=max_rows)
            except Exception as error:  # a schedule too broken to run still gets its message
                table = f"(no table: {error})"
            raise ScheduleError(f"{problem.message}\n\n{table}", problem.cells)

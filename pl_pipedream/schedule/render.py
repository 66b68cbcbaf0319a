"""Print a schedule as a step x rank table.

Rows are logical time steps of a unit-time run that respects every dependency (see
``unit_time``): each shown action takes one step, a rank waits for its receives and collectives.
Messages and updates are hidden by default and then take no time. Marked cells (the validator's
failing actions) print as ``*cell*``; if a rank gets stuck, a last ``stuck`` row shows the action
it waits on.
"""

from __future__ import annotations

from collections.abc import Collection

from pl_pipedream.schedule.actions import COMPUTE, MESSAGES, UPDATES, Schedule
from pl_pipedream.schedule.unit_time import UnitTimeRun, run_in_unit_time

__all__ = ["render"]


def render(
    schedule: Schedule,
    *,
    width: int | None = None,
    show_messages: bool = False,
    show_updates: bool = False,
    mark: Collection[tuple[int, int]] = (),
    max_rows: int | None = None,
) -> str:
    """The step x rank table of ``schedule``; ``mark`` holds (rank, action index) cells.

    ``width`` is the width of a cell (default: the widest cell). A marked action of a hidden
    kind turns that kind on, so the mark is always visible. ``max_rows`` cuts long tables.
    """
    marked = set(mark)
    for rank, pos in marked:
        kind = schedule.actions[rank][pos].kind
        show_messages |= kind in MESSAGES
        show_updates |= kind in UPDATES
    kinds = set(COMPUTE)
    kinds |= MESSAGES if show_messages else set()
    kinds |= UPDATES if show_updates else set()
    run = run_in_unit_time(schedule, lambda rank, pos, action: action.kind in kinds)

    def cell(rank: int, pos: int | None) -> str:
        if pos is None:
            return ""
        text = str(schedule.actions[rank][pos])
        return f"*{text}*" if (rank, pos) in marked else text

    columns = schedule.held_ranks  # a schedule of some ranks' lists shows those ranks
    rows = [[cell(rank, row[rank]) for rank in columns] for row in run.rows]
    labels = [str(step) for step in range(len(rows))]
    if max_rows is not None and len(rows) > max_rows:
        rows, labels = _window(rows, labels, max_rows, _first_marked(run.rows, marked))
    if not run.finished:
        stuck = dict(run.stuck)
        rows.append([cell(rank, stuck.get(rank)) for rank in columns])
        labels.append("stuck")
    header = [_rank_label(schedule, rank) for rank in columns]
    return _table(_title(schedule), header, labels, rows, width) + _unseen(schedule, run, marked)


def _first_marked(rows: tuple[tuple[int | None, ...], ...], marked: set[tuple[int, int]]) -> int:
    for step, row in enumerate(rows):
        if any((rank, pos) in marked for rank, pos in enumerate(row)):
            return step
    return len(rows)


def _window(
    rows: list[list[str]], labels: list[str], max_rows: int, focus: int
) -> tuple[list[list[str]], list[str]]:
    """Keep ``max_rows`` steps, around ``focus`` if it is a step, else the first ones."""
    start = 0 if focus >= len(rows) else max(0, min(focus - max_rows // 2, len(rows) - max_rows))
    stop = start + max_rows
    gap = ["..."] * len(rows[0])
    kept, names = rows[start:stop], labels[start:stop]
    if start > 0:
        kept, names = [gap] + kept, ["..."] + names
    if stop < len(rows):
        kept, names = kept + [gap], names + ["..."]
    return kept, names


def _title(schedule: Schedule) -> str:
    return (
        f"{schedule.sync} schedule, plan {schedule.plan.shape}, {schedule.num_batches} batches x "
        f"{schedule.microbatches} microbatches (cells: stage kind minibatch v version)"
    )


def _rank_label(schedule: Schedule, rank: int) -> str:
    stages = schedule.plan.stages_of_rank(rank)
    if len(stages) > 1:  # several stages per rank (chunks)
        return f"r{rank} s" + ",".join(str(stage.index) for stage in stages)
    stage = stages[0]
    if stage.replicas == 1:
        return f"r{rank} s{stage.index}"
    return f"r{rank} s{stage.index}.{stage.ranks.index(rank)}"


def _table(
    title: str, header: list[str], labels: list[str], rows: list[list[str]], width: int | None
) -> str:
    cells = [c for row in rows for c in row] + header
    wide = width if width is not None else max(len(c) for c in cells)
    left = max([len("step")] + [len(label) for label in labels])
    lines = [title, " | ".join(["step".rjust(left)] + [h.ljust(wide) for h in header]).rstrip()]
    lines.append("-" * len(lines[-1]))
    for label, row in zip(labels, rows, strict=True):
        lines.append(" | ".join([label.rjust(left)] + [c[:wide].ljust(wide) for c in row]).rstrip())
    return "\n".join(lines)


def _unseen(schedule: Schedule, run: UnitTimeRun, marked: set[tuple[int, int]]) -> str:
    """A note for marked actions the run never reached (they sit after a stuck rank's action)."""
    shown = {(rank, pos) for row in run.rows for rank, pos in enumerate(row) if pos is not None}
    shown |= set(run.stuck)
    missing = sorted(marked - shown)
    if not missing:
        return ""
    notes = [f"rank {rank} action {pos} {schedule.actions[rank][pos]}" for rank, pos in missing]
    return "\nmarked but never reached: " + ", ".join(notes)

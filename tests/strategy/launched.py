"""Run a script's ``main(argv)`` on N gloo ranks forked from this process, each as a rank that a
launcher started (``LOCAL_RANK``, ``NODE_RANK`` and ``WORLD_SIZE`` set, the process group up).

The strategy then runs in each rank itself, so a script's code after ``fit`` runs on every rank as
in a user's run, and no interpreter starts per rank (torch and Lightning take ~3-5 s to import).
A test that is about the launch itself runs the script as a user does instead."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

from tests.runtime import distributed


def _rank(rank: int, world: int, main: Callable[[list[str]], Any], argv: list[str]) -> Any:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    return main(list(argv))


def launched(
    world: int,
    main: Callable[[list[str]], Any],
    argv: Sequence[str],
    timeout: float = 300.0,
    killed: Collection[int] = (),
) -> dict[int, tuple[str, Any]]:
    """``main(argv)`` on ``world`` forked ranks: {rank: ("ok", what it returned) or ("error",
    the error and its traceback)}; the ranks in ``killed`` end their process themselves."""
    return distributed.run(world, _rank, main, list(argv), timeout=timeout, killed=killed)

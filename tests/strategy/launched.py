"""Run a script's ``main(argv)`` on N gloo ranks forked from this process, each as a rank that a
launcher started (``LOCAL_RANK``, ``NODE_RANK`` and ``WORLD_SIZE`` set, the process group up).

The strategy then runs in each rank itself, so a script's code after ``fit`` runs on every rank as
in a user's run, and no interpreter starts per rank (torch and Lightning take ~3-5 s to import).
What a rank prints, logs or warns reaches file descriptors 1 and 2, as in a process of its own,
so that a test reads it with ``capfd``. A test that is about the launch itself runs the script
as a user does instead."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any, TextIO

from tests.runtime import distributed


def _print_warning(  # the signature of warnings.showwarning
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _output_to_descriptors() -> None:
    """Point what pytest redirected in the parent back at fds 1 and 2: ``sys.stdout`` and
    ``sys.stderr`` (pytest's capture files), the stream handlers created while they were
    pytest's (Lightning's), and the warnings (pytest records them in a list)."""
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            if type(handler) is logging.StreamHandler:  # not pytest's own (subclasses)
                handler.setStream(sys.stderr)
    warnings.showwarning = _print_warning


def _rank(
    rank: int, world: int, main: Callable[[list[str]], Any], argv: list[str], cwd: str
) -> Any:
    _output_to_descriptors()
    os.chdir(cwd)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    return main(list(argv))


def launched(
    world: int,
    main: Callable[[list[str]], Any],
    argv: Sequence[str],
    cwd: str | os.PathLike[str],
    timeout: float = 300.0,
    killed: Collection[int] = (),
) -> dict[int, tuple[str, Any]]:
    """``main(argv)`` on ``world`` forked ranks working in ``cwd`` (what a script writes to its
    working directory, a plan for one, goes there): {rank: ("ok", what it returned) or
    ("error", the error and its traceback)}; the ranks in ``killed`` end their process
    themselves."""
    args = (main, list(argv), os.fspath(cwd))
    return distributed.run(world, _rank, *args, timeout=timeout, killed=killed)

"""A pipeline's options, defined once: ``Pipeline``'s keyword arguments (their names, types and
defaults are its signature). The front ends over it take them as they are: the Fabric strategy
and ``prepare_pipeline`` pass their keyword arguments on, less those their framework decides
(the device, the precision, an empty build), and check them when they are made, before any
process starts (``engine.arguments.check_options``), with the fix written in their own spelling.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Mapping
from typing import Any

from pl_pipedream.engine.arguments import check_options
from pl_pipedream.engine.pipeline import POSITIONAL, Pipeline
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["checked_options", "option_defaults"]


def option_defaults() -> dict[str, Any]:
    """Every option of ``Pipeline`` with its default, in the signature's order."""
    parameters = inspect.signature(Pipeline.__init__).parameters
    return {name: p.default for name, p in parameters.items() if name not in ("self", *POSITIONAL)}


def checked_options(
    given: Mapping[str, Any], call: str, owned: Collection[str] = ()
) -> tuple[dict[str, Any], SyncMode]:
    """``given`` (a front end's keyword arguments for its ``Pipeline``) checked: each a
    ``Pipeline`` option that the front end's framework does not decide (``owned``), each value
    as ``Pipeline`` takes it; ``call`` is the front end's, with its arguments in ``{args}``.
    Returns ``given`` as a dict, and the sync mode."""
    defaults = option_defaults()
    unknown = sorted(name for name in given if name not in defaults or name in owned)
    if unknown:
        takes = ", ".join(name for name in defaults if name not in owned)
        set_by = f"; {', '.join(sorted(owned))} come from the framework" if owned else ""
        raise TypeError(
            f"{call.format(args='...')} takes the options of pl_pipedream.Pipeline (unknown: "
            f"{', '.join(unknown)}); use {takes}{set_by}"
        )
    mode = check_options({**defaults, **given}, call)
    return dict(given), mode

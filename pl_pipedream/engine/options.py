"""A pipeline's options, defined once: ``Pipeline``'s keyword arguments (their names, types and
defaults are its signature). The front ends over it take them as they are: the Fabric strategy
and ``prepare_pipeline`` pass their keyword arguments on, ``PipeDreamStrategy`` names them in its
own signature, each less those its framework decides, and each checks them when it is made,
before any process starts (``engine.arguments.check_options``), with the fix written in its own
spelling. ``FRONT_ENDS`` is the data of what differs per front end: the options its framework
decides (and where the user sets them instead) and the defaults it sets apart from
``Pipeline``'s; ``tests/engine/test_options.py`` holds every front end's signature to it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pl_pipedream.engine.arguments import CALL, check_options
from pl_pipedream.engine.pipeline import POSITIONAL, Pipeline
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["FRONT_ENDS", "FrontEnd", "checked_options", "option_defaults"]


@dataclass(frozen=True)
class FrontEnd:
    """How one front end takes ``Pipeline``'s options: ``call``, its spelling in fixes (the
    arguments in ``{args}``); ``decides``: the options its framework sets, each with where the
    user sets it instead; ``defaults``: its defaults that differ from ``Pipeline``'s."""

    call: str
    decides: Mapping[str, str]
    defaults: Mapping[str, Any] = field(default_factory=dict)


FRONT_ENDS = {
    "Pipeline": FrontEnd(CALL, {}),
    "PipeDreamStrategy": FrontEnd(
        "PipeDreamStrategy({args})",
        {
            "device": "Trainer(accelerator=..., devices=...)",
            "precision": "Trainer(precision=...)",
            "clip_grad_norm": "Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm')",
            "example_input": "the first training batch, or the module's example_input_array",
            "empty_build": "configure_model() or trainer.init_module(empty_init=True)",
            "replan_history": "pipedream_plan_history.jsonl beside the Trainer's logs",
        },
        # PipeDream's own mode; a preemption signal saves last.ckpt, as on a SLURM cluster
        {"sync": SyncMode.ASYNC, "preempt_signals": ("SIGTERM", "SIGUSR1")},
    ),
    "Fabric": FrontEnd(
        "PipeDreamFabricStrategy({args})",
        {
            "device": "Fabric(accelerator=..., devices=...)",
            "precision": "Fabric(precision=...)",
            "empty_build": "fabric.init_module(empty_init=True)",
        },
    ),
    "Accelerate": FrontEnd(
        "prepare_pipeline(accelerator, model, optimizer, loss_fn, {args})",
        {"device": "Accelerator(cpu=...)", "precision": "Accelerator(mixed_precision=...)"},
    ),
}


def option_defaults() -> dict[str, Any]:
    """Every option of ``Pipeline`` with its default, in the signature's order."""
    parameters = inspect.signature(Pipeline.__init__).parameters
    return {name: p.default for name, p in parameters.items() if name not in ("self", *POSITIONAL)}


def checked_options(given: Mapping[str, Any], front: FrontEnd) -> tuple[dict[str, Any], SyncMode]:
    """``given`` (a front end's keyword arguments for its ``Pipeline``) checked: each a
    ``Pipeline`` option that the ``front`` end's framework does not decide, each value as
    ``Pipeline`` takes it, every fix in the front end's spelling. Returns ``given`` as a dict,
    and the sync mode."""
    defaults, call = option_defaults(), front.call.format(args="...")
    decided = sorted(name for name in given if name in front.decides)
    if decided:
        where = "; ".join(f"{name}: {front.decides[name]}" for name in decided)
        raise TypeError(
            f"{call} leaves these options to its framework (given: {', '.join(decided)}); set "
            f"them there ({where})"
        )
    unknown = sorted(name for name in given if name not in defaults)
    if unknown:
        takes = ", ".join(name for name in defaults if name not in front.decides)
        raise TypeError(
            f"{call} takes the options of pl_pipedream.Pipeline (unknown: "
            f"{', '.join(unknown)}); use {takes}"
        )
    mode = check_options({**defaults, **front.defaults, **given}, front.call)
    return dict(given), mode

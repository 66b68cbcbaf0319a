"""Optimizer state keyed by parameter name, so that it resumes under any layout.

``torch.optim.Optimizer.state_dict()`` is positional: each parameter group lists indices, and
the per-parameter state (SGD's momentum buffer, Adam's ``step``, ``exp_avg``, ``exp_avg_sq``)
is keyed by those indices over the parameters the optimizer holds. On a pipeline rank that is
its own stage's parameters only, so the indices mean nothing under another plan. The named
form written into a checkpoint instead keeps, per group, its settings and the ordered names of
ALL the module's parameters that ``configure_optimizers`` put in it (recorded before the
optimizer was cut down to the stage), and each parameter's state under its name:

```
{"keyed_by": "name",
 "param_groups": [{"lr": 0.01, ..., "params": ["net.0.weight", "net.0.bias", ...]}, ...],
 "state": {"net.0.weight": {"step": ..., "exp_avg": ..., ...}, ...}}
```

A tied parameter (one parameter, held by several stages) has one name here (its first), so
every holder saves the same entry and a loader takes whichever came first. The conversions are
plain functions over dicts: ``to_named`` (a rank's positional state and the names of its
parameters), ``to_positional`` (the state of the parameters a rank holds now, for
``load_state_dict``), ``merge`` (the stages' named states into one) and ``is_named``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pl_pipedream.core.errors import CheckpointError

__all__ = ["KEY", "group_names", "is_named", "merge", "to_named", "to_positional"]

KEY = "keyed_by"
Groups = Sequence[Sequence[str]]  # per parameter group, the names of its parameters in order


def is_named(state: Any) -> bool:
    """Whether ``state`` is an optimizer state in the named form (not ``state_dict()``'s)."""
    return isinstance(state, dict) and state.get(KEY) == "name"


def group_names(param_groups: Iterable[dict[str, Any]], names: dict[int, str]) -> list[list[str]]:
    """Per group, the names of its parameters in order (``names``: parameter id -> name)."""
    return [[names[id(param)] for param in group["params"]] for group in param_groups]


def to_named(state: dict[str, Any], full: Groups, local: Groups) -> dict[str, Any]:
    """The named form of ``state`` (an optimizer's ``state_dict()``): ``local`` names the
    parameters the optimizer holds, group by group in its order; ``full`` names every parameter
    ``configure_optimizers`` put in each group (the two are equal on one device)."""
    _check_groups(len(state["param_groups"]), len(full), "the optimizer now", "recorded")
    groups, named = [], {}
    for group, full_names, local_names in zip(state["param_groups"], full, local, strict=True):
        settings = {key: value for key, value in group.items() if key != "params"}
        groups.append({**settings, "params": list(full_names)})
        for index, name in zip(group["params"], local_names, strict=True):
            if index in state["state"]:
                named[name] = state["state"][index]
    return {KEY: "name", "param_groups": groups, "state": named}


def to_positional(named: dict[str, Any], local: Groups) -> dict[str, Any]:
    """``named``'s state for an optimizer holding the parameters ``local`` names, group by
    group: what its ``load_state_dict`` takes. Each group's settings come from the checkpoint;
    a parameter must sit in the group that saved it."""
    saved = named["param_groups"]
    _check_groups(len(local), len(saved), "the optimizer", "the checkpoint")
    groups, state, index = [], {}, 0
    for number, (group, local_names) in enumerate(zip(saved, local, strict=True)):
        strangers = [name for name in local_names if name not in set(group["params"])]
        if strangers:
            raise CheckpointError(
                f"each parameter must sit in the optimizer's parameter group that saved it "
                f"(group {number}, not in the checkpoint's group: {strangers[:6]}); build the "
                "parameter groups in configure_optimizers as the saving run did"
            )
        settings = {key: value for key, value in group.items() if key != "params"}
        params = list(range(index, index + len(local_names)))
        groups.append({**settings, "params": params})
        for position, name in zip(params, local_names, strict=True):
            if name in named["state"]:
                state[position] = named["state"][name]
        index += len(local_names)
    return {"state": state, "param_groups": groups}


def merge(states: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One named state from the stages' (a name's first entry wins: tied copies are equal)."""
    states = list(states)
    merged: dict[str, Any] = {}
    for state in states:
        for name, value in state["state"].items():
            merged.setdefault(name, value)
    return {KEY: "name", "param_groups": states[0]["param_groups"], "state": merged}


def _check_groups(count: int, expected: int, what: str, other: str) -> None:
    if count != expected:
        raise CheckpointError(
            f"an optimizer's state resumes into as many parameter groups as it saved "
            f"({what}: {count} groups, {other}: {expected}); build the parameter groups in "
            "configure_optimizers as the saving run did"
        )

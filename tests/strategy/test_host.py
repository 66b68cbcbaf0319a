"""``Host``: what the strategy's modules use of ``PipeDreamStrategy`` is what the class has."""

from __future__ import annotations

import inspect

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.strategy.host import Host


def declared() -> set[str]:
    members = {name for name in vars(Host) if not name.startswith("_")}
    return members | set(Host.__annotations__)


def test_every_name_the_modules_use_is_the_strategys() -> None:
    strategy = PipeDreamStrategy(balance=[1, 1])
    lightning_set_later = {"lightning_module", "optimizers"}  # properties over what setup sets
    missing = sorted(
        name
        for name in declared() - lightning_set_later
        if not hasattr(PipeDreamStrategy, name) and name not in vars(strategy)
    )
    assert missing == []
    assert all(hasattr(PipeDreamStrategy, name) for name in lightning_set_later)


def test_the_modules_take_the_host_not_any() -> None:
    from pl_pipedream.strategy import replanning, setup

    for module in (setup, replanning):
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == module.__name__ and "strategy" in function.__annotations__:
                assert function.__annotations__["strategy"] == "Host", name

"""pl-pipedream: PipeDream pipeline-parallel training as a PyTorch Lightning strategy.

``import pl_pipedream`` makes ``Trainer(strategy="pipedream")`` and ``Fabric(strategy="pipedream")``
work. Importing Lightning takes seconds, so this package registers each front end the moment
``lightning.pytorch`` or ``lightning.fabric`` is (or already was) imported, rather than importing
Lightning itself: ``pl-pipedream plan`` stays fast.
The pure layers (profiles, planner, schedules) import neither torch nor Lightning.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

from pl_pipedream.planner.optimize import plan
from pl_pipedream.planner.plan import Plan, Stage
from pl_pipedream.planner.topology import Level, Topology
from pl_pipedream.profile.graph import Profile

__version__ = "0.1.0"

__all__ = [
    "Level",
    "PipeDreamStrategy",
    "Pipeline",
    "Plan",
    "Pretrained",
    "Profile",
    "Stage",
    "Topology",
    "__version__",
    "consolidate_checkpoint",
    "empty_build",
    "plan",
]

# Each Lightning package, and the front end that registers itself in it on import.
_FRONT_ENDS = {
    "lightning.pytorch": "pl_pipedream.strategy",
    "lightning.fabric": "pl_pipedream.fabric",
}


def _register(front_end: str) -> None:
    if front_end in sys.modules:
        return  # being imported right now: the package registers itself when it is done
    importlib.import_module(front_end)  # registers on import


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Registers a front end right after its Lightning package finishes importing."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _FRONT_ENDS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            if self in sys.meta_path and all(n in sys.modules for n in _FRONT_ENDS):
                sys.meta_path.remove(self)
            _register(_FRONT_ENDS[name])

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _install() -> None:
    """Register each front end whose Lightning package is imported; wait for the others."""
    for package, front_end in _FRONT_ENDS.items():
        if package in sys.modules:
            _register(front_end)
    if not all(name in sys.modules for name in _FRONT_ENDS) and not any(
        isinstance(f, _RegisterWhenLightningLoads) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _RegisterWhenLightningLoads())


_install()


def __getattr__(name: str) -> Any:
    if name == "Pipeline":
        from pl_pipedream.engine import Pipeline

        return Pipeline
    if name == "Pretrained":
        from pl_pipedream.core.pretrained import Pretrained

        return Pretrained
    if name == "empty_build":
        from pl_pipedream.core.materialize import empty_build

        return empty_build
    if name in ("PipeDreamStrategy", "consolidate_checkpoint"):
        import pl_pipedream.strategy as strategy

        return getattr(strategy, name)
    raise AttributeError(f"module 'pl_pipedream' has no attribute {name!r}")

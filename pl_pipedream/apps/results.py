"""``results.json``: what a run of ``pl-pipedream-train`` was and what it gave.

Rank 0 writes it into the run's output directory at the end of ``train``: the composed config,
the seed, the final metrics, the plan, the wall time, the versions and the git commit of the
package's checkout, so that a run can be compared with another or repeated.
"""

from __future__ import annotations

import json
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["write_results"]


def write_results(
    cfg: DictConfig, metrics: Mapping[str, float], plan: Any, wall_time: float
) -> Path:
    """Write ``results.json`` into ``cfg.output_dir``: what a run was and what it gave.

    The composed config (resolved, smoke settings merged), the seed, the final metrics, the plan
    (stages and layers per stage, and the whole plan as the strategy made it), the wall time of
    ``train`` in seconds, the versions of Python, torch, Lightning and this package, and the git
    commit of the package's checkout (null when it is not one).
    """
    import lightning
    import torch

    import pl_pipedream

    summary = None
    if plan is not None:
        summary = {
            "stages": plan.num_stages,
            "balance": [len(stage.nodes) for stage in plan.stages],
            "replicas": [stage.replicas for stage in plan.stages],
            "shape": plan.shape,
            "full": plan.to_dict(),
        }
    results = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "seed": cfg.get("seed"),
        "metrics": dict(metrics),
        "plan": summary,
        "wall_time_s": wall_time,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "pl_pipedream": pl_pipedream.__version__,
        },
        "git_commit": _git_commit(Path(pl_pipedream.__file__).resolve().parent),
    }
    path = Path(cfg.output_dir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return path


def _git_commit(folder: Path) -> str | None:
    """The commit checked out where the package ``folder`` lives, or None when git does not
    track the package there.

    A package installed into a virtual environment inside a clone (``.venv/lib/.../site-packages``)
    lies in that clone's working tree too, yet its code is whatever ``pip install`` copied, which
    ``HEAD`` does not describe: only a package file git tracks is.
    """
    if _git(folder, "ls-files", "--error-unmatch", "--", "__init__.py") is None:
        return None
    commit = _git(folder, "rev-parse", "HEAD")
    return commit if commit is not None and len(commit) == 40 else None


def _git(folder: Path, *arguments: str) -> str | None:
    """``git -C folder arguments``'s output, or None when git fails or is missing."""
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *arguments],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None

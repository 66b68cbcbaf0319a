"""``results.json``: the config, seed, metrics, plan, versions and the checkout's commit."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import lightning
import pytest
import torch

from pl_pipedream.apps.results import _git_commit, write_results
from pl_pipedream.planner.plan import Plan
from tests.apps.test_train import REPO, composed


def test_results_file_holds_config_seed_metrics_plan_versions_and_commit(tmp_path: Path) -> None:
    cfg = composed("seed=7", "model=vgg16", output_dir=str(tmp_path))
    plan = Plan.from_balance([3, 2])
    path = write_results(cfg, {"val_loss": 0.5, "train_loss": 0.25}, plan, 12.5)
    assert path == tmp_path / "results.json"
    results = json.loads(path.read_text())
    assert results["config"]["strategy"]["timeline"] == f"{tmp_path}/timeline.json"  # resolved
    assert results["config"]["model"]["_target_"] == "pl_pipedream.models.VGG16"
    assert results["seed"] == 7
    assert results["metrics"] == {"val_loss": 0.5, "train_loss": 0.25}
    assert (results["plan"]["stages"], results["plan"]["balance"]) == (2, [3, 2])
    assert results["plan"]["full"] == json.loads(plan.to_json())
    assert results["wall_time_s"] == 12.5
    assert results["versions"]["torch"] == torch.__version__
    assert results["versions"]["lightning"] == lightning.__version__
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert results["git_commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert _git_commit(tmp_path) is None  # not a checkout


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_is_recorded_only_for_the_checkouts_own_package(tmp_path: Path) -> None:
    """A clone with the package installed into its own .venv: the installed copy lies inside
    the clone's working tree, yet HEAD does not describe it."""
    clone = tmp_path / "clone"
    installed = clone / ".venv" / "lib" / "python3" / "site-packages" / "pl_pipedream"
    for package in (clone / "pl_pipedream", installed):
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
    (clone / ".gitignore").write_text(".venv/\n")
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "x"]):
        subprocess.run([*git, *command], check=True, capture_output=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert _git_commit(clone / "pl_pipedream") == head.stdout.strip()
    assert _git_commit(installed) is None
    (clone / "elsewhere").mkdir()
    assert _git_commit(clone / "elsewhere") is None  # no package tracked there

"""The package as installed: its console entry points, the extras, and CI's type check.

``setup.cfg`` names ``pl_pipedream.apps.cli:main`` and ``pl_pipedream.apps.train:main``; the
``plot`` extra holds matplotlib (``reproduce --png`` asks for it by name) and the ``test`` extra
holds what the suite and CI need (matplotlib for the chart, mypy). ``.ci/run`` type-checks the
package with pyproject's ``[tool.mypy]`` after installing it and before the suite.
"""

from __future__ import annotations

import configparser
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return config


def requirement_names(text: str) -> list[str]:
    return [
        line.split(">")[0].split("=")[0].split("<")[0].strip() for line in text.split("\n") if line
    ]


def test_the_console_entry_points_are_the_apps_main_functions() -> None:
    scripts = setup_cfg()["options.entry_points"]["console_scripts"]
    points = dict(line.split(" = ") for line in scripts.strip().splitlines())
    assert points == {
        "pl-pipedream": "pl_pipedream.apps.cli:main",
        "pl-pipedream-train": "pl_pipedream.apps.train:main",
    }
    for target in points.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name))


def test_the_apps_run_as_modules() -> None:
    """``python -m pl_pipedream.apps.cli`` and ``...apps.train`` (how other ranks start)."""
    for module in ("pl_pipedream.apps.cli", "pl_pipedream.apps.train"):
        assert importlib.util.find_spec(module) is not None
        assert (
            'if __name__ == "__main__":' in (REPO / (module.replace(".", "/") + ".py")).read_text()
        )
    done = subprocess.run(
        [sys.executable, "-m", "pl_pipedream.apps.cli", "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0 and "plan" in done.stdout


def test_the_test_extra_has_mypy_and_ci_runs_it_before_the_suite() -> None:
    extras = setup_cfg()["options.extras_require"]
    assert "mypy" in requirement_names(extras["test"])
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    install = lines.index('python -m pip install --quiet ".[test]"')
    mypy = lines.index("python -m mypy pl_pipedream")
    suite = next(n for n, line in enumerate(lines) if line.startswith("python -m pytest"))
    assert install < mypy < suite


@pytest.mark.slow
def test_mypy_finds_no_error_in_the_package() -> None:
    """What ``.ci/run`` checks (about 30 s: mypy reads torch's and Lightning's stubs)."""
    pytest.importorskip("mypy")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "pl_pipedream"],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-4000:]

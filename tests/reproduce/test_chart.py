"""``reproduce.chart``: the PNG, and matplotlib (the ``plot`` extra) asked for by name when absent.

A missing matplotlib is simulated by ``sys.modules["matplotlib"] = None``, which makes
``import matplotlib`` raise ``ImportError`` as it does where the package is not installed.
"""

from __future__ import annotations

import configparser
import sys
from pathlib import Path

import pytest

from pl_pipedream.apps.cli import main
from pl_pipedream.reproduce.chart import bar_chart, require_matplotlib
from pl_pipedream.reproduce.table import ReproduceError

PNG = b"\x89PNG\r\n\x1a\n"
SETUP_CFG = Path(__file__).resolve().parents[2] / "setup.cfg"


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_the_chart_is_a_png(tmp_path) -> None:
    path = tmp_path / "chart.png"
    bar_chart(["a", "b"], {"paper": [2.0, None], "ours": [1.5, 3.0]}, path)
    assert path.read_bytes()[:8] == PNG


def test_without_matplotlib_the_chart_names_the_extra(tmp_path, no_matplotlib) -> None:
    path = tmp_path / "chart.png"
    with pytest.raises(ReproduceError) as caught:
        bar_chart(["a"], {"paper": [2.0]}, path)
    assert str(caught.value) == (
        f"drawing the chart needs matplotlib, which is not installed (--png: {path}); "
        "pip install 'pl-pipedream[plot]', or leave --png out"
    )
    assert not path.exists()
    with pytest.raises(ReproduceError, match=r"pl-pipedream\[plot\]"):
        require_matplotlib(path)


def test_without_matplotlib_reproduce_png_fails_before_planning(
    tmp_path, no_matplotlib, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "table1.png"
    code = main(["reproduce", "vgg16_A_4x4", "--png", str(path), "--cache", str(tmp_path)])
    captured = capsys.readouterr()
    assert (code, captured.out) == (2, "")
    assert captured.err.startswith("pl-pipedream reproduce: error: drawing the chart needs")
    assert "pip install 'pl-pipedream[plot]'" in captured.err
    assert list(tmp_path.iterdir()) == []  # nothing profiled, cached or drawn


def test_without_matplotlib_the_table_alone_still_prints(no_matplotlib, capsys) -> None:
    assert main(["reproduce", "--no-own-profile", "vgg16_A_4x4"]) == 0
    assert "vgg16_A_4x4" in capsys.readouterr().out


def test_matplotlib_is_the_plot_extra_and_the_test_extra_has_it() -> None:
    config = configparser.ConfigParser()
    config.read(SETUP_CFG)

    def names(text: str) -> list[str]:
        return [line.split(">")[0].split("=")[0].strip() for line in text.split("\n") if line]

    assert "matplotlib" not in names(config["options"]["install_requires"])
    extras = config["options.extras_require"]
    assert names(extras["plot"]) == ["matplotlib"]
    assert "matplotlib" in names(extras["test"])

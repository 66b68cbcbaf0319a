"""The reproduction's speedups as grouped bars in a PNG (``pl-pipedream reproduce --png``).

matplotlib is the ``plot`` extra, not a dependency of the package: it is imported only when a
chart is asked for, with the file-only Agg backend, and its absence is a ``ReproduceError`` that
names the extra to install (``require_matplotlib``), raised before any row is planned.
"""

from __future__ import annotations

from pathlib import Path

from pl_pipedream.reproduce.predict import Outcome
from pl_pipedream.reproduce.table import ReproduceError

__all__ = ["bar_chart", "require_matplotlib", "write_png"]

EXTRA = "pip install 'pl-pipedream[plot]'"


def require_matplotlib(path: Path) -> None:
    """matplotlib with the Agg backend, or a ``ReproduceError`` naming the ``plot`` extra."""
    try:
        import matplotlib
    except ImportError:
        raise ReproduceError(
            f"drawing the chart needs matplotlib, which is not installed (--png: {path}); "
            f"{EXTRA}, or leave --png out"
        ) from None
    matplotlib.use("Agg")


def write_png(outcomes: list[Outcome], path: Path) -> None:
    """Grouped bars per row: the paper's speedup, ours from the published and from our profile."""
    paper = [o.row.paper_speedup[0] if o.row.paper_speedup else None for o in outcomes]
    series = {
        "paper (SOSP 2019 Table 1)": paper,
        "predicted, published profile": [o.predicted for o in outcomes],
        "predicted, our profile": [o.own_predicted for o in outcomes],
    }
    bar_chart([o.row.id for o in outcomes], series, path)


def bar_chart(labels: list[str], series: dict[str, list[float | None]], path: Path) -> None:
    """A PNG of grouped bars, one group per label, one bar per series (None: no bar)."""
    require_matplotlib(path)
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.0), dpi=80)
    width = 0.8 / len(series)
    for index, (name, values) in enumerate(series.items()):
        offset = (index - (len(series) - 1) / 2) * width
        axes.bar(
            [x + offset for x in range(len(labels))],
            [0.0 if v is None else v for v in values],
            width,
            label=name,
        )
    axes.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_ylabel("speedup over data parallelism")
    axes.set_title("Table 1: the paper beside the planner (no bar: no figure)")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, format="png")
    pyplot.close(figure)

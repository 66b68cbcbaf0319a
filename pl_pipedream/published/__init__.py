"""The published figures the reproduction plans from: PipeDream's profiles and Table 1's cells.

``profiles/<name>.txt`` are the profiles PipeDream's authors published (their profiler's output,
PipeDream's ``graph.txt`` format; MIT licence in ``profiles/LICENSE.txt``); ``table1.csv`` holds
the cells of the paper's Table 1 (SOSP 2019) that were checked against the paper. They ship as
package data (``setup.cfg``) and are read through ``importlib.resources``, so a clone and an
installed package find them alike. ``pl-pipedream reproduce`` reads them unless ``--table`` or
``--profiles`` names other files. README.md beside this module says where each file comes from.
"""

from __future__ import annotations

from importlib.resources import files
from typing import TYPE_CHECKING

from pl_pipedream.profile.graph import Profile, ProfileError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = ["load_profile", "profile_file", "profile_names", "table1_text"]

_SUFFIX = ".txt"
_LICENSE = "LICENSE.txt"


def _profiles() -> Traversable:
    return files(__name__) / "profiles"


def profile_names() -> list[str]:
    """The published profiles' names (``alexnet``, ``gnmt_large``, ...), sorted."""
    names = (entry.name for entry in _profiles().iterdir())
    return sorted(n[: -len(_SUFFIX)] for n in names if n.endswith(_SUFFIX) and n != _LICENSE)


def profile_file(name: str) -> Traversable:
    """The published profile ``name`` as a package resource (``read_text``, ``as_file``)."""
    if name not in profile_names():
        raise ProfileError(
            f"a published profile must be one PipeDream's authors published (profile: {name}); "
            f"pick from {', '.join(profile_names())}"
        )
    return _profiles() / f"{name}{_SUFFIX}"


def load_profile(name: str) -> Profile:
    """The published profile ``name``, parsed."""
    resource = profile_file(name)
    return Profile.from_graph_txt(resource.read_text(), source=f"{__name__}:profiles/{name}")


def table1_text() -> str:
    """Table 1's checked cells, as CSV (comment lines start with #)."""
    return (files(__name__) / "table1.csv").read_text()

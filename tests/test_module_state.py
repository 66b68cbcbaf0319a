"""No module-level mutable state (STYLE.md): read from the source (AST), over the whole package.

A module may hold constants, dicts and lists among them, but no module-level container that its
code changes (``_CACHE[key] = ...``, ``_SEEN.add(...)``, ``_ITEMS.clear()``) and no ``global``
rebinding: state lives in an object that its owner creates and passes on, so two strategies (or
two tests) in one process never share it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pl_pipedream"
PENDING: frozenset[str] = frozenset()  # modules exempted while being rewritten: none

MUTABLE_CALLS = frozenset(
    {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "bytearray"}
)
MUTATORS = frozenset(
    {"append", "extend", "insert", "pop", "popitem", "clear", "update", "setdefault", "add"}
    | {"discard", "remove", "appendleft", "popleft", "__setitem__", "__delitem__", "sort"}
)


def _is_mutable(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp):
        return True
    if isinstance(value, ast.SetComp):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in MUTABLE_CALLS
    return False


def _module_containers(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _is_mutable(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and _is_mutable(node.value):
            if isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def violations(source: str) -> list[str]:
    """Each change to module-level state in ``source``, as ``line: what``."""
    tree = ast.parse(source)
    containers = _module_containers(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{node.lineno}: global {', '.join(node.names)}")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                if target.value.id in containers:
                    found.append(f"{node.lineno}: {target.value.id}[...] changed")
            if isinstance(node, ast.AugAssign) and isinstance(target, ast.Name):
                if target.id in containers:
                    found.append(f"{node.lineno}: {target.id} changed in place")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in containers
            and node.func.attr in MUTATORS
        ):
            found.append(f"{node.lineno}: {node.func.value.id}.{node.func.attr}(...)")
    return found


def test_no_module_of_the_package_changes_module_level_state() -> None:
    found = {
        str(path.relative_to(PACKAGE)): violations(path.read_text())
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in PENDING
    }
    assert {name: lines for name, lines in found.items() if lines} == {}


@pytest.mark.parametrize(
    "source",
    [
        "_CACHE = {}\ndef get(k):\n    _CACHE[k] = 1",
        "_CACHE: dict[str, int] = {}\ndef get(k):\n    return _CACHE.setdefault(k, 1)",
        "_SEEN = set()\ndef see(x):\n    _SEEN.add(x)",
        "ITEMS = []\ndef f():\n    ITEMS.append(1)",
        "ITEMS = list()\ndef f():\n    ITEMS += [1]",
        "_DONE = False\ndef f():\n    global _DONE\n    _DONE = True",
        "_Q = collections.deque()\ndef f():\n    del _Q[0]",
    ],
)
def test_a_change_to_module_state_is_caught(source: str) -> None:
    assert violations(source) != []


@pytest.mark.parametrize(
    "source",
    [
        "UNITS = {'B': 1}\ndef f(k):\n    return UNITS[k]",
        "class Cache:\n    def __init__(self):\n        self._d = {}\n    def put(self, k):\n"
        "        self._d[k] = 1",
        "def f():\n    seen = set()\n    seen.add(1)\n    return seen",
    ],
)
def test_constants_and_owned_state_are_allowed(source: str) -> None:
    assert violations(source) == []

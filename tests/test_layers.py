"""The package's layering, read from the source (AST): a lower layer never imports a higher one.

Layers, lowest first: trees (the walks over nested tensors) < profile < the data the package ships
(published: the profiles and Table 1 cells; configs: the Hydra configs) < planner < schedule <
runtime < core (what any front end needs, free of Lightning) < engine (the plain PyTorch
``Pipeline``, free of Lightning) < the front ends over it (strategy: Lightning's Trainer; fabric:
Lightning Fabric; accelerate: Hugging Face Accelerate, free of Lightning; none imports another) <
the example models and data modules < reproduce (Table 1 beside the planner) < the apps (apps: cli
and train, hydra_ranks, the package's own ``__init__``). A unit may import itself and any lower
layer; models and data, though on one layer, do not import each other; the apps may import one
another.

Every import counts: at module level, inside functions, under ``TYPE_CHECKING``, absolute
(``import pl_pipedream.x.y``, ``from pl_pipedream.x import y``, ``from pl_pipedream import x``)
and relative (``from ..x import y``, ``from . import x``).

Two more rules ride on the same reading: only the front ends and the Lightning users (models, data,
the apps' train) import Lightning, and the pure layers (planner, schedule, the profile's graph,
the shipped data) and the command-line modules (apps/cli, reproduce but for its profiling)
import neither torch nor Lightning. Last, the
tests mirror the package: ``pl_pipedream/a/b.py`` is tested in ``tests/a/test_b.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "pl_pipedream"
NAME = "pl_pipedream"

# Lowest first; a set is one layer.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"trees"}),
    frozenset({"profile"}),
    frozenset({"published", "configs"}),
    frozenset({"planner"}),
    frozenset({"schedule"}),
    frozenset({"runtime"}),
    frozenset({"core"}),
    frozenset({"engine"}),
    frozenset({"strategy", "fabric", "accelerate"}),
    frozenset({"models", "data"}),
    frozenset({"reproduce"}),
    frozenset({"apps", "hydra_ranks", "__init__"}),
)
APPS = LAYERS[-1]
RANK = {unit: number for number, layer in enumerate(LAYERS) for unit in layer}

LIGHTNING = frozenset({"lightning", "pytorch_lightning", "lightning_fabric"})
TORCH = frozenset({"torch"})
LIGHTNING_USERS = frozenset({"strategy", "fabric", "models", "data", "apps"})
# Of the Lightning users' units, the modules that must not import Lightning all the same.
NOT_LIGHTNING = ("apps/__init__.py", "apps/cli.py", "apps/checkpoint_command.py")
# Modules that must import neither torch nor Lightning (paths relative to the package).
PURE = (
    "planner",
    "schedule",
    "profile/graph.py",
    "profile/alike.py",
    "profile/__init__.py",
    "published",
    "configs",
    "apps/cli.py",
    "apps/checkpoint_command.py",
    "reproduce/__init__.py",
    "reproduce/table.py",
    "reproduce/epochs.py",
    "reproduce/predict.py",
    "reproduce/report.py",
    "reproduce/chart.py",
    "reproduce/command.py",
)


def unit_of(path: Path) -> str:
    """The layer unit a file belongs to: its subpackage, or its module name at the top."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else Path(parts[0]).stem


def dotted_name(path: Path) -> str:
    parts = [NAME, *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every absolute module name ``source`` imports, relative imports resolved.

    ``module`` is the dotted name of the file (``pl_pipedream.runtime.executor``); for a
    package's ``__init__`` pass the package's name and ``is_package=True``. ``from a import b``
    yields both ``a`` and ``a.b`` (``b`` may be a submodule; an extra name is harmless).
    """
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise ValueError(f"relative import beyond the top package in {module}")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module or ""
            found.add(origin)
            found |= {f"{origin}.{alias.name}" for alias in node.names if alias.name != "*"}
    return found


def units_imported(names: set[str]) -> set[str]:
    """The package's units that a set of imported module names reaches."""
    units = set()
    for name in names:
        parts = name.split(".")
        if parts[0] != NAME:
            continue
        if len(parts) == 1:
            units.add("__init__")
        elif parts[1] in RANK:
            units.add(parts[1])
        else:  # a name the package re-exports: ``from pl_pipedream import Plan``
            units.add("__init__")
    return units


def roots_imported(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


def may_import(importer: str, imported: str) -> bool:
    return importer == imported or RANK[imported] < RANK[importer] or importer in APPS


def imports_of(path: Path, source: str | None = None) -> set[str]:
    """``imports`` of a file of the package (``source`` replaces its text when given)."""
    text = path.read_text() if source is None else source
    return imports(text, dotted_name(path), is_package=path.name == "__init__.py")


def layering_violations(path: Path, source: str | None = None) -> list[str]:
    importer = unit_of(path)
    names = imports_of(path, source)
    return sorted(
        f"{path.relative_to(PACKAGE)} ({importer}) imports {imported}"
        for imported in units_imported(names)
        if not may_import(importer, imported)
    )


def python_files() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 40  # the package, not an empty folder
    return files


# ----- the package ------------------------------------------------------------------------------


def test_every_part_of_the_package_is_on_a_layer() -> None:
    units = {unit_of(path) for path in python_files()}
    assert units - set(RANK) == set(), "add the new module or subpackage to LAYERS"
    assert set(RANK) - units == set(), "a unit of LAYERS no longer exists: remove it"


def test_no_layer_imports_a_higher_one() -> None:
    violations = [v for path in python_files() for v in layering_violations(path)]
    assert not violations, "\n".join(violations)


def test_only_the_strategy_and_the_lightning_apps_import_lightning() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): roots_imported(imports_of(path)) & LIGHTNING
        for path in python_files()
        if unit_of(path) not in LIGHTNING_USERS
    }
    assert {f: roots for f, roots in offenders.items() if roots} == {}


@pytest.mark.parametrize("part", PURE)
def test_pure_layers_import_no_torch_or_lightning(part: str) -> None:
    target = PACKAGE / part
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    assert files and all(f.is_file() for f in files)
    offenders = {
        str(f.relative_to(PACKAGE)): roots_imported(imports_of(f)) & (TORCH | LIGHTNING)
        for f in files
    }
    assert {f: roots for f, roots in offenders.items() if roots} == {}


@pytest.mark.parametrize("part", ["core", "engine"])
def test_the_core_and_the_engine_import_no_lightning(part: str) -> None:
    """``core`` is what other front ends reuse, ``engine`` the plain PyTorch front end the
    others sit on: both must stay free of Lightning."""
    files = sorted((PACKAGE / part).rglob("*.py"))
    assert files
    offenders = {
        str(f.relative_to(PACKAGE)): roots_imported(imports_of(f)) & LIGHTNING for f in files
    }
    assert {f: roots for f, roots in offenders.items() if roots} == {}


def test_the_strategy_and_its_core_define_their_errors_in_one_module() -> None:
    """Every exception class of ``strategy`` and ``core`` lives in ``core/errors.py``."""
    elsewhere = []
    for path in [*(PACKAGE / "strategy").rglob("*.py"), *(PACKAGE / "core").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception", "Diverged")))
                for b in node.bases
            ):
                elsewhere.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    errors = PACKAGE / "core" / "errors.py"
    assert [e for e in elsewhere if not e.startswith("core/errors.py")] == []
    assert errors.is_file()


@pytest.mark.parametrize("part", NOT_LIGHTNING)
def test_the_command_line_app_imports_no_lightning(part: str) -> None:
    assert roots_imported(imports_of(PACKAGE / part)) & LIGHTNING == set()


def test_every_module_of_reproduce_but_its_profiling_is_pure() -> None:
    """A new module of ``reproduce`` must be listed in PURE (or be the torch-using profiling)."""
    modules = {str(f.relative_to(PACKAGE)) for f in (PACKAGE / "reproduce").glob("*.py")}
    assert modules - set(PURE) == {"reproduce/profiles.py"}


def test_the_lightning_users_do_import_lightning() -> None:
    """The rule above is not vacuous: the units allowed Lightning are the ones that use it."""
    users = {
        unit_of(path) for path in python_files() if roots_imported(imports_of(path)) & LIGHTNING
    }
    assert users == LIGHTNING_USERS


def test_every_module_has_its_mirrored_test_file() -> None:
    expected = {
        path.relative_to(PACKAGE).with_name(f"test_{path.name}")
        for path in python_files()
        if path.name != "__init__.py"
    }
    missing = sorted(str(t) for t in expected if not (TESTS / t).is_file())
    assert not missing, f"add these test files under tests/: {missing}"
    folders = {TESTS / t.parent for t in expected}
    assert sorted(str(f) for f in folders if not (f / "__init__.py").is_file()) == []


# ----- the checker itself -----------------------------------------------------------------------

RUNTIME_MODULE = PACKAGE / "runtime" / "executor.py"


@pytest.mark.parametrize(
    "line",
    [
        "from pl_pipedream.strategy import stage",
        "from pl_pipedream.core.stage import LocalStage",
        "import pl_pipedream.core.stage",
        "import pl_pipedream.core.stage as stage",
        "from pl_pipedream import strategy",
        "from pl_pipedream import PipeDreamStrategy",
        "import pl_pipedream",
        "from ..strategy import stage",
        "from ..strategy.stage import LocalStage",
        "from .. import strategy",
        "from ..models import MLP",
        "def later():\n    from pl_pipedream.apps.train import train",
        "if TYPE_CHECKING:\n    from pl_pipedream.core.stage import LocalStage",
    ],
)
def test_an_upward_import_in_a_runtime_module_is_caught(line: str) -> None:
    source = RUNTIME_MODULE.read_text() + "\n" + line + "\n"
    assert layering_violations(RUNTIME_MODULE, source) != []
    assert layering_violations(RUNTIME_MODULE) == []


@pytest.mark.parametrize(
    "line",
    [
        "from pl_pipedream.schedule.actions import Action",
        "from ..schedule import modes",
        "from . import stash",
        "from .stash import WeightStash",
        "import pl_pipedream.planner.plan",
        "from ..profile.graph import Profile",
    ],
)
def test_a_downward_or_sibling_import_is_allowed(line: str) -> None:
    source = RUNTIME_MODULE.read_text() + "\n" + line + "\n"
    assert layering_violations(RUNTIME_MODULE, source) == []


def test_the_front_ends_do_not_import_each_other() -> None:
    fabric = PACKAGE / "fabric" / "strategy.py"
    assert layering_violations(fabric, "from pl_pipedream.strategy import PipeDreamStrategy") != []
    assert layering_violations(fabric, "from pl_pipedream.engine import Pipeline") == []
    accelerate = PACKAGE / "accelerate" / "prepare.py"
    assert layering_violations(accelerate, "from pl_pipedream.fabric import strategy") != []
    assert layering_violations(accelerate, "import pl_pipedream.strategy") != []


def test_models_and_data_do_not_import_each_other_but_the_apps_may() -> None:
    model = PACKAGE / "models" / "mlp.py"
    assert layering_violations(model, "from pl_pipedream.data import DigitsDataModule") != []
    assert layering_violations(model, "from pl_pipedream.strategy import PipeDreamStrategy") == []
    app = PACKAGE / "apps" / "train.py"
    assert layering_violations(app, "from pl_pipedream.models import MLP\nfrom . import cli") == []
    assert layering_violations(app, "from pl_pipedream.reproduce.table import read_table") == []
    reproduction = PACKAGE / "reproduce" / "predict.py"
    assert layering_violations(reproduction, "from pl_pipedream.apps import cli") != []
    assert layering_violations(reproduction, "from pl_pipedream.models import MLP") == []
    strategy = PACKAGE / "strategy" / "pipedream.py"
    assert layering_violations(strategy, "from pl_pipedream.data import split") != []


def test_relative_imports_resolve_from_modules_and_packages() -> None:
    assert imports("from ..runtime import x", "pl_pipedream.core.stage") == {
        "pl_pipedream.runtime",
        "pl_pipedream.runtime.x",
    }
    assert imports("from . import x", "pl_pipedream.strategy", is_package=True) == {
        "pl_pipedream.strategy",
        "pl_pipedream.strategy.x",
    }
    assert imports("from .graph import Node", "pl_pipedream.profile", is_package=True) == {
        "pl_pipedream.profile.graph",
        "pl_pipedream.profile.graph.Node",
    }
    assert imports("from .. import planner", "pl_pipedream.apps.cli") == {
        "pl_pipedream",
        "pl_pipedream.planner",
    }
    with pytest.raises(ValueError, match="beyond the top package"):
        imports("from ... import x", "pl_pipedream.hydra_ranks")


def test_lightning_in_a_lower_layer_is_caught() -> None:
    for line in ("import lightning.pytorch as pl", "from lightning_fabric import Fabric"):
        roots = roots_imported(imports(line, "pl_pipedream.runtime.executor"))
        assert roots & LIGHTNING


# ----- cycles between modules -------------------------------------------------------------------


def module_of(name: str, modules: set[str]) -> str | None:
    """The package's module that an imported name refers to: the longest prefix that is one
    (``pl_pipedream.runtime.boundary.flatten`` -> ``pl_pipedream.runtime.boundary``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return None


def module_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules it imports, wherever the import sits
    (module level, inside a function, under ``TYPE_CHECKING``). ``from a import b`` counts as
    an import of ``a.b`` when that is a module, else of ``a``; a package's ``__init__`` that a
    submodule's import passes through is not counted (Python runs it first either way)."""
    files = {dotted_name(path): path for path in python_files()}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        names = imports_of(path)
        resolved = {name: module_of(name, modules) for name in names}
        targets = {
            found
            for name, found in resolved.items()
            if found is not None
            # ``from a import b`` yields ``a`` and ``a.b``: when ``a.b`` is a module, only it.
            and not any(
                other.startswith(name + ".") and resolved[other] != found for other in names
            )
        }
        graph[module] = targets - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycle_between_modules() -> None:
    """Lazy imports included: a cycle hidden inside a function is a cycle all the same."""
    found = cycles(module_graph())
    assert found == [], "import cycles between modules:\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def test_a_cycle_hidden_in_a_function_is_caught() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_module_graph_counts_imports_inside_functions() -> None:
    graph = module_graph()
    assert "pl_pipedream.runtime.boundary" in graph["pl_pipedream.runtime.executor"]
    assert "pl_pipedream.runtime" not in graph["pl_pipedream.runtime.executor"]
    hidden = PACKAGE / "runtime" / "streams.py"
    source = hidden.read_text() + "\ndef later():\n    from pl_pipedream.runtime import channel\n"
    names = imports(source, dotted_name(hidden))
    assert "pl_pipedream.runtime.channel" in names

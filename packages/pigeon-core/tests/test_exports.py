"""Public facades (trio's test_exports style): nothing private leaks, nothing public is lost."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from types import ModuleType

import pytest

import pigeon

REPO = Path(__file__).resolve().parents[3]

#: every public module of the PigeonMQ distributions (the package facades and the public
#: modules beside them); anything else whose name has a ``_part`` is private
PACKAGES = [
    "pigeon.core",
    "pigeon.core.batch",
    "pigeon.core.codecs",
    "pigeon.core.metadata",
    "pigeon.core.paths",
    "pigeon.core.replication",
    "pigeon.core.rpc",
    "pigeon.core.runtime",
    "pigeon.core.testing",
    "pigeon.bookie",
    "pigeon.bookie.testing",
    "pigeon.broker",
    "pigeon.client",
    "pigeon.client.ranges",
]
#: public modules that define their names themselves (no private module behind them)
SELF_CONTAINED = {"pigeon.core.paths", "pigeon.bookie.testing"}


def _private_modules_imported_by(pkg: ModuleType) -> set[str]:
    """The private modules beside a facade (a package's own, or a module's siblings) that
    it imports from."""
    assert pkg.__file__ is not None
    home = pkg.__name__ if hasattr(pkg, "__path__") else pkg.__name__.rpartition(".")[0]
    tree = ast.parse(Path(pkg.__file__).read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            head, _, last = node.module.rpartition(".")
            if head == home and last.startswith("_"):
                out.add(node.module)
    return out


@pytest.fixture(params=PACKAGES)
def package(request: pytest.FixtureRequest) -> ModuleType:
    return importlib.import_module(request.param)


def test_all_names_exist(package: ModuleType) -> None:
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert not missing, f"{package.__name__}.__all__ names missing objects: {missing}"


def test_all_has_no_private_names_or_duplicates(package: ModuleType) -> None:
    private = [name for name in package.__all__ if name.startswith("_")]
    assert not private, f"{package.__name__}.__all__ exports private names: {private}"
    assert len(set(package.__all__)) == len(package.__all__)


def test_star_import_gives_exactly_all(package: ModuleType) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {package.__name__} import *", namespace)
    namespace.pop("__builtins__")
    assert sorted(namespace) == sorted(package.__all__)


@pytest.mark.parametrize("name", [p for p in PACKAGES if p not in SELF_CONTAINED])
def test_public_names_of_private_modules_are_listed(name: str) -> None:
    """Every public class/function the facade imports from its private modules is in
    __all__ (an import added for re-export but forgotten in __all__ is caught)."""
    package = importlib.import_module(name)
    modules = _private_modules_imported_by(package)
    assert modules, f"{package.__name__} re-exports nothing from private modules"
    forgotten = []
    for name, obj in vars(package).items():
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) in modules and name not in package.__all__:
            forgotten.append(name)
    assert not forgotten, f"{package.__name__} imports but does not export {forgotten}"


def test_exported_objects_keep_their_public_name(package: ModuleType) -> None:
    """``pigeon.broker.RangeSet`` really is a class named RangeSet (no stale alias)."""
    for name in package.__all__:
        obj = getattr(package, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__name__ == name, f"{package.__name__}.{name} is {obj.__name__}"


def test_pigeon_is_a_namespace_package() -> None:
    """PEP 420: no distribution ships pigeon/__init__.py, so they install side by side."""
    assert getattr(pigeon, "__file__", None) is None
    assert len(list(pigeon.__path__)) >= 4
    src_dirs = sorted((REPO / "packages").glob("*/src/pigeon"))
    assert len(src_dirs) >= 4
    offenders = [str(d / "__init__.py") for d in src_dirs if (d / "__init__.py").exists()]
    assert not offenders

"""Public facades (trio's test_exports style): nothing private leaks, nothing public is
lost, and no distribution reaches into another one's private modules."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import pigeon

REPO = Path(__file__).resolve().parents[3]

#: the package facades and the public modules beside them whose ``__all__`` is checked
PACKAGES = [
    "pigeon.core",
    "pigeon.core.batch",
    "pigeon.core.codecs",
    "pigeon.core.kafka_records",
    "pigeon.core.metadata",
    "pigeon.core.paths",
    "pigeon.core.replication",
    "pigeon.core.rpc",
    "pigeon.core.runtime",
    "pigeon.core.testing",
    "pigeon.core.testing.fuzz",
    "pigeon.core.testing.servers",
    "pigeon.bookie",
    "pigeon.bookie.testing",
    "pigeon.broker",
    "pigeon.client",
    "pigeon.client.ranges",
    "pigeon.client.schema",
]
#: public modules that define their names themselves (no private module behind them)
SELF_CONTAINED = {"pigeon.core.paths", "pigeon.core.testing.fuzz", "pigeon.bookie.testing"}


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


# -- no distribution imports another one's private modules --------------------------------

#: the source files of every distribution of the monorepo
SOURCES = sorted(REPO.glob("packages/*/src/**/*.py")) + sorted(REPO.glob("plugins/*/src/**/*.py"))


def _module_of(path: Path) -> str:
    """``packages/pigeon-core/src/pigeon/core/_rpc.py`` -> ``pigeon.core._rpc``."""
    parts = list(path.relative_to(REPO).parts)
    parts = parts[parts.index("src") + 1 :]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _distribution(module: str) -> str:
    """``pigeon.<package>`` in the ``pigeon`` namespace, else the top-level name
    (``pigeon_etcd``)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pigeon" else parts[0]


FIRST_PARTY = {_distribution(_module_of(path)) for path in SOURCES}


def _imported(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` of every module imported, and of every name imported from
    a module (``from pigeon.core import _replication`` imports ``pigeon.core._replication``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def cross_private_imports(module: str, source: str) -> list[tuple[int, str]]:
    """The imports in ``source`` (the text of ``module``) of a private module or name
    (a dotted part starting with ``_``) of another PigeonMQ distribution."""
    own = _distribution(module)
    found: dict[int, str] = {}
    for line, name in _imported(ast.parse(source)):
        dist = _distribution(name)
        if dist == own or dist not in FIRST_PARTY:
            continue
        if any(part.startswith("_") for part in name.split(".")):
            found.setdefault(line, name)
    return sorted(found.items())


def test_the_private_import_check_finds_what_it_looks_for() -> None:
    source = (
        "from pigeon.core._rpc import Connection\n"  # found: another distribution's module
        "import pigeon.bookie._metrics\n"  # found
        "from pigeon.core import _replication\n"  # found
        "from pigeon.core.metadata import _check_timeout\n"  # found: a private name
        "from pigeon.broker._ledger import ManagedLedger\n"  # fine: its own
        "from pigeon.core.rpc import Connection\n"  # fine: public
        "from concurrent.futures._base import PENDING\n"  # not a PigeonMQ distribution
        "def f():\n"
        "    from pigeon_etcd._store import EtcdMetadataStore\n"  # found, in a function too
    )
    assert cross_private_imports("pigeon.broker._node", source) == [
        (1, "pigeon.core._rpc"),
        (2, "pigeon.bookie._metrics"),
        (3, "pigeon.core._replication"),
        (4, "pigeon.core.metadata._check_timeout"),
        (9, "pigeon_etcd._store"),
    ]
    assert {"pigeon.core", "pigeon.bookie", "pigeon.spark", "pigeon_etcd"} <= FIRST_PARTY


def test_no_distribution_imports_another_ones_private_modules() -> None:
    """A distribution uses only the public API of the others (``pigeon.core.rpc``, not
    ``pigeon.core._rpc``): their private modules may change in any release."""
    assert len(SOURCES) > 50
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in SOURCES
        for line, name in cross_private_imports(_module_of(path), path.read_text())
    ]
    assert not offenders, "private modules of another distribution imported:\n" + "\n".join(
        offenders
    )


# -- hook specifications cite what exists ------------------------------------------------


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_hookspecs_cite_public_names_that_exist() -> None:
    from pigeon.core import hookspecs

    cited = set(re.findall(r":(?:class|func|mod|data):`~?([\w.]+)`", inspect.getsource(hookspecs)))
    assert {
        "pigeon.core.MetadataStore",
        "pigeon.core.ReplicationPolicy",
        "pigeon.core.Codec",
    } <= cited
    for name in sorted(cited):
        assert not any(part.startswith("_") for part in name.split(".")), name
        _resolve(name)

"""The metadata backends in plugins/ are built on pigeon.core's public API only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
BACKENDS = ["pigeon-zookeeper/src/pigeon_zookeeper", "pigeon-etcd/src/pigeon_etcd"]


def private_core_imports(source: Path) -> list[str]:
    """``pigeon.core`` imports of ``source`` that name a private module or name."""
    found = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules, names = [node.module], [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            modules, names = [alias.name for alias in node.names], []
        else:
            continue
        for module in modules:
            if module.split(".")[:2] == ["pigeon", "core"]:
                private = [p for p in [*module.split("."), *names] if p.startswith("_")]
                if private:
                    found.append(f"{source.name}:{node.lineno}: {module} {private}")
    return found


@pytest.mark.parametrize("package", BACKENDS)
def test_backend_imports_only_public_core_names(package: str) -> None:
    sources = sorted((REPO / "plugins" / package).glob("*.py"))
    assert sources
    assert [hit for source in sources for hit in private_core_imports(source)] == []


def test_the_check_sees_private_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from pigeon.core._plugins import Registry\n"
        "from pigeon.core.metadata import _check\n"
        "import pigeon.core.metadata._store\n"
        "from pigeon.core.metadata import Op\n"
        "from pigeon_zookeeper._plan import Layout\n"
    )
    assert [hit.split(":")[1] for hit in private_core_imports(source)] == ["1", "2", "3"]

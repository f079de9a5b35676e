"""A real ZooKeeper for the whole test session (``integration/servers.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "integration"))

from servers import ZooKeeperServer, zookeeper_server


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    """One ZooKeeper (tickTime 500 ms) on a free port; every test uses its own paths."""
    with zookeeper_server(tmp_path_factory.mktemp("zookeeper")) as server:
        yield server

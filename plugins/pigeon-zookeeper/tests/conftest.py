"""A real ZooKeeper for the whole test session (``pigeon.core.testing.servers``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pigeon.core.testing.servers import ZooKeeperServer, zookeeper_server


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    """One ZooKeeper (tickTime 500 ms) on a free port; every test uses its own paths."""
    with zookeeper_server(tmp_path_factory.mktemp("zookeeper")) as server:
        yield server

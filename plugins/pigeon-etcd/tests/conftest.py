"""A real etcd for the whole test session (``pigeon.core.testing.servers``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pigeon.core.testing.servers import EtcdServer, etcd_server


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd on free ports; every test uses its own paths."""
    with etcd_server(tmp_path_factory.mktemp("etcd")) as server:
        yield server

"""A real etcd for the whole test session (``integration/servers.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "integration"))

from servers import EtcdServer, etcd_server


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd on free ports; every test uses its own paths."""
    with etcd_server(tmp_path_factory.mktemp("etcd")) as server:
        yield server

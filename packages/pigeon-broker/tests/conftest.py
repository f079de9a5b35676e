"""Fixtures shared by the broker's tests.

Helpers imported by name live next to this file: ``standalone_support`` (an in-process
standalone and the real client's flows), ``admin_support`` (a standalone with its admin
server on a background thread) and ``ledger_fakes`` (a ManagedLedger's world in memory).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from admin_support import AdminStandalone

from pigeon.client.trio import Client
from pigeon.core.testing import InProcessStandalone


@pytest.fixture
async def client(pigeon_standalone: InProcessStandalone) -> AsyncIterator[Client]:
    """The real (trio) client, connected to ``pigeon_standalone``."""
    async with Client(pigeon_standalone.url) as client:
        yield client


@pytest.fixture(scope="module")
def admin_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AdminStandalone]:
    """A standalone with its admin server on a background thread, one per test module."""
    server = AdminStandalone(tmp_path_factory.mktemp("admin") / "data").start()
    try:
        yield server
    finally:
        server.stop()

"""Fixtures that run PigeonMQ nodes in the test's own trio run, over an in-memory network.

``pigeon_standalone`` starts the embedded metadata store, a bookie (fsync ``never``) and a
broker, all in-process, wired through :class:`pigeon.core._memnet.MemoryNetwork`; nothing
waits on sockets or disks' fsyncs, so a test that also asks for pytest-trio's
``autojump_clock`` runs ack timeouts, delays, TTLs and retention in virtual time.
``pigeon-broker`` and ``pigeon-bookie`` must be installed to use it.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from pigeon.core._memnet import MemoryNetwork
from pigeon.core.errors import Timeout

__all__ = [
    "InProcessStandalone",
    "drain",
    "in_process_standalone",
    "pigeon_standalone",
    "receive_n",
]


@dataclass
class InProcessStandalone:
    service: Any  # pigeon.broker.BrokerService
    network: MemoryNetwork
    data_dir: Path

    @property
    def url(self) -> str:
        return str(self.service.service_url)


@asynccontextmanager
async def in_process_standalone(
    data_dir: Path, **broker_options: Any
) -> AsyncIterator[InProcessStandalone]:
    """A broker + bookie + embedded metadata store in this trio run, its data under
    ``data_dir``; ``broker_options`` change the broker's test defaults (``BrokerConfig``
    fields, e.g. ``segment_max_entries=2``)."""
    from pigeon.bookie import BookieConfig
    from pigeon.broker import BrokerConfig, run_standalone

    network = MemoryNetwork()
    options = {"http_port": -1, "maintenance_interval_s": 1.0, "cursor_persist_interval_ms": 50}
    broker_config = BrokerConfig(port=0, **(options | broker_options))
    bookie_config = BookieConfig(port=0, fsync="never")
    with network.installed():
        async with trio.open_nursery() as nursery:
            service = await nursery.start(
                functools.partial(run_standalone, data_dir, broker_config, bookie_config)
            )
            yield InProcessStandalone(service, network, data_dir)
            nursery.cancel_scope.cancel()


@pytest.fixture
async def pigeon_standalone(tmp_path: Path) -> AsyncIterator[InProcessStandalone]:
    """A broker + bookie + embedded metadata store in this trio run (see module doc)."""
    async with in_process_standalone(tmp_path / "pigeon") as standalone:
        yield standalone


async def receive_n(consumer: Any, n: int, within: float = 30.0) -> list[Any]:
    """Exactly ``n`` messages from a consumer of the trio client, received within
    ``within`` (virtual) seconds."""
    out: list[Any] = []
    with trio.move_on_after(within):
        while len(out) < n:
            out.extend(await consumer.batch_receive(n - len(out)))
    assert len(out) == n, f"received {len(out)} of {n} messages within {within}s"
    return out


async def drain(consumer: Any, idle: float = 2.0) -> list[Any]:
    """Everything a consumer (or reader) of the trio client receives until nothing came
    for ``idle`` (virtual) seconds."""
    out: list[Any] = []
    while True:
        try:
            out.extend(await consumer.batch_receive(1000, timeout=idle))
        except Timeout:
            return out

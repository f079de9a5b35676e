"""Fixtures of the bookie tests: an in-memory metadata store for MockClock tests."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from pigeon.core.errors import MetadataError, NodeExists, NoSuchNode, SessionExpired
from pigeon.core.metadata import Stat


class MemoryMetadataStore:
    """The part of :class:`pigeon.core.metadata.MetadataStore` a bookie uses, in memory,
    with no threads and no timers: safe under ``MockClock(autojump_threshold=0)`` (the
    embedded store's keepalives and worker threads are not)."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[bytes, int, bool]] = {}
        self.alive = True
        self.sessions = 1
        self.fail: BaseException | None = None  #: raised by every call while set
        self._expired = trio.Event()

    def _check(self) -> None:
        if self.fail is not None:
            raise self.fail

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def get(self, path: str) -> Stat | None:
        await trio.lowlevel.checkpoint()
        self._check()
        node = self.nodes.get(path)
        if node is None:
            return None
        return Stat(node[0], node[1], node[2])

    async def exists(self, path: str) -> bool:
        return await self.get(path) is not None

    async def create(self, path: str, value: bytes = b"", *, ephemeral: bool = False) -> str:
        await trio.lowlevel.checkpoint()
        self._check()
        if path in self.nodes:
            raise NodeExists(path)
        if ephemeral and not self.alive:
            raise SessionExpired("session expired")
        parent = path.rsplit("/", 1)[0]
        while parent and parent not in self.nodes:
            self.nodes[parent] = (b"", 0, False)
            parent = parent.rsplit("/", 1)[0]
        self.nodes[path] = (value, 0, ephemeral)
        return path

    async def set(self, path: str, value: bytes, *, version: int | None = None) -> int:
        await trio.lowlevel.checkpoint()
        self._check()
        node = self.nodes.get(path)
        if node is None:
            raise NoSuchNode(path)
        self.nodes[path] = (value, node[1] + 1, node[2])
        return node[1] + 1

    async def delete(self, path: str, *, version: int | None = None) -> None:
        await trio.lowlevel.checkpoint()
        self._check()
        if self.nodes.pop(path, None) is None:
            raise NoSuchNode(path)

    async def children(self, path: str) -> list[str]:
        await trio.lowlevel.checkpoint()
        prefix = path.rstrip("/") + "/"
        names = (p[len(prefix) :] for p in self.nodes if p.startswith(prefix))
        return sorted(name for name in names if "/" not in name)

    def expire_session(self) -> None:
        """As if the session had timed out: ephemeral nodes go, creates fail."""
        self.alive = False
        for path in [p for p, n in self.nodes.items() if n[2]]:
            del self.nodes[path]
        self._expired.set()

    async def wait_session_expired(self) -> None:
        await self._expired.wait()

    async def new_session(self) -> None:
        await trio.lowlevel.checkpoint()
        if self.fail is not None:
            raise MetadataError("down")
        self.alive = True
        self.sessions += 1
        self._expired = trio.Event()


@pytest.fixture
def memory_metadata() -> MemoryMetadataStore:
    return MemoryMetadataStore()

"""kazoo bridged into trio, for :class:`~pigeon_zookeeper.ZooKeeperMetadataStore`.

kazoo runs a connection thread and a completion thread.  Every request is sent with a
kazoo ``*_async`` call from the trio thread (it only queues the request) and its
``IAsyncResult`` is linked back with the trio token (``_soon``), so no worker thread
waits on ZooKeeper.  Calls wait (bounded by ``request_timeout``) for a connection; kazoo
errors come back as they are, and :meth:`KazooBridge._error` turns them into PigeonMQ's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio
from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadArgumentsError,
    ConnectionLoss,
    KazooException,
    RolledBackError,
    SessionExpiredError,
)

from pigeon.core.errors import InvalidArgument, MetadataError, PigeonError
from pigeon.core.metadata import StoreLifecycle

__all__ = ["KazooBridge", "Outcome", "first_error", "stop_quietly"]

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    ok: bool
    results: list[Any]
    index: int = -1
    error: BaseException | None = None


def first_error(results: list[Any]) -> tuple[int, BaseException]:
    for i, result in enumerate(results):
        if isinstance(result, BaseException) and not isinstance(result, RolledBackError):
            return i, result
    for i, result in enumerate(results):  # only rollbacks: report the first
        if isinstance(result, BaseException):
            return i, result
    return -1, MetadataError("multi failed without an error")


class KazooBridge(StoreLifecycle):
    """Requests to ZooKeeper from the trio thread, through the store's kazoo client."""

    hosts: str
    request_timeout: float
    _zk: KazooClient | None
    _connected: bool
    _state_changed: trio.Event

    async def _await(self, result: Any) -> Any:
        done = trio.Event()
        result.rawlink(lambda _: self._soon(done.set))
        await done.wait()
        return result.get_nowait()

    def _require(self) -> KazooClient:
        if self._zk is None:
            raise MetadataError(f"{self!r} is not running")
        return self._zk

    async def _wait_connected(self) -> KazooClient:
        self._require()
        with trio.move_on_after(self.request_timeout):
            while not self._connected:
                await self._state_changed.wait()
            return self._require()
        raise MetadataError(
            f"not connected to ZooKeeper at {self.hosts} for {self.request_timeout}s"
        )

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``zk.<method>_async(*args)`` once connected; kazoo errors as they are."""
        zk = await self._wait_connected()
        result = getattr(zk, method + "_async")(*args, **kwargs)
        with trio.move_on_after(self.request_timeout):
            return await self._await(result)
        raise MetadataError(f"ZooKeeper did not answer {method} in {self.request_timeout}s")

    async def _gather(self, calls: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Send several requests at once (pipelined); results or exceptions, in order."""
        zk = await self._wait_connected()
        pending = [getattr(zk, method + "_async")(*args) for method, args in calls]
        out: list[Any] = []
        with trio.move_on_after(self.request_timeout):
            for result in pending:
                try:
                    out.append(await self._await(result))
                except KazooException as exc:
                    out.append(exc)
            return out
        raise MetadataError(f"ZooKeeper did not answer in {self.request_timeout}s")

    async def _gather_reads(self, calls: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """:meth:`_gather` for read-only calls, repeated when the connection drops between
        the connected check and the answer (a server going away), within the timeout."""
        with trio.move_on_after(self.request_timeout):
            while True:
                results = await self._gather(calls)
                if not any(isinstance(r, ConnectionLoss) for r in results):
                    return results
                await trio.sleep(0.1)  # _gather waits for the reconnection
        raise MetadataError(f"ZooKeeper connection lost for {self.request_timeout}s")

    @staticmethod
    def _error(exc: BaseException, what: str) -> PigeonError:
        if isinstance(exc, PigeonError):
            return exc
        if isinstance(exc, BadArgumentsError):
            return InvalidArgument(f"{what}: ZooKeeper refused the path ({exc!r})")
        if isinstance(exc, SessionExpiredError):
            return MetadataError(f"{what}: the ZooKeeper session expired during the request")
        return MetadataError(f"{what}: {type(exc).__name__} {exc}".rstrip())


def stop_quietly(client: KazooClient) -> None:
    try:
        client.stop()
    except Exception as exc:  # stopping a client that never connected, or twice
        log.debug("stopping a kazoo client: %r", exc)
    try:
        client.close()
    except Exception as exc:
        log.debug("closing a kazoo client: %r", exc)

"""An in-memory network for tests: every node of a cluster in one trio run, no sockets.

While a :class:`MemoryNetwork` is installed (``with MemoryNetwork().installed():``),
:func:`pigeon.core._rpc.serve_tcp` registers listeners here instead of opening sockets and
:func:`pigeon.core._rpc.connect_tcp` connects through ``trio.testing`` memory streams.  Nothing
then waits on the operating system, so trio's ``MockClock(autojump_threshold=0)`` can
drive timeouts, delays and retention in virtual time.

:meth:`MemoryNetwork.pause` freezes a node as SIGSTOP would, seen from its peers: its
connections stay open, but nothing reaches it and nothing comes back (nor does a new
connection's first exchange) until :meth:`MemoryNetwork.resume`.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
from collections.abc import Awaitable, Callable, Iterator

import trio
import trio.testing

__all__ = ["MemoryNetwork", "active_network"]

Handler = Callable[[trio.abc.Stream], Awaitable[None]]

_active: MemoryNetwork | None = None


def active_network() -> MemoryNetwork | None:
    return _active


class MemoryNetwork:
    def __init__(self) -> None:
        self._listeners: dict[tuple[str, int], tuple[Handler, trio.Nursery]] = {}
        self._ports = itertools.count(20000)
        self._paused: dict[tuple[str, int], trio.Event] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[MemoryNetwork]:
        global _active
        previous, _active = _active, self
        try:
            yield self
        finally:
            _active = previous

    def listen(
        self, host: str, port: int, handler: Handler, nursery: trio.Nursery
    ) -> tuple[str, int]:
        if port == 0:
            port = next(self._ports)
            while (host, port) in self._listeners:
                port = next(self._ports)
        if (host, port) in self._listeners:
            raise OSError(errno.EADDRINUSE, f"address {host}:{port} already in use")
        self._listeners[(host, port)] = (handler, nursery)
        return host, port

    def unlisten(self, host: str, port: int) -> None:
        self._listeners.pop((host, port), None)

    def pause(self, host: str, port: int) -> None:
        """Freeze the node at ``host:port`` (see the module doc)."""
        self._paused.setdefault((host, port), trio.Event())

    def resume(self, host: str, port: int) -> None:
        event = self._paused.pop((host, port), None)
        if event is not None:
            event.set()

    async def wait_running(self, address: tuple[str, int]) -> None:
        event = self._paused.get(address)
        if event is not None:
            await event.wait()

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        await trio.lowlevel.checkpoint()
        entry = self._listeners.get((host, port))
        if entry is None:
            raise OSError(errno.ECONNREFUSED, f"connection to {host}:{port} refused")
        handler, nursery = entry
        client, server = trio.testing.memory_stream_pair()
        nursery.start_soon(handler, server)
        return _Pausable(client, self, (host, port))


class _Pausable(trio.abc.Stream):
    """A client's end of a memory connection that stalls while its server is paused."""

    def __init__(self, inner: trio.abc.Stream, net: MemoryNetwork, address: tuple[str, int]):
        self._inner = inner
        self._net = net
        self._address = address

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._net.wait_running(self._address)
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self._inner.receive_some(max_bytes)
        await self._net.wait_running(self._address)
        return data

    async def send_eof(self) -> None:
        await self._inner.send_eof()  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        await self._inner.aclose()

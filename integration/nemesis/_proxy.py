"""TCP proxies that the nemesis can black-hole: one trio thread in the test process.

A :class:`Proxy` listens on a free loopback port and forwards every connection to one
upstream port.  :meth:`Proxy.block` stops forwarding in both directions *without closing
anything*: bytes already read wait, nothing more is read (so the kernel buffers fill and
the peers' writes stall), and new connections are accepted but not connected upstream
until :meth:`Proxy.heal`.  That is what a partition looks like to both ends: a link that
hangs, not one that fails fast.  Healing resumes the same connections, like TCP
retransmission after a short partition.

All proxies of a :class:`ProxyHub` run in one trio run on one daemon thread; the
methods of both classes may be called from any other thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

__all__ = ["Proxy", "ProxyHub", "ProxyStats"]

HOST = "127.0.0.1"
CHUNK = 65536
#: Longest wait for the upstream connect (the node may be down: the client sees a close).
CONNECT_TIMEOUT = 5.0


@dataclass(frozen=True)
class ProxyStats:
    name: str
    port: int
    upstream: int
    connections: int
    bytes_forwarded: int
    blocked: bool


class Proxy:
    """``127.0.0.1:port`` forwarding to ``127.0.0.1:upstream`` until blocked."""

    def __init__(self, hub: ProxyHub, name: str, upstream: int) -> None:
        self.hub = hub
        self.name = name
        self.upstream = upstream
        self.port = 0
        self.connections = 0
        self.bytes_forwarded = 0
        self._open = trio.Event()
        self._open.set()

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def blocked(self) -> bool:
        return not self._open.is_set()

    def block(self) -> None:
        """Black-hole the link: nothing more crosses until :meth:`heal`."""
        self.hub.run_sync(self._block)

    def heal(self) -> None:
        self.hub.run_sync(self._open.set)

    def statistics(self) -> ProxyStats:
        return ProxyStats(
            self.name,
            self.port,
            self.upstream,
            self.connections,
            self.bytes_forwarded,
            self.blocked,
        )

    def _block(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    async def _gate(self) -> None:
        while not self._open.is_set():
            await self._open.wait()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        self.port = int(listeners[0].socket.getsockname()[1])
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        async with client:
            await self._gate()  # a new connection hangs while the link is cut
            try:
                with trio.fail_after(CONNECT_TIMEOUT):
                    upstream = await trio.open_tcp_stream(HOST, self.upstream)
            except (OSError, trio.TooSlowError):
                return  # the node is down: the client sees the connection close
            async with upstream, trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, client, upstream, nursery.cancel_scope)
                nursery.start_soon(self._pump, upstream, client, nursery.cancel_scope)

    async def _pump(
        self, src: trio.SocketStream, dst: trio.SocketStream, both: trio.CancelScope
    ) -> None:
        try:
            while True:
                await self._gate()
                data = await src.receive_some(CHUNK)
                if not data:
                    return
                await self._gate()
                await dst.send_all(data)
                self.bytes_forwarded += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return
        finally:
            both.cancel()  # one side closed: close the other too


class ProxyHub:
    """Runs proxies on a background trio thread; start with ``with ProxyHub() as hub``."""

    def __init__(self) -> None:
        self.proxies: dict[str, Proxy] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="nemesis-proxies", daemon=True)
        self._error: BaseException | None = None

    def __enter__(self) -> ProxyHub:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("proxy thread did not start")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._started.set()
                await trio.sleep_forever()

        try:
            trio.run(main)
        except BaseException as exc:  # reported to __enter__ if it happens at start
            self._error = exc
        finally:
            self._started.set()

    def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def add(self, name: str, upstream: int) -> Proxy:
        """A new proxy named ``name`` in front of ``127.0.0.1:upstream``, already serving."""
        proxy = Proxy(self, name, upstream)

        async def start() -> None:
            assert self._nursery is not None
            await self._nursery.start(proxy.serve)

        trio.from_thread.run(start, trio_token=self._token)
        self.proxies[name] = proxy
        return proxy

    def heal_all(self) -> None:
        for proxy in self.proxies.values():
            proxy.heal()

    def close(self) -> None:
        if self._nursery is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                self.run_sync(self._nursery.cancel_scope.cancel)
        self._thread.join(10)

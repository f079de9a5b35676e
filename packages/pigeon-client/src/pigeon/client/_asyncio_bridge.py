"""How the asyncio face runs coroutines on the engine's thread and awaits them.

An engine operation (lookup, subscribe, seek, flush, close, ...) is an :class:`EngineCall`:
a task started in the engine's nursery with ``run_sync_soon`` whose outcome comes back
through ``loop.call_soon_threadsafe`` into an asyncio future.  Cancelling the awaiting
asyncio task cancels the engine task (shielded calls excepted: they run to completion), and
``orphan`` disposes of a result that arrives for a task no longer waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from pigeon.client._thread import EngineThread
from pigeon.core.errors import AlreadyClosed

__all__ = ["EngineCall", "run_on_engine", "spawn_on_engine"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class EngineCall:
    """One coroutine run in the engine's nursery for an awaiting asyncio task.

    Its state changes (started, abandoned, finished) all happen on the engine's thread, so
    they need no lock; the asyncio future is only touched on the loop's thread.
    """

    thread: EngineThread
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future[Any]
    afn: Callable[..., Awaitable[Any]]
    args: tuple[Any, ...]
    shield: bool
    orphan: Callable[[Any], None] | None
    abandoned: bool = False
    scope: trio.CancelScope | None = None

    # -- engine thread -----------------------------------------------------------------

    def start(self) -> None:
        try:
            self.thread.engine.nursery.start_soon(self._task)
        except RuntimeError:  # the engine's nursery is closed: the client was closed
            self._post(None, AlreadyClosed("client is closed"))

    async def _task(self) -> None:
        posted = False
        try:
            if self.abandoned and not self.shield:
                return
            with trio.CancelScope() as self.scope:
                try:
                    result = await self.afn(*self.args)
                except Exception as exc:
                    self._post(None, exc)
                    posted = True
                    return
                self._post(result, None)
                posted = True
        finally:
            if not posted and not self.abandoned:
                # cancelled from outside: the engine is shutting down
                self._post(None, AlreadyClosed("client is closed"))

    def abandon(self) -> None:
        """The asyncio task stopped waiting (it was cancelled)."""
        self.abandoned = True
        if self.scope is not None and not self.shield:
            self.scope.cancel()

    def _post(self, result: Any, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits
            self.loop.call_soon_threadsafe(self._resolve, result, error)

    # -- loop thread -------------------------------------------------------------------

    def _resolve(self, result: Any, error: BaseException | None) -> None:
        fut = self.fut
        if fut.cancelled():
            if error is None and self.orphan is not None:
                self.orphan(result)
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


async def run_on_engine(
    thread: EngineThread,
    afn: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
    *,
    shield: bool = False,
    orphan: Callable[[Any], None] | None = None,
) -> Any:
    """Await ``afn(*args)`` run as a task of the engine's nursery (see the module)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    call = EngineCall(thread, loop, fut, afn, args, shield, orphan)
    thread.soon(call.start)
    try:
        return await fut
    except asyncio.CancelledError:
        if fut.done() and not fut.cancelled():
            # the outcome arrived, but the task was cancelled before it resumed
            if fut.exception() is None and orphan is not None:
                orphan(fut.result())
        else:
            with contextlib.suppress(AlreadyClosed):
                thread.soon(call.abandon)
        raise


def spawn_on_engine(thread: EngineThread, afn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Fire and forget: run ``afn(*args)`` in the engine's nursery, errors logged."""

    async def run() -> None:
        try:
            await afn(*args)
        except Exception:
            log.exception("background operation %s failed", getattr(afn, "__name__", afn))

    def start() -> None:
        with contextlib.suppress(RuntimeError):
            thread.engine.nursery.start_soon(run)

    with contextlib.suppress(AlreadyClosed):
        thread.soon(start)

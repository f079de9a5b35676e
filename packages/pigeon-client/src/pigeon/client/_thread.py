"""One client engine running in a background thread: what the sync and asyncio faces share.

The trio face runs its :class:`~pigeon.client._engine.ClientEngine` in the caller's own
trio run; the other two faces each start one :class:`EngineThread`, which runs the engine
in a ``trio.run`` of its own and offers the ways to reach it from other threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import trio

from pigeon.client._engine import ClientEngine
from pigeon.core.errors import AlreadyClosed

__all__ = ["EngineThread"]


class EngineThread:
    """A :class:`ClientEngine` run by a daemon thread named ``pigeon-client``.

    The constructor returns once the engine runs (or raises what stopped it from
    starting).  ``closed`` is set by the face once the engine was closed; from then on
    :meth:`call` raises AlreadyClosed.
    """

    def __init__(self, engine: ClientEngine) -> None:
        self.engine = engine
        self.closed = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="pigeon-client", daemon=True)
        self.thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            # on trio's default clock, so the engine's batching timers sleep on timerfds
            async with trio.open_nursery() as nursery:
                await nursery.start(self.engine.run)
                self._started.set()

        try:
            trio.run(main)
        except BaseException as exc:  # reported to the constructor, or the run simply ended
            self._error = exc
        finally:
            self._started.set()

    def call(self, afn: Callable[..., Any], *args: Any) -> Any:
        """Run ``afn(*args)`` on the engine's thread and block until it returns."""
        if self.closed:
            raise AlreadyClosed("client is closed")
        try:
            return trio.from_thread.run(afn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise AlreadyClosed("client is closed") from None

    def soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the engine's thread soon (never blocks; FIFO order)."""
        assert self._token is not None
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise AlreadyClosed("client is closed") from None

    def now(self) -> float:
        """The engine's trio clock, read from any thread.

        The ack-timeout and nack clocks are the engine's; trio's default clock is
        ``time.perf_counter`` plus a per-run offset, so no thread is crossed.
        """
        return time.perf_counter() + self.engine.clock_offset

    def alive(self) -> bool:
        """Not closed, and the thread still runs (a forked child has no such thread)."""
        return not self.closed and self.thread.is_alive()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (after the engine was closed)."""
        self.thread.join(timeout=timeout)

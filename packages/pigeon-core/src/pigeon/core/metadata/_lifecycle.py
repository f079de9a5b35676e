"""What every metadata store backend does the same around its own I/O.

:class:`StoreLifecycle` is mixed into a :class:`~pigeon.core.metadata.MetadataStore`
(before it in the bases) by the embedded, ZooKeeper and etcd stores.  It owns

* :meth:`~StoreLifecycle.run`: refuse a second run, remember the trio token, ``await
  _open()``, start ``_background()`` tasks in a nursery, report started, and on the way
  out ``await _close()`` shielded from cancellation (``_close`` must tolerate a
  half-finished ``_open``);
* the session state: :attr:`~StoreLifecycle.session_alive`,
  :meth:`~StoreLifecycle.wait_session_expired`, and ``_session_started()`` /
  ``_mark_session_ended()`` for the backend to call;
* ``_statistics(kind, hubs, **extra)``: a :class:`MetadataStoreStatistics` (subclass);
* ``_soon(fn, *args)``: run ``fn`` in the trio thread, callable from the threads of a
  client library (kazoo, gRPC); a no-op once the trio run has finished.

A backend calls ``_init_lifecycle()`` from its ``__init__`` and supplies ``session_id``,
``_running()``, ``_open()``, ``_background()`` and ``_close()``.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from pigeon.core.errors import MetadataError
from pigeon.core.metadata._store import WatchHub

__all__ = ["MetadataStoreStatistics", "StoreLifecycle"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetadataStoreStatistics:
    """What every store's ``statistics()`` says; backends add fields of their own."""

    running: bool
    #: the session's id while it is alive (the embedded store: its last session's)
    session_id: str | None
    session_alive: bool
    watchers: int
    #: events delivered to watchers and not read yet
    buffered_events: int


_Stats = TypeVar("_Stats", bound=MetadataStoreStatistics)


class StoreLifecycle(abc.ABC):
    """The ``run`` skeleton and session state of a metadata store (see the module)."""

    _token: trio.lowlevel.TrioToken | None
    _session_alive: bool
    _session_ended: trio.Event

    def _init_lifecycle(self) -> None:
        self._token = None
        self._session_alive = False
        self._session_ended = trio.Event()
        self._session_ended.set()

    # --- run ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self._running():
            raise MetadataError(f"{self!r} is already running")
        self._token = trio.lowlevel.current_trio_token()
        try:
            await self._open()
            async with trio.open_nursery() as nursery:
                for task in self._background():
                    nursery.start_soon(task)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self._close()

    @abc.abstractmethod
    def _running(self) -> bool:
        """Whether :meth:`run` is under way (opened and not yet closed)."""

    @abc.abstractmethod
    async def _open(self) -> None:
        """Connect or open, and start the first session."""

    @abc.abstractmethod
    def _background(self) -> Sequence[Callable[[], Awaitable[None]]]:
        """The store's background tasks (keepalives, followers), run until it closes."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """End the session if it is alive, fail the watchers, disconnect."""

    def _soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` in the trio thread soon; callable from any thread."""
        token = self._token
        if token is None:
            return
        try:
            token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    def _statistics(self, kind: type[_Stats], hubs: Iterable[WatchHub], **extra: Any) -> _Stats:
        """``kind(...)`` with the common fields filled in (watchers summed over ``hubs``)."""
        stats = [hub.statistics() for hub in hubs]
        return kind(
            running=self._running(),
            session_id=self.session_id,
            session_alive=self._session_alive,
            watchers=sum(s.watchers for s in stats),
            buffered_events=sum(s.buffered_events for s in stats),
            **extra,
        )

    # --- the session -------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def session_id(self) -> str | None:
        """The session's id (its form is the backend's)."""

    @property
    def session_alive(self) -> bool:
        """Whether the store's session is alive (ephemeral creates need it)."""
        return self._session_alive

    def _session_started(self) -> None:
        self._session_alive = True
        self._session_ended = trio.Event()

    def _mark_session_ended(self, reason: str | None = None) -> None:
        """The session is over (logged with ``reason`` if it was alive and one is given)."""
        if reason is not None and self._session_alive:
            log.info("%r: session ended: %s", self, reason)
        self._session_alive = False
        self._session_ended.set()

    async def wait_session_expired(self) -> None:
        await self._session_ended.wait()

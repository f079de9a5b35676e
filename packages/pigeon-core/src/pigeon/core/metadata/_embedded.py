"""The embedded metadata store: one SQLite database in a directory.

For standalone deployments and tests: ``pigeon broker --metadata embedded:///var/pigeon``.
Several processes on one machine may open the same directory (a bookie and a broker);
SQLite's file locking serialises their writes.

The database (``<dir>/metadata.db``) and every transaction on it are in
:mod:`pigeon.core.metadata._sqlite`; this module runs them and serves sessions and
watches.

Threading choice
    Reads run directly on the trio thread, on the store's own connection: in WAL mode a
    reader neither waits for a writer nor touches the disk's sync path.  Writes are
    group-committed by one writer thread with a second connection: callers queue their
    transaction functions, the thread takes everything queued, runs each in a
    ``SAVEPOINT`` (one that raises is rolled back alone) inside one ``BEGIN IMMEDIATE …
    COMMIT`` (``synchronous=FULL``: one WAL fsync per round), then hands the round back
    to the trio thread, which delivers its changes to the watchers and wakes the
    callers.  So the event loop never waits for the disk: when commits ran on it, one
    that queued behind a bookie journal's fsyncs on the same disk held a broker's loop
    140 to 170 ms.  A write has committed durably (it survives ``kill -9`` and power loss)
    when its call returns; a write cancelled before the thread took it is dropped, one
    cancelled later may or may not have committed.  Lock contention with another
    process is never waited for inside SQLite (its busy timeout is 0): ``SQLITE_BUSY``
    is retried after a growing delay, up to ``busy_timeout`` seconds, then
    ``MetadataError``.

    Under a trio ``MockClock`` (tests) writes commit inline on the trio thread instead
    (``commit_thread=False``): while a worker thread works, the run looks idle and the
    mock clock would jump, so timeouts would fire in virtual time that never passed.

Sessions
    ``run()`` inserts a ``sessions`` row and refreshes its wall-clock ``heartbeat``
    every ``session_timeout / 3`` seconds of trio time.  The store expires its own
    session when it finds that more than ``session_timeout`` seconds of trio time went by
    since the last heartbeat (the process was stalled; another process may already have
    removed its ephemeral nodes), when its row is gone (another process judged it
    stale), or when :meth:`EmbeddedMetadataStore.expire_session` is called.  Every
    keepalive also removes other sessions whose heartbeat is older than their timeout,
    with their ephemeral nodes; so does ``run()`` before it reports started, which
    cleans up after a process killed with ``kill -9``.  Wall-clock jumps can expire
    sessions early or late.

Watches
    Events come from the ``changes`` table, read in ``seq`` order: right after each write
    of this store (so its own writes reach its watchers before the call returns) and
    every ``poll_interval`` seconds for writes of other stores/processes.  The table is
    trimmed to the last 30 s (but never below its newest 1000 rows); a store whose
    watchers fall further behind fails them with ``MetadataError`` instead of skipping.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import trio
import trio.testing

from pigeon.core.errors import ConfigError, InvalidArgument, MetadataError, SessionExpired
from pigeon.core.metadata import _sqlite as db
from pigeon.core.metadata._group_commit import (
    BUSY_FIRST_DELAY,
    BUSY_MAX_DELAY,
    GroupCommitter,
    Write,
)
from pigeon.core.metadata._lifecycle import MetadataStoreStatistics, StoreLifecycle
from pigeon.core.metadata._store import (
    DEFAULT_WATCH_BUFFER,
    MetadataStore,
    Op,
    Stat,
    Watcher,
    WatchEvent,
    WatchHub,
    check_timeout,
    check_value,
    validate_create,
    validate_ops,
    validate_path,
)

__all__ = ["EmbeddedMetadataStore", "EmbeddedStoreStatistics"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_PUMP_BATCH = 1000


@dataclass(frozen=True)
class EmbeddedStoreStatistics(MetadataStoreStatistics):
    #: the newest change-log entry the watchers were given
    last_change_seq: int
    #: group commits by the writer thread, and the writes in them (0 when inline)
    commit_rounds: int
    committed_writes: int


class EmbeddedMetadataStore(StoreLifecycle, MetadataStore):
    """:class:`MetadataStore` kept in a local SQLite database.

    :param path: a directory (created if missing; the database is ``metadata.db``
        inside it), or the database file itself if the path ends with ``.db`` or is an
        existing file.
    :param session_timeout: seconds without heartbeat after which a session expires.
    :param poll_interval: how often other processes' changes are looked for, for
        watchers (only while this store has watchers).
    :param watch_buffer: unread events a watcher may hold before it fails.
    :param busy_timeout: how long a read or write waits for another process's lock.
    :param commit_thread: commit writes on a writer thread (see the module); ``None``
        (the default) means yes unless the trio run's clock is a ``MockClock``.
    """

    #: Keep at least this many newest change-log rows, and all of the last
    #: ``_changelog_retention`` seconds (wall clock).
    _changelog_keep_rows = 1000
    _changelog_retention = 30.0

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        session_timeout: float = 10.0,
        poll_interval: float = 0.05,
        watch_buffer: int = DEFAULT_WATCH_BUFFER,
        busy_timeout: float = 30.0,
        commit_thread: bool | None = None,
    ) -> None:
        location = os.fspath(path)
        if not location:
            raise InvalidArgument("embedded metadata store needs a directory")
        if location.endswith(".db") or os.path.isfile(location):
            self.db_path = location
        else:
            self.db_path = os.path.join(location, db.DB_NAME)
        self.session_timeout = check_timeout(session_timeout, "session_timeout")
        self.poll_interval = check_timeout(poll_interval, "poll_interval")
        self.busy_timeout = check_timeout(busy_timeout, "busy_timeout")
        self.watch_buffer = watch_buffer
        self._hub = WatchHub(watch_buffer)
        self._conn: sqlite3.Connection | None = None
        self.commit_thread = commit_thread
        self._committer: GroupCommitter | None = None
        self._last_seq = 0
        self._session_id: str | None = None
        self._init_lifecycle()
        self._last_beat = 0.0

    @classmethod
    def from_url(cls, url: str) -> EmbeddedMetadataStore:
        """Build a store from ``embedded:///abs/dir`` (absolute) or ``embedded://rel/dir``
        / ``embedded:rel/dir`` (relative to the working directory).

        Query options: ``session_timeout``, ``poll_interval``, ``busy_timeout``
        (seconds), e.g. ``embedded:///var/pigeon?session_timeout=5``.
        """
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "embedded":
            raise ConfigError(f"not an embedded metadata URL: {url!r}")
        location = urllib.parse.unquote(parts.netloc + parts.path)
        if not location:
            raise ConfigError(f"metadata URL {url!r} names no directory")
        options: dict[str, float] = {}
        for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
            if key not in ("session_timeout", "poll_interval", "busy_timeout"):
                raise ConfigError(f"metadata URL {url!r}: unknown option {key!r}")
            try:
                options[key] = float(value)
            except ValueError:
                raise ConfigError(f"metadata URL {url!r}: {key} must be a number") from None
        return cls(
            location,
            session_timeout=options.get("session_timeout", 10.0),
            poll_interval=options.get("poll_interval", 0.05),
            busy_timeout=options.get("busy_timeout", 30.0),
        )

    def __repr__(self) -> str:
        return f"<EmbeddedMetadataStore {self.db_path!r} session={self._session_id}>"

    @property
    def session_id(self) -> str | None:
        """Id of the current session (``None`` before the first ``run``)."""
        return self._session_id

    def statistics(self) -> EmbeddedStoreStatistics:
        committer = self._committer
        return self._statistics(
            EmbeddedStoreStatistics,
            [self._hub],
            last_change_seq=self._last_seq,
            commit_rounds=committer.rounds if committer else 0,
            committed_writes=committer.writes if committer else 0,
        )

    # --- lifecycle ----------------------------------------------------------------

    def _running(self) -> bool:
        return self._conn is not None

    async def _open(self) -> None:
        self._conn = db.connect(self.db_path)
        self._hub = WatchHub(self.watch_buffer)
        await self._call(db.configure, self.db_path, write=False)
        threaded = self.commit_thread
        if threaded is None:
            threaded = not isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock)
        if threaded:
            self._committer = GroupCommitter(
                self.db_path, busy_timeout=self.busy_timeout, on_round=self._round_done
            )
        self._last_seq = await self._write(db.create_schema, self.db_path)
        await self.new_session()

    def _background(self) -> Sequence[Callable[[], Awaitable[None]]]:
        return [self._keepalive_loop, self._poll_loop]

    async def _close(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            if self._session_alive and self._session_id is not None:
                await self._write(db.delete_session, self._session_id, time.time())
        except MetadataError as exc:
            log.warning("%r: could not remove the session on close: %s", self, exc)
        finally:
            committer, self._committer = self._committer, None
            if committer is not None:
                await committer.stop()
            self._mark_session_ended("store closed")
            if self._hub:
                self._pump()
            self._hub.fail_all("metadata store closed")
            self._conn = None
            conn.close()

    def _require_conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise MetadataError(f"{self!r} is not running")
        return self._conn

    # --- sessions -------------------------------------------------------------------

    async def new_session(self) -> None:
        old = self._session_id if self._session_alive else None
        new = uuid.uuid4().hex

        def start(conn: sqlite3.Connection) -> None:
            wall = time.time()
            if old is not None:
                db.delete_session(conn, old, wall)
            self._reap(conn, wall, keep=None)
            db.add_session(conn, new, self.session_timeout, wall)

        await self._write(start)
        if old is not None and old == self._session_id:
            self._mark_session_ended("replaced by a new session")
        self._session_id = new
        self._session_started()
        self._last_beat = trio.current_time()
        log.debug("%r: session started", self)

    async def expire_session(self) -> None:
        """Expire the current session now, as if its keepalive had stopped: its
        ephemeral nodes are deleted and :meth:`wait_session_expired` returns.  For tests
        and for forced fail-over."""
        session = self._session_id
        if not self._session_alive or session is None:
            await trio.lowlevel.checkpoint()
            return
        await self._write(db.delete_session, session, time.time())
        if self._session_id == session:
            self._mark_session_ended("expired on request")

    async def _keepalive_loop(self) -> None:
        while True:
            await trio.sleep(self.session_timeout / 3)
            await self._keepalive()

    async def _keepalive(self) -> None:
        """One keepalive: refresh our heartbeat (or find the session dead), remove
        stale sessions of others, trim the change log."""

        now = trio.current_time()
        session = self._session_id if self._session_alive else None
        silent = now - self._last_beat
        stalled = session is not None and silent > self.session_timeout

        def tick(conn: sqlite3.Connection) -> str | None:
            wall = time.time()
            ended: str | None = None
            if session is not None:
                if stalled:
                    ended = f"no keepalive for {silent:.3f}s (timeout {self.session_timeout}s)"
                elif not db.heartbeat(conn, session, wall):
                    ended = "removed by another process as stale"
                if ended is not None:
                    db.delete_session(conn, session, wall)
            self._reap(conn, wall, keep=session)
            db.trim(
                conn,
                wall,
                keep_rows=self._changelog_keep_rows,
                retention=self._changelog_retention,
            )
            return ended

        ended = await self._write(tick)
        if session is None or session != self._session_id or not self._session_alive:
            return
        if ended is None:
            self._last_beat = now
        else:
            self._mark_session_ended(ended)

    def _reap(self, conn: sqlite3.Connection, wall: float, *, keep: str | None) -> None:
        for session in db.reap(conn, wall, keep=keep):
            log.info("%r: removed stale session %s and its ephemeral nodes", self, session)

    # --- database access ------------------------------------------------------------

    async def _write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` in a write transaction, by the writer thread if there
        is one (see the module), and deliver its changes to the watchers."""
        committer = self._committer
        if committer is None:
            return await self._call(fn, *args, write=True)
        self._require_conn()
        write = Write(fn, args)
        committer.submit(write)
        try:
            await write.done.wait()
        except BaseException:
            committer.withdraw(write)
            raise
        if write.error is not None:
            raise write.error
        result: T = write.result
        return result

    def _round_done(self, batch: list[Write]) -> None:
        """A round committed (or failed): watchers first, then its callers."""
        self._pump()
        for write in batch:
            write.done.set()

    async def _call(self, fn: Callable[..., T], *args: Any, write: bool) -> T:
        """Run ``fn(conn, *args)`` on the trio thread, in a ``BEGIN IMMEDIATE``
        transaction if ``write``; retry while another process holds the lock."""
        await trio.lowlevel.checkpoint()
        conn = self._require_conn()
        deadline = trio.current_time() + self.busy_timeout
        delay = BUSY_FIRST_DELAY
        while True:
            try:
                if not write:
                    return fn(conn, *args)
                conn.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(conn, *args)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
                self._pump()
                return result
            except sqlite3.Error as exc:
                if not db.is_busy(exc):
                    raise MetadataError(f"metadata database {self.db_path}: {exc}") from exc
                if trio.current_time() >= deadline:
                    raise MetadataError(
                        f"metadata database {self.db_path} stayed locked for {self.busy_timeout}s"
                    ) from exc
            await trio.sleep(delay)
            delay = min(delay * 2, BUSY_MAX_DELAY)

    # --- watches ---------------------------------------------------------------------

    def _pump(self) -> None:
        """Deliver committed changes newer than ``_last_seq`` to the watchers."""
        conn = self._conn
        if conn is None:
            return
        try:
            if not self._hub:
                self._last_seq = db.max_seq(conn)
                return
            while self._hub:
                rows = db.changes_after(conn, self._last_seq, _PUMP_BATCH)
                if not rows:
                    return
                if rows[0][0] != self._last_seq + 1:
                    log.warning("%r: watchers fell behind the trimmed change log", self)
                    self._hub.fail_all(
                        "metadata watch fell behind the change log; changes were missed"
                    )
                    self._last_seq = db.max_seq(conn)
                    return
                for seq, kind, path, value, version in rows:
                    self._last_seq = seq
                    self._hub.dispatch(WatchEvent(db.EVENT_TYPES[kind], path, value, version))
                if len(rows) < _PUMP_BATCH:
                    return
        except sqlite3.Error as exc:  # the poller tries again
            log.warning("%r: reading the change log failed: %s", self, exc)

    async def _poll_loop(self) -> None:
        while True:
            await trio.sleep(self.poll_interval)
            if self._hub:
                self._pump()

    def watch(
        self, path: str, *, prefix: bool = False
    ) -> AbstractAsyncContextManager[AsyncIterator[WatchEvent]]:
        validate_path(path)
        return self._watch(path, prefix)

    @asynccontextmanager
    async def _watch(self, path: str, prefix: bool) -> AsyncIterator[Watcher]:
        await trio.lowlevel.checkpoint()
        self._require_conn()
        self._pump()  # everything committed so far is before the watch
        watcher = self._hub.subscribe(path, prefix=prefix)
        try:
            yield watcher
        finally:
            self._hub.unsubscribe(watcher)

    # --- reads -----------------------------------------------------------------------

    async def get(self, path: str) -> Stat | None:
        validate_path(path)
        rows = await self._call(db.select_node, path, write=False)
        if not rows:
            return None
        value, version, owner, ctime, mtime = rows[0]
        return Stat(bytes(value), version, owner is not None, ctime, mtime)

    async def children(self, path: str) -> list[str]:
        validate_path(path)
        rows = await self._call(db.select_children, path, write=False)
        start = 1 if path == "/" else len(path) + 1
        return sorted(child[start:] for (child,) in rows)

    # --- writes ----------------------------------------------------------------------

    async def create(
        self, path: str, value: bytes = b"", *, ephemeral: bool = False, sequential: bool = False
    ) -> str:
        value = validate_create(path, value, sequential=sequential)
        if ephemeral and not self._session_alive and self._conn is not None:
            await trio.lowlevel.checkpoint()
            raise SessionExpired("the metadata session expired; call new_session()")
        return await self._write(db.create, path, value, ephemeral, sequential, self._owner())

    async def set(self, path: str, value: bytes, *, version: int | None = None) -> int:
        validate_path(path)
        value = check_value(value)
        return await self._write(db.set_value, path, value, version)

    async def delete(
        self, path: str, *, version: int | None = None, recursive: bool = False
    ) -> None:
        validate_path(path)
        await self._write(db.delete, path, version, recursive)

    async def multi(self, ops: list[Op]) -> list[object]:
        ops = validate_ops(ops)
        if not ops:
            await trio.lowlevel.checkpoint()
            return []
        return await self._write(db.multi, ops, self._owner())

    def _owner(self) -> str | None:
        """The owner of ephemeral nodes created now: the live session, or None."""
        return self._session_id if self._session_alive else None

"""The embedded metadata store's writer thread: queued transactions, group-committed.

:class:`GroupCommitter` owns a second SQLite connection and one thread.  The trio
thread :meth:`~GroupCommitter.submit`\\ s :class:`Write`\\ s; the writer thread takes
everything queued, runs each ``fn(conn, *args)`` in its own ``SAVEPOINT`` inside one
``BEGIN IMMEDIATE … COMMIT`` (so one fsync of the WAL serves the whole round, and a
function that raises is rolled back without its neighbours), then hands the round to
``on_round`` in the trio thread.  ``SQLITE_BUSY`` (another process holds the write lock)
is retried after a growing delay, up to ``busy_timeout`` seconds.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

import trio

from pigeon.core.errors import MetadataError
from pigeon.core.metadata import _sqlite as db

__all__ = ["GroupCommitter", "Write"]

log = logging.getLogger(__name__)

BUSY_FIRST_DELAY = 0.001
BUSY_MAX_DELAY = 0.05


class Write:
    """One queued transaction function and, once its round is over, its outcome."""

    __slots__ = ("args", "done", "error", "fn", "result", "taken")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.done = trio.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        #: the writer thread has taken it (it can no longer be withdrawn)
        self.taken = False


class GroupCommitter:
    """The writer thread of one store (see the module)."""

    def __init__(
        self,
        db_path: str,
        *,
        busy_timeout: float,
        on_round: Callable[[list[Write]], None],
    ) -> None:
        self.db_path = db_path
        self.busy_timeout = busy_timeout
        self._on_round = on_round
        self._token = trio.lowlevel.current_trio_token()
        self._conn = db.connect(db_path, check_same_thread=False)
        self._cond = threading.Condition()
        self._queue: list[Write] = []
        self._stopping = False
        #: rounds committed and transactions in them, for statistics and tests
        self.rounds = 0
        self.writes = 0
        self._thread = threading.Thread(
            target=self._run, name=f"pigeon-metadata-writer {db_path}", daemon=True
        )
        self._thread.start()

    # --- the trio thread ------------------------------------------------------------------

    def submit(self, write: Write) -> None:
        with self._cond:
            if self._stopping:
                raise MetadataError(f"metadata database {self.db_path} is closing or failed")
            self._queue.append(write)
            self._cond.notify()

    def withdraw(self, write: Write) -> bool:
        """Drop ``write`` if the thread has not taken it yet; whether it was dropped."""
        with self._cond:
            if write.taken:
                return False
            self._queue.remove(write)
            return True

    async def stop(self) -> None:
        """Commit what is queued, then end the thread and close its connection."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await trio.to_thread.run_sync(self._thread.join)

    # --- the writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        batch: list[Write] = []
        try:
            db.configure(self._conn, self.db_path)
            while True:
                with self._cond:
                    while not self._queue and not self._stopping:
                        self._cond.wait()
                    if not self._queue:
                        return
                    batch, self._queue = self._queue, []
                    for write in batch:
                        write.taken = True
                self._commit(batch)
                if not self._deliver(batch):
                    return
                batch = []
        except BaseException as exc:
            # A bug, or the database unusable (``configure`` failed): no caller may wait
            # for ever; this round and every later write fail.
            log.exception("metadata writer thread for %s failed", self.db_path)
            with self._cond:
                self._stopping = True
                batch += self._queue
                self._queue = []
                for write in batch:
                    write.taken = True
            self._fail(batch, f"metadata database {self.db_path}: writer failed: {exc!r}")
            self._deliver(batch)
        finally:
            self._conn.close()

    def _deliver(self, batch: list[Write]) -> bool:
        """Hand ``batch`` to the trio thread; False once the trio run is over."""
        try:
            self._token.run_sync_soon(self._on_round, batch)
        except trio.RunFinishedError:
            return False
        return True

    def _commit(self, batch: list[Write]) -> None:
        deadline = time.monotonic() + self.busy_timeout
        delay = BUSY_FIRST_DELAY
        while True:
            try:
                self._round(batch)
            except sqlite3.Error as exc:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                if not db.is_busy(exc):
                    self._fail(batch, f"metadata database {self.db_path}: {exc}")
                    return
                if time.monotonic() >= deadline:
                    self._fail(
                        batch,
                        f"metadata database {self.db_path} stayed locked for {self.busy_timeout}s",
                    )
                    return
                time.sleep(delay)
                delay = min(delay * 2, BUSY_MAX_DELAY)
            else:
                self.rounds += 1
                self.writes += len(batch)
                return

    def _round(self, batch: list[Write]) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        for write in batch:
            write.result = write.error = None
            conn.execute("SAVEPOINT write")
            try:
                write.result = write.fn(conn, *write.args)
            except sqlite3.Error:
                raise  # the database's trouble, not this write's: the whole round
            except Exception as exc:
                conn.execute("ROLLBACK TO write")
                write.error = exc
            conn.execute("RELEASE write")
        conn.execute("COMMIT")

    @staticmethod
    def _fail(batch: list[Write], message: str) -> None:
        for write in batch:
            write.result = None
            write.error = MetadataError(message)

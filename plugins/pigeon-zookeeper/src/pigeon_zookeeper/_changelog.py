"""The change log of the ZooKeeper store: writing entries, following them, trimming.

Every write is one ZooKeeper multi (:meth:`ChangeLog._commit`): a version check on the
bucket pointer, one sequential entry in the current bucket listing the write's events,
and the write's own ops.  A store with watchers follows the log from the position it had
when the first watcher subscribed: it reads entry after entry of the current bucket, and
when it reaches the end it sets one-shot ZooKeeper watches on the next entry and on the
bucket pointer.  Closed buckets are trimmed after ``log_retention`` seconds; a watcher
that still needed one fails.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from kazoo.exceptions import KazooException, NoNodeError

from pigeon.core.errors import CorruptFrame, MetadataError
from pigeon.core.metadata import Watcher, WatchEvent, WatchHub
from pigeon_zookeeper._bridge import KazooBridge, Outcome, first_error
from pigeon_zookeeper._plan import Layout, ZkOp, decode_entry, encode_entry

__all__ = ["ChangeLog"]

log = logging.getLogger(__name__)

_READ_AHEAD_MAX = 32
#: Log entries (or bucket entries being trimmed) deleted per multi.
DELETE_CHUNK = 500
#: Data of a log bucket whose entries are being deleted.
_TRIMMED = b"trimmed"


class ChangeLog(KazooBridge):
    """Writes, follows and trims the store's change log (see the module)."""

    #: Entries per change-log bucket (a new bucket starts when one is full).
    log_bucket_size = 1000
    #: A closed bucket is kept this long (seconds) for slow watchers, then trimmed.
    log_retention = 120.0
    #: How often (seconds, jittered) a store looks for log buckets to trim.
    trim_interval = 30.0

    _layout: Layout
    _hub: WatchHub
    _bucket: int | None
    _bucket_version: int
    _cursor: tuple[int, int] | None
    _cursor_moved: trio.Event
    _follow_wake: trio.Event
    _subscribing: int

    # --- writing ------------------------------------------------------------------------

    async def _refresh_pointer(self) -> None:
        try:
            data, stat = await self._call("get", self._layout.log)
        except KazooException as exc:
            raise self._error(exc, "reading the change-log pointer") from exc
        self._bucket = int(data)
        self._bucket_version = stat.version

    async def _commit(self, ops: list[ZkOp], events: list[WatchEvent]) -> Outcome:
        """One multi: pointer check, log entry, ``ops``.  Results exclude the first two."""
        if self._bucket is None:
            await self._refresh_pointer()
        assert self._bucket is not None
        zk = await self._wait_connected()
        lay = self._layout
        txn = zk.transaction()
        txn.check(lay.log, self._bucket_version)
        txn.create(lay.entry_prefix(self._bucket), encode_entry(events), sequence=True)
        for op in ops:
            if op.kind == "create":
                txn.create(op.path, op.data, ephemeral=op.ephemeral)
            elif op.kind == "set":
                txn.set_data(op.path, op.data, version=op.version)
            elif op.kind == "delete":
                txn.delete(op.path, version=op.version)
            else:
                txn.check(op.path, op.version)
        result = txn.commit_async()
        with trio.move_on_after(self.request_timeout):
            results = await self._await(result)
            if any(isinstance(r, BaseException) for r in results):
                index, error = first_error(results)
                if index < 2:
                    self._bucket = None  # re-read the pointer before the next attempt
                return Outcome(False, [], index - 2, error)
            entry = results[1]
            number = int(entry.rsplit("-", 1)[1])
            if number + 1 >= self.log_bucket_size:
                await self._advance_bucket()
            return Outcome(True, results[2:])
        raise MetadataError(f"ZooKeeper did not answer a write in {self.request_timeout}s")

    async def _advance_bucket(self) -> None:
        bucket = self._bucket
        if bucket is None:
            return
        zk = await self._wait_connected()
        txn = zk.transaction()
        txn.set_data(self._layout.log, str(bucket + 1).encode(), version=self._bucket_version)
        txn.create(self._layout.bucket(bucket + 1), b"")
        try:
            await self._await(txn.commit_async())
        except KazooException as exc:
            log.debug("%r: advancing the log bucket failed: %r", self, exc)
        self._bucket = None

    # --- change log: following ------------------------------------------------------------

    def _wake_follower(self, _event: object = None) -> None:  # kazoo thread
        self._soon(self._follow_wake.set)

    async def _log_end(self) -> tuple[int, int]:
        try:
            data, _ = await self._call("get", self._layout.log)
            bucket = int(data)
            stat = await self._call("exists", self._layout.bucket(bucket))
        except KazooException as exc:
            raise self._error(exc, "reading the change log") from exc
        return bucket, (stat.numChildren if stat is not None else 0)

    def _set_cursor(self, position: tuple[int, int] | None) -> None:
        self._cursor = position
        self._cursor_moved.set()
        self._cursor_moved = trio.Event()

    async def _follow_loop(self) -> None:
        ahead = 1
        failures = 0
        while True:
            if not self._hub and not self._subscribing:
                if self._cursor is not None:
                    self._set_cursor(None)
                self._follow_wake = trio.Event()
                await self._follow_wake.wait()
                continue
            if self._cursor is None:
                await trio.sleep(0.01)  # a subscriber is setting it
                continue
            try:
                ahead = await self._follow_step(ahead)
                failures = 0
            except (MetadataError, KazooException) as exc:
                failures += 1
                log.debug("%r: reading the change log failed: %r", self, exc)
                with trio.move_on_after(min(0.05 * 2**failures, 1.0)):
                    self._follow_wake = trio.Event()
                    await self._follow_wake.wait()

    async def _follow_step(self, ahead: int) -> int:
        """Read what is there; if nothing, wait for a change.  Returns the next read-ahead."""
        assert self._cursor is not None
        bucket, seq = self._cursor
        lay = self._layout
        self._follow_wake = trio.Event()
        results = await self._gather([("get", (lay.entry(bucket, seq + i),)) for i in range(ahead)])
        read = 0
        for result in results:
            if self._cursor != (bucket, seq):
                return 1  # moved under us (reset)
            if isinstance(result, NoNodeError):
                break
            if isinstance(result, BaseException):
                raise result
            data, _ = result
            try:
                events = decode_entry(data)
            except CorruptFrame:
                log.exception("%r: corrupt change-log entry %d/%d", self, bucket, seq)
                self._hub.fail_all(f"metadata change log entry {bucket}/{seq} is corrupt")
                events = []
            for event in events:
                self._hub.dispatch(event)
            seq += 1
            read += 1
            self._set_cursor((bucket, seq))
        if read == ahead:
            return min(ahead * 2, _READ_AHEAD_MAX)
        if read:
            return 1
        # nothing new: watch the next entry and the pointer, then look once more
        entry = lay.entry(bucket, seq)
        if await self._call("exists", entry, watch=self._wake_follower) is not None:
            return 1
        data, _ = await self._call("get", lay.log, watch=self._wake_follower)
        if int(data) > bucket:
            if await self._call("exists", entry) is not None:
                return 1
            try:
                marker, _ = await self._call("get", lay.bucket(bucket))
            except NoNodeError:
                marker = _TRIMMED
            if marker == _TRIMMED:
                self._lost_log(f"change-log bucket {bucket} was trimmed")
                return 1
            self._set_cursor((bucket + 1, 0))
            return 1
        with trio.move_on_after(30.0):  # a lost notification costs at most this much
            await self._follow_wake.wait()
        return 1

    def _lost_log(self, why: str) -> None:
        log.warning("%r: watchers fell behind the change log (%s)", self, why)
        self._hub.fail_all(f"metadata watch fell behind the change log ({why}); events lost")
        self._set_cursor(None)

    @asynccontextmanager
    async def _watch(self, path: str, prefix: bool) -> AsyncIterator[Watcher]:
        await trio.lowlevel.checkpoint()
        self._require()
        self._subscribing += 1
        try:
            target = await self._log_end()
            with trio.move_on_after(self.request_timeout) as scope:
                while self._cursor is not None and self._cursor < target:
                    self._follow_wake.set()
                    await self._cursor_moved.wait()
            if scope.cancelled_caught:
                raise MetadataError("the change log follower did not catch up")
            if self._cursor is None:
                self._set_cursor(target)
            watcher = self._hub.subscribe(path, prefix=prefix)
        finally:
            self._subscribing -= 1
        self._follow_wake.set()
        try:
            yield watcher
        finally:
            self._hub.unsubscribe(watcher)

    # --- trimming the change log ----------------------------------------------------------

    async def _trim_loop(self) -> None:
        while True:
            await trio.sleep(self.trim_interval * random.uniform(0.5, 1.5))
            try:
                await self.trim_log()
            except (MetadataError, KazooException) as exc:
                log.debug("%r: trimming the change log failed: %r", self, exc)

    async def trim_log(self) -> int:
        """Delete change-log buckets closed more than :attr:`log_retention` seconds ago
        (every store does this now and then); return how many were deleted."""
        lay = self._layout
        data, _ = await self._call("get", lay.log)
        current = int(data)
        names = await self._call("get_children", lay.log)
        old = sorted(int(n) for n in names if n.isdigit() and int(n) < current - 1)
        now_ms = time.time() * 1e3
        trimmed = 0
        for bucket in old:
            successor = await self._call("exists", lay.bucket(bucket + 1))
            if successor is not None and now_ms - successor.ctime < self.log_retention * 1e3:
                continue
            try:
                # marked first: a watcher still reading it must not take it as complete
                await self._call("set", lay.bucket(bucket), _TRIMMED)
                entries = await self._call("get_children", lay.bucket(bucket))
            except NoNodeError:
                continue
            for i in range(0, len(entries), DELETE_CHUNK):
                await self._gather(
                    [
                        ("delete", (f"{lay.bucket(bucket)}/{name}",))
                        for name in entries[i : i + DELETE_CHUNK]
                    ]
                )
            await self._gather([("delete", (lay.bucket(bucket),))])
            trimmed += 1
        return trimmed

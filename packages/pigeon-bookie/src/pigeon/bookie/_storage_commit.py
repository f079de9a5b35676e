"""Durability of a segment store's writes: the flusher's group commit.

Every flush round takes the set of files written since the previous round and
``fdatasync``\\ s each once, in worker threads, while new appends go on into the next
round.  Under ``always`` an add returns after the round covering it; under ``interval``
rounds run every ``fsync_interval_ms`` and adds return after the write; under ``never``
only :meth:`~pigeon.bookie.SegmentStore.sync`, a fence and shutdown fsync.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from pigeon.bookie._storage_state import (
    DropBehind,
    Round,
    SegmentState,
    StoreBase,
    drop_behind,
    next_drop,
)
from pigeon.core.errors import BookieReadOnly, SegmentNotFound, StorageError

__all__ = ["AppendWaiter", "StoreCommit", "fsync_many"]


def fsync_many(
    fds: list[int], dir_fd: int | None, drops: Sequence[DropBehind] = ()
) -> OSError | None:
    """fdatasync ``fds``, fsync ``dir_fd``, then (all durable) drop ``drops`` from the
    page cache; the first error, or None."""
    try:
        for fd in fds:
            os.fdatasync(fd)
        if dir_fd is not None:
            os.fsync(dir_fd)
    except OSError as exc:
        return exc
    if drops:
        drop_behind(list(drops))
    return None


class _Segment(Protocol):
    """What a waiter asks of a store's segment (SegmentStore's, JournalStore's)."""

    id: int
    deleted: bool


class AppendWaiter:
    """Returned by :meth:`SegmentStore.append` and :meth:`JournalStore.append`: when is
    the entry durable?"""

    __slots__ = ("_round", "_segment")

    def __init__(self, round: Round | None, segment: _Segment) -> None:
        self._round = round
        self._segment = segment

    @property
    def done(self) -> bool:
        """True once durable per the policy (or failed: see :attr:`error`)."""
        return self._round is None or self._round.done.is_set()

    @property
    def error(self) -> StorageError | None:
        """Why the entry is not durable, once :attr:`done`; None if it is."""
        r = self._round
        if r is None or not r.done.is_set():
            return None
        if r.error is not None:
            return BookieReadOnly(f"fsync failed: {r.error}")
        if self._segment.deleted:
            return SegmentNotFound(f"segment={self._segment.id} was deleted")
        return None

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` (synchronously, from a trio task of the store) once
        :attr:`done`; at once if it already is.  Cheaper than a task per add that
        awaits :meth:`wait`: the RPC service answers a whole group commit this way."""
        r = self._round
        if r is None or r.done.is_set():
            fn()
        else:
            r.callbacks.append(fn)

    async def wait(self) -> None:
        """Return once durable; raise :attr:`error` if that failed."""
        if self._round is None:
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await self._round.done.wait()
        err = self.error
        if err is not None:
            raise err


class StoreCommit(StoreBase):
    """The flusher task, its rounds and the durability waiter of each add."""

    def _durability(self, seg: SegmentState) -> AppendWaiter:
        r = self._collecting
        r.segments[seg.id] = seg  # shutdown and sync() fsync it, whatever the policy
        if self._policy == "always":
            self._flush_wanted.set()
            return AppendWaiter(r, seg)
        if self._policy == "interval":
            self._flush_wanted.set()
        return AppendWaiter(None, seg)

    async def _flusher(self) -> None:
        last = -float("inf")
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted = trio.Event()
            if self._policy == "interval":
                await trio.sleep_until(last + self._interval)
                last = trio.current_time()
            with trio.CancelScope(shield=True):
                await self._flush_round()

    async def _flush_round(self) -> None:
        """Group commit: fdatasync once every file written since the previous round."""
        r = self._collecting
        self._collecting = Round()
        segs = [s for s in r.segments.values() if not s.closed]
        sync_dir = self._dir_dirty
        self._dir_dirty = False
        if not segs and not sync_dir:
            r.finish()
            return
        for s in segs:
            s.acquire()
        # until the fsyncs are known to have succeeded, the round has failed
        r.error = OSError("flush round did not complete")
        started = time.perf_counter()
        try:
            dir_fd = self._dir_fd if sync_dir else None
            errors: list[OSError] = []
            threads = self._fsync_threads
            if len(segs) <= 1:  # the common case: no nursery, one thread hop
                fds = [s.fd for s in segs]
                err = await threads[0].run(fsync_many, fds, dir_fd, self._drops(segs))
                if err is not None:
                    errors.append(err)
            else:
                n = min(len(threads), len(segs))

                async def sync_group(i: int, group: list[SegmentState], dir_fd: int | None) -> None:
                    fds = [s.fd for s in group]
                    err = await threads[i].run(fsync_many, fds, dir_fd, self._drops(group))
                    if err is not None:
                        errors.append(err)

                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        nursery.start_soon(sync_group, i, segs[i::n], dir_fd if i == 0 else None)
            self._counters.fsyncs += len(segs) + sync_dir
            self._counters.flush_rounds += 1
            self._counters.flush_seconds += time.perf_counter() - started
            if errors:
                r.error = errors[0]
                self._io_failed("fsync", errors[0])
                self._dir_dirty = self._dir_dirty or sync_dir
            else:
                r.error = None
        finally:
            for s in segs:
                s.release()
            r.finish()

    def _drops(self, segs: list[SegmentState]) -> list[DropBehind]:
        """What the round's fdatasync makes droppable from the page cache: of each
        segment file, what lies more than ``page_cache_window_bytes`` before its end
        (everything written so far is in this round), a few MiB at a time at least."""
        drops = (next_drop(s, s.end, self._cache_window) for s in segs)
        return [d for d in drops if d is not None]

    async def sync(self) -> None:
        """Fsync everything written so far (whatever the policy)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_running()
        r = self._collecting
        for seg in self._segments.values():
            r.segments[seg.id] = seg
        self._flush_wanted.set()
        await r.done.wait()
        if r.error is not None:
            raise BookieReadOnly(f"fsync failed: {r.error}")

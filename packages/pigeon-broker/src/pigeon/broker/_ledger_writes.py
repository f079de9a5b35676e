"""The ledger's write path: appends, segment writers, rollover and fencing.

``append_nowait`` assigns the partition offsets and the next entry id at call time (so
the order of calls is the order in the log), hands the entry to the segment writer, and
calls back in order once the replication policy acknowledged it.  A segment that is full,
too old or whose writer failed is closed (recovered when needed: fence it, find its last
entry) and the next one opened; appends the old writer did not confirm are written again
with the same offsets.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections import deque

import trio

from pigeon.broker._ledger_state import AppendCallback, LedgerState, SegmentInfo, _Append, log
from pigeon.core import SegmentWriter
from pigeon.core.batch import pack_entry_header
from pigeon.core.errors import NotEnoughBookies, NotOwner, PigeonError, ServiceUnavailable
from pigeon.core.paths import SEGMENT_ID_PREFIX, segment_path

__all__ = ["LedgerWrites"]

#: a bookie that failed a write is left out of new ensembles for this long (seconds)
QUARANTINE_S = 5.0
#: how long opening a segment writer on its ensemble may take
WRITER_OPEN_TIMEOUT_S = 5.0
#: how long a size/age rollover waits for in-flight entries before recovering instead
SEGMENT_DRAIN_S = 30.0
#: first and longest wait between rollover attempts
ROLL_BACKOFF_S = (0.05, 2.0)
#: failed attempts to open a new segment before pending appends fail (retriably)
ROLL_ATTEMPTS_BEFORE_FAILING = 4
#: ... or seconds a rollover has been failing (attempts that wait on paused bookies)
ROLL_FAILING_S = 10.0


class LedgerWrites(LedgerState):
    """Appending to a ledger: the segment being written and the appends not yet settled."""

    async def _recover(self, seg: SegmentInfo) -> int:
        """Fence an open segment and find (and re-replicate) its last entry."""
        return int(
            await self.policy.recover(
                seg.id,
                seg.ensemble,
                ack_quorum=seg.ack_quorum or None,
                write_quorum=seg.write_quorum or None,
                first_entry=seg.fragments[-1][0] if seg.fragments else 0,
            )
        )

    def _ensemble_config(self) -> tuple[list[str], int, int, int]:
        """(bookies to choose from, E, Qw, Qa) for a new segment.

        Bookies that failed a write recently (quarantined for ``QUARANTINE_S``) are left
        out.  With fewer writable bookies than E, the segment gets an ensemble of those there
        are (E and Qw shrink, never below Qa): writes go on while redundancy remains, and
        the full ensemble returns with the next segment once the bookies are back.
        """
        quorum = self.quorum()
        e, qw, qa = quorum or (
            self.policy.ensemble_size,
            self.policy.write_quorum,
            self.policy.ack_quorum,
        )
        now = trio.current_time()
        self._quarantine = {b: t for b, t in self._quarantine.items() if t > now}
        registered = list(self.bookies())
        healthy = [b for b in registered if b not in self._quarantine]
        if len(healthy) < qa:
            raise NotEnoughBookies(
                f"topic {self.topic} needs {qa} writable bookies (ack quorum), "
                f"{len(healthy)} available"
            )
        e = min(e, len(healthy))
        return healthy, e, min(qw, e), qa

    def quarantine(self, address: str, seconds: float = QUARANTINE_S) -> None:
        """Leave ``address`` out of new ensembles for a while (it failed a write)."""
        self._quarantine[address] = trio.current_time() + seconds

    async def _new_segment(self) -> None:
        bookies, e, qw, qa = self._ensemble_config()
        ensemble = self.policy.choose_ensemble(bookies, e)
        first_offset = self._pending[0].offset if self._pending else self.next_offset
        created = await self.store.create(SEGMENT_ID_PREFIX, b"", sequential=True)
        segment_id = int(created.rsplit("-", 1)[1]) + 1
        seg = SegmentInfo(
            id=segment_id,
            first_offset=first_offset,
            ensemble=ensemble,
            ctime=time.time(),
            write_quorum=qw,
            ack_quorum=qa,
        )
        await self.store.create(
            segment_path(segment_id),
            json.dumps(
                {"topic": self.topic.full, "ensemble": ensemble, "ctime": seg.ctime}
            ).encode(),
        )
        try:
            with trio.fail_after(WRITER_OPEN_TIMEOUT_S):
                writer = await self.policy.create_writer(
                    segment_id,
                    ensemble,
                    write_quorum=qw,
                    ack_quorum=qa,
                    replace_bookie=functools.partial(self._replace_bookie, seg),
                    nursery=self.nursery,
                )
        except (PigeonError, OSError, trio.TooSlowError) as exc:
            # A registered bookie that does not answer (dead, paused, cut off): leave it
            # out of the next try; the segment id is simply never used.
            for address in ensemble:
                if not await self._reachable(address):
                    self.quarantine(address)
            with contextlib.suppress(PigeonError):
                await self.store.delete(segment_path(segment_id))
            raise ServiceUnavailable(
                f"cannot open a segment of {self.topic} on {ensemble}: {exc}"
            ) from None
        if self.closed:  # closed while the writer was being opened
            writer.close()
            with contextlib.suppress(PigeonError):
                await self.store.delete(segment_path(segment_id))
            raise ServiceUnavailable(f"topic {self.topic} is closed")
        self.segments.append(seg)
        self._reindex()
        try:
            await self._save()
        except BaseException:
            self.segments.pop()
            self._reindex()
            writer.close()
            raise
        self._writer = writer
        log.info(
            "segment opened topic=%s segment=%s ensemble=%s write_quorum=%s ack_quorum=%s",
            self.topic,
            segment_id,
            ensemble,
            qw,
            qa,
        )

    async def _reachable(self, address: str) -> bool:
        client = getattr(self.policy, "client", None)
        if client is None:
            return True
        try:
            with trio.fail_after(1.0):
                await client.connection(address)
        except (PigeonError, OSError, trio.TooSlowError):
            return False
        return True

    # ------------------------------------------------------------------ appends

    def append_nowait(
        self,
        payload: bytes | memoryview,
        num_messages: int,
        callback: AppendCallback,
        *,
        deliver_at: int = 0,
    ) -> None:
        """Append one batch; ``callback((segment_id, entry_id, first_offset), error)``.

        Raises (and stores nothing) when the ledger is closed or cannot write now; else
        the callback runs exactly once, in append order: with the entry's position once
        it is stored on the ack quorum, or with a retriable error when it was not stored
        (then every later pending append fails too, and their offsets are reused).
        """
        if self.closed:
            raise ServiceUnavailable(f"topic {self.topic} is closed")
        if self.unavailable is not None:
            raise self.unavailable
        offset = self.next_offset
        self.next_offset += num_messages
        now = max(self.clock.now_ms(), self.last_publish_time)
        self.last_publish_time = now
        # One copy: the tail cache serves the entry whole; the writer sends this object.
        data = pack_entry_header(num_messages, offset, now, deliver_at) + payload
        append = _Append(data, num_messages, offset, callback, time.perf_counter())
        self._pending.append(append)
        if not self._rolling and self._writer is not None:
            self._write(append)

    def _write(self, append: _Append) -> None:
        seg = self.segments[-1]
        writer = self._writer
        assert writer is not None  # appends are written only while a segment is open

        def done(entry_id: int, error: BaseException | None) -> None:
            if error is not None:
                self._on_writer_failed(writer, error)
            else:
                self._stored(seg, append, entry_id)

        try:
            entry_id = writer.add_nowait(append.data, done)
        except PigeonError as exc:
            self._on_writer_failed(writer, exc)
            return
        append.segment_id = seg.id
        append.entry_id = entry_id
        if (
            writer.next_entry_id >= self.config.max_entries_per_segment
            or writer.bytes_written >= self.config.max_segment_bytes
            or time.time() - seg.ctime >= self.config.max_segment_age_s
        ):
            self._start_roll()

    def _stored(self, seg: SegmentInfo, append: _Append, entry_id: int) -> None:
        """``append`` is stored as ``entry_id`` of ``seg``: settle it (in order)."""
        if not self._pending or self._pending[0] is not append:
            log.error(
                "out-of-order write completion topic=%s segment=%s entry=%s",
                self.topic,
                seg.id,
                entry_id,
            )
            return
        self._pending.popleft()
        seg.last_entry_id = max(seg.last_entry_id, entry_id)
        seg.entries = seg.last_entry_id + 1
        seg.size += len(append.data)
        seg.last_publish_time = max(seg.last_publish_time, self.last_publish_time)
        self.cache.put((seg.id, entry_id), append.data)
        self.msgs_in += append.num_messages
        self.bytes_in += len(append.data)
        self.publish_latency.observe(time.perf_counter() - append.accepted)
        try:
            append.callback((seg.id, entry_id, append.offset), None)
        except Exception:
            log.exception("append callback failed topic=%s", self.topic)
        self._entries_changed()

    def _fail_pending(self, error: PigeonError) -> None:
        """Fail every pending append that is in no segment (a suffix), reusing offsets."""
        failed: list[_Append] = []
        while self._pending and self._pending[-1].segment_id < 0:
            failed.append(self._pending.pop())
        if not failed:
            return
        self.next_offset = failed[-1].offset
        for append in reversed(failed):
            try:
                append.callback(None, error)
            except Exception:
                log.exception("append callback failed topic=%s", self.topic)

    async def _replace_bookie(self, seg: SegmentInfo, index: int, first_entry: int) -> str:
        """Ensemble change: a new bookie (the least loaded outside the ensemble) for
        ``index`` from ``first_entry`` on, recorded in the segment's metadata."""
        writer = self._writer
        if seg.state != "open" or self.closed or (writer is not None and writer.failed is not None):
            # a change still under way when the segment's writer failed (the segment is
            # being recovered on its ensemble) or the segment was closed: its entries
            # are on the old bookies, and so they stay in its metadata
            raise ServiceUnavailable(f"segment {seg.id} is closed: no ensemble change")
        self.quarantine(seg.ensemble[index])
        candidates = [
            b for b in self.bookies() if b not in seg.ensemble and b not in self._quarantine
        ]
        if not candidates:
            raise ServiceUnavailable(
                f"no spare bookie to replace {seg.ensemble[index]} in segment {seg.id}"
            )
        load = getattr(self.bookies, "load", None)  # the BookieDirectory's bytes/s
        address = min(candidates, key=lambda b: (load(b), b)) if load else candidates[0]
        before = (seg.ensemble, seg.fragments, seg.initial_ensemble)
        if not seg.initial_ensemble:
            seg.initial_ensemble = list(seg.ensemble)
        ensemble = list(seg.ensemble)
        ensemble[index] = address
        seg.ensemble = ensemble
        seg.fragments = [f for f in seg.fragments if f[0] != first_entry]
        seg.fragments.append([first_entry, ensemble])
        try:
            await self._save()
        except BaseException:
            # not recorded: the writer keeps the old bookie at ``index`` and tries again
            seg.ensemble, seg.fragments, seg.initial_ensemble = before
            raise
        return address

    def _on_writer_failed(self, writer: SegmentWriter, error: BaseException) -> None:
        if writer is self._writer and not self._rolling:
            log.warning("segment write failed topic=%s error=%s; rolling over", self.topic, error)
            self._start_roll(recover=True)

    async def wait_rolled(self) -> None:
        """Wait until no segment roll is under way (the full segment closed in the
        metadata and the next one open), e.g. before listing the closed segments."""
        await self._rolled.wait()

    def _start_roll(self, *, recover: bool = False) -> None:
        if self._rolling:
            return
        self._rolling = True
        self._rolled = trio.Event()
        self.nursery.start_soon(self._roll, recover)

    async def _roll(self, recover: bool) -> None:
        """Close the current segment and open the next one, until it works.

        Entries the old writer did not confirm are settled by recovering the segment
        (fence it, find its last entry): those at or before the end are stored; the
        rest are written again, with the same offsets, to the new segment.  Failures
        (bookies or metadata away) are retried with backoff for as long as the ledger
        is open; while no segment can be made, pending appends fail with a retriable
        error and new ones are refused, until a segment can be made again.
        """
        delay = ROLL_BACKOFF_S[0]
        attempts = 0
        started = trio.current_time()
        try:
            while not self.closed:
                attempts += 1
                try:
                    if self._writer is not None:
                        await self._close_segment(recover)
                    if self.closed:
                        break  # closed meanwhile: no new segment (close() gave up waiting)
                    await self._new_segment()
                    break
                except NotOwner:
                    raise
                except (PigeonError, OSError) as exc:
                    log.warning(
                        "segment rollover failed topic=%s error=%s; retrying in %.2fs",
                        self.topic,
                        exc,
                        delay,
                    )
                    # Also (after twice the attempts, or ROLL_FAILING_S) while the old
                    # segment cannot be closed, e.g. not recovered with too few bookies:
                    # its own appends wait for its recovery, those in no segment fail.
                    if (
                        self._writer is None
                        and (
                            isinstance(exc, NotEnoughBookies)
                            or attempts >= ROLL_ATTEMPTS_BEFORE_FAILING
                        )
                    ) or (
                        attempts >= 2 * ROLL_ATTEMPTS_BEFORE_FAILING
                        or trio.current_time() - started >= ROLL_FAILING_S
                    ):
                        error = (
                            exc
                            if isinstance(exc, PigeonError) and exc.retriable
                            else ServiceUnavailable(f"topic {self.topic} cannot write: {exc}")
                        )
                        self.unavailable = error
                        self._fail_pending(error)
                    await trio.sleep(delay)
                    delay = min(delay * 2, ROLL_BACKOFF_S[1])
        except NotOwner as exc:
            self._fenced(exc)
            return
        except BaseException:
            self._fenced(ServiceUnavailable(f"topic {self.topic} is closing"), notify=False)
            raise
        finally:
            self._rolling = False
            self._rolled.set()
        if self.closed:
            return
        if self.unavailable is not None:
            log.info("topic writable again topic=%s", self.topic)
            self.unavailable = None
        for append in list(self._pending):
            if append.segment_id < 0:
                self._write(append)
                if self._rolling:
                    break  # the new segment is full or failed already; the next roll goes on

    async def _close_segment(self, recover: bool) -> None:
        """Stop the writer, find the segment's true end, settle what it holds, close it."""
        writer = self._writer
        assert writer is not None  # called only while a segment is open
        seg = self.segments[-1]
        if not recover:
            with trio.move_on_after(SEGMENT_DRAIN_S):
                await writer.wait_idle()
        if recover or writer.failed is not None or writer.pending:
            if writer.failed is None:
                writer.abort(ServiceUnavailable(f"segment {seg.id} is being recovered"))
            last = await self._recover(seg)
            if last < seg.last_entry_id:
                # copies lost since they were acknowledged: the segment still ends after
                # them (reads report them damaged), never below what producers were told
                log.error(
                    "recovery found fewer entries than were acknowledged topic=%s segment=%s"
                    " recovered_last=%s acknowledged_last=%s",
                    self.topic,
                    seg.id,
                    last,
                    seg.last_entry_id,
                )
                last = seg.last_entry_id
        else:
            last = writer.lac
        writer.close()
        seg.state = "closed"
        old_last, old_size = seg.last_entry_id, seg.size
        seg.last_entry_id = last
        seg.entries = last + 1
        stored = [a for a in self._pending if a.segment_id == seg.id and a.entry_id <= last]
        seg.size += sum(len(a.data) for a in stored)
        emptied = seg.entries == 0
        if emptied:
            self.segments.pop()
            self._reindex()
        try:
            await self._save()
        except BaseException:
            if emptied:
                self.segments.append(seg)
                self._reindex()
            seg.state, seg.last_entry_id, seg.size = "open", old_last, old_size
            seg.entries = old_last + 1
            raise
        self._writer = None
        # Settled by the recovery: stored at or before the end; the rest goes again.
        for append in list(self._pending):
            if append.segment_id != seg.id:
                continue
            if append.entry_id <= last:
                self._stored_recovered(seg, append)
            else:
                append.segment_id = append.entry_id = -1

    def _stored_recovered(self, seg: SegmentInfo, append: _Append) -> None:
        seg.size -= len(append.data)  # counted when the segment was closed
        last, entries = seg.last_entry_id, seg.entries
        self._stored(seg, append, append.entry_id)
        seg.last_entry_id, seg.entries = last, entries

    def _fenced(self, error: PigeonError, *, notify: bool = True) -> None:
        """Another broker took the ledger over (or it is closing): fail what is pending."""
        self.closed = True
        pending, self._pending = list(self._pending), deque()
        for append in pending:
            try:
                append.callback(None, error)
            except Exception:
                log.exception("append callback failed topic=%s", self.topic)
        if self._writer is not None:
            self._writer.close()
        log.warning("ledger closed topic=%s error=%s", self.topic, error)
        if notify and self.on_fenced is not None:
            self.on_fenced()

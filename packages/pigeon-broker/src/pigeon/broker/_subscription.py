"""Subscriptions: a cursor plus a dispatcher that pushes entries to consumers.

Dispatch works per *entry* (one producer batch), never per message: the dispatcher reads
entries from the managed ledger, skips those whose every message is acknowledged, and
pushes each remaining entry whole to one consumer together with the batch indexes already
acknowledged (so the client skips those).  Consumers grant permits (messages); an entry is
sent while its consumer has a positive permit count (Pulsar's flow control).

* ``exclusive``: one consumer; a second subscribe fails with ConsumerBusy.
* ``shared``: entries go round-robin to the consumers that have permits.
* ``failover``: one active consumer (highest priority, then name); others stand by.

Entries delivered and not yet fully acknowledged are *pending*; when their consumer goes
away they are queued for redelivery (redelivery count + 1) before anything new is read.

Reads that fail never end a subscription.  A retriable failure (bookies away) is retried
with backoff (0.1 s doubling to 5 s).  An entry no replica holds intact (CorruptEntry
from the ledger) is handled per the corrupt-entry policy: ``skip`` (the default) goes on
after the damaged run, acknowledging its messages as lost (counted in
``lost_messages``, logged once); ``fail`` stops delivery at that entry (``read_error``
says why, in the admin API) and reads it again every 5 s to 60 s, in case a replica came
back, until an admin skips the messages, resets the cursor or changes the policy.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from pigeon.broker._cursor import CursorState
from pigeon.broker._ledger import Entry, ManagedLedger, Position
from pigeon.core.batch import ENTRY_HEADER_SIZE, decode_batch
from pigeon.core.errors import (
    ConsumerBusy,
    CorruptEntry,
    NotSupported,
    PigeonError,
    SubscriptionBusy,
)
from pigeon.core.paths import cursor_path
from pigeon.core.runtime import WallClock

if TYPE_CHECKING:
    from pigeon.core.rpc import Connection

__all__ = ["CORRUPT_ENTRY_POLICIES", "Consumer", "Subscription"]

log = logging.getLogger(__name__)

_PUSH_MAX_BYTES = 1024 * 1024
_HASH_RANGE = 65536
_RING_POINTS = 64
_READ_MAX_ENTRIES = 64
#: retriable read failures: first and longest wait before reading again (seconds)
_RETRY_S = (0.1, 5.0)
#: corrupt_entry_policy "fail": first and longest wait before reading the entry again
_FAIL_RETRY_S = (5.0, 60.0)
CORRUPT_ENTRY_POLICIES = ("skip", "fail")


@dataclass(eq=False)
class Consumer:
    conn: Connection
    consumer_id: int
    name: str
    priority: int = 0
    permits: int = 0
    pending: set[Position] = field(default_factory=set)
    msgs_out: int = 0
    bytes_out: int = 0
    join_offset: int | None = None  # key_shared: recently joined, see _deliver_key_shared


@dataclass(slots=True)
class _Pending:
    consumer: Consumer
    first_offset: int
    count: int


class Subscription:
    def __init__(
        self,
        name: str,
        sub_type: str,
        ledger: ManagedLedger,
        cursor: CursorState,
        *,
        durable: bool = True,
        store: Any = None,
        persist_interval: float = 0.1,
        clock: Any = None,
        codecs: Any = None,
        corrupt_entry_policy: Callable[[], str] | None = None,
    ) -> None:
        self.name = name
        self.type = sub_type
        self.ledger = ledger
        self.cursor = cursor
        self.durable = durable
        self.store = store
        self.persist_interval = persist_interval
        self.path = cursor_path(ledger.topic, name)
        self.consumers: list[Consumer] = []
        self.read_position: Position | None = None
        self.pending: dict[Position, _Pending] = {}
        self.redeliveries: dict[Position, int] = {}
        self._redeliver: list[Position] = []
        self._delayed: list[tuple[int, Position]] = []  # (deliver_at ms, position)
        self.codecs = codecs
        # key_shared state
        self._ring: list[tuple[int, int, Consumer]] = []
        self._ks_pending: dict[Position, dict[Consumer, set[int]]] = {}
        self._ks_held: set[Position] = set()
        self._ks_first: dict[Position, int] = {}
        self._stalled = False
        self.max_dispatched = -1
        self.clock = clock or WallClock()
        self._rr = 0
        self._wakeup = trio.Event()
        self._dirty = False
        self._persist_lock = trio.Lock()
        self._cursor_version: int | None = None
        self.closed = False
        self._task_started = False
        self.msgs_out = 0
        self.bytes_out = 0
        #: ``() -> "skip" | "fail"``: what to do at an entry no replica holds intact
        self.corrupt_entry_policy: Callable[[], str] = corrupt_entry_policy or (lambda: "skip")
        #: messages acknowledged as lost because their entry was damaged (policy skip)
        self.lost_messages = 0
        #: why delivery is stopped (policy fail), None while it is not
        self.read_error: str | None = None
        self._failing_at: Position | None = None
        self._read_offset: int | None = None  # end offset of the last entry read in order
        self._blocked_until = 0.0  # no read before this trio time (backoff)
        self._retry_delay = 0.0
        # offsets (first, count) of entries queued for redelivery, to skip them if damaged
        self._redeliver_offsets: dict[Position, tuple[int, int]] = {}

    # ------------------------------------------------------------------ consumers

    def add_consumer(self, consumer: Consumer, sub_type: str) -> None:
        if sub_type != self.type:
            if self.consumers:
                raise SubscriptionBusy(f"subscription {self.name!r} is {self.type}, not {sub_type}")
            self.type = sub_type
        if self.type == "exclusive" and self.consumers:
            raise ConsumerBusy(f"exclusive subscription {self.name!r} already has a consumer")
        previous = self.active_consumer() if self.type == "failover" else None
        if (
            self.type == "keyShared"
            and self.consumers
            and self.max_dispatched >= self.cursor.mark_delete
        ):
            # Keys may move to the new consumer: it gets nothing read after this point until
            # everything dispatched before it is acknowledged (per-key order).
            consumer.join_offset = self.max_dispatched + 1
        self.consumers.append(consumer)
        self.consumers.sort(key=lambda c: (-c.priority, c.name, c.consumer_id))
        self._rebuild_ring()
        if previous is not None and self.active_consumer() is not previous:
            # The active consumer changed: what the old one holds unacked moves over.
            self.redeliver_unacked(previous, None)
        self.wake()

    def remove_consumer(self, consumer: Consumer) -> None:
        previous = self.active_consumer() if self.type == "failover" else None
        if consumer in self.consumers:
            self.consumers.remove(consumer)
            self._rebuild_ring()
        if self.type == "keyShared":
            for pos in sorted(consumer.pending):
                parts = self._ks_pending.get(pos)
                if parts is not None:
                    parts.pop(consumer, None)
                    if not parts:
                        del self._ks_pending[pos]
                self.redeliveries[pos] = self.redeliveries.get(pos, 0) + 1
                heapq.heappush(self._redeliver, pos)
            consumer.pending.clear()
            self._release_held()
            self.wake()
            return
        if (
            previous is not None
            and previous is not consumer
            and previous is not self.active_consumer()
        ):
            self.redeliver_unacked(previous, None)
        for pos in sorted(consumer.pending):
            p = self.pending.pop(pos, None)
            if p is not None:
                self.redeliveries[pos] = self.redeliveries.get(pos, 0) + 1
                self._redeliver_offsets[pos] = (p.first_offset, p.count)
                heapq.heappush(self._redeliver, pos)
        consumer.pending.clear()
        self.wake()

    def active_consumer(self) -> Consumer | None:
        """Exclusive/failover: the one consumer that receives.

        Failover consumers are ordered by (priority desc, name); partition ``i`` of a
        partitioned topic picks consumer ``i mod n`` of that order, so the partitions
        spread over the consumers and each partition has exactly one active consumer.
        """
        if not self.consumers:
            return None
        if self.type == "failover":
            index = max(self.ledger.topic.partition_index, 0) % len(self.consumers)
            return self.consumers[index]
        return self.consumers[0]

    def flow(self, consumer: Consumer, permits: int) -> None:
        consumer.permits += permits
        self.wake()

    def wake(self) -> None:
        self._stalled = False
        self._wakeup.set()

    # ------------------------------------------------------------------ key_shared

    def _rebuild_ring(self) -> None:
        ring = []
        for c in self.consumers:
            for i in range(_RING_POINTS):
                ring.append((zlib.crc32(f"{c.name}:{i}".encode()) % _HASH_RANGE, c.consumer_id, c))
        ring.sort(key=lambda t: (t[0], t[1]))
        self._ring = ring

    def _owner(self, h: int) -> Consumer:
        ring = self._ring
        i = bisect.bisect_left(ring, h, key=lambda t: t[0])
        return ring[i % len(ring)][2]

    def _keys_of(self, entry: Entry) -> list[bytes | None]:
        try:
            batch = decode_batch(memoryview(entry.data)[ENTRY_HEADER_SIZE:], self.codecs)
            return batch.keys() if batch.has_keys else [None] * entry.num_messages
        except PigeonError as exc:
            log.warning("key_shared cannot read keys sub=%s error=%s", self.name, exc)
            return [None] * entry.num_messages

    def _release_held(self) -> None:
        """Re-examine held key_shared entries (on acks and consumer changes).

        A recently joined consumer whose wait is over stops waiting; every held entry goes
        back to the redelivery queue, where dispatch holds again whatever is still blocked
        (its key may also belong to another consumer by now).
        """
        md = self.cursor.mark_delete
        for c in self.consumers:
            if c.join_offset is not None and md >= c.join_offset:
                c.join_offset = None
        for pos in sorted(self._ks_held):
            heapq.heappush(self._redeliver, pos)
        self._ks_held.clear()

    def _deliver_key_shared(self, entries: list[Entry], now: int) -> bool:
        delivered = False
        for k, entry in enumerate(entries):
            pos = entry.position
            first, n = entry.first_offset, entry.num_messages
            if self.cursor.all_acked(first, n):
                self.redeliveries.pop(pos, None)
                continue
            if entry.deliver_at > now:
                heapq.heappush(self._delayed, (entry.deliver_at, pos))
                continue
            if not self._ring:
                for rest in entries[k:]:
                    heapq.heappush(self._redeliver, rest.position)
                self._stalled = True
                break
            skip = set(self.cursor.acked_indexes(first, n))
            for part in self._ks_pending.get(pos, {}).values():
                skip |= part
            keys = self._keys_of(entry)
            groups: dict[Consumer, list[int]] = {}
            owners: dict[bytes | None, Consumer] = {}
            for i in range(n):
                if i in skip:
                    continue
                key = keys[i]
                c = owners.get(key)
                if c is None:
                    c = owners[key] = self._owner(zlib.crc32(key or b"") % _HASH_RANGE)
                groups.setdefault(c, []).append(i)
            if any(c.permits <= 0 or c.conn.closed for c in groups):
                # Order per key: wait for the consumer rather than skip ahead.
                for rest in entries[k:]:
                    heapq.heappush(self._redeliver, rest.position)
                self._stalled = True
                break
            md = self.cursor.mark_delete
            for c, idx in groups.items():
                if (
                    c.join_offset is not None
                    and md < c.join_offset
                    and first + idx[-1] >= c.join_offset
                ):
                    self._ks_held.add(pos)
                    continue
                c.permits -= len(idx)
                c.pending.add(pos)
                self._ks_pending.setdefault(pos, {}).setdefault(c, set()).update(idx)
                self._ks_first[pos] = first
                self.max_dispatched = max(self.max_dispatched, first + idx[-1])
                chosen = set(idx)
                others = [i for i in range(n) if i not in chosen]
                self._send(c, [(entry, others)])
                delivered = True
        return delivered

    def _ks_settle(self, positions: list[Position]) -> None:
        for pos in positions:
            parts = self._ks_pending.get(pos)
            if not parts:
                continue
            first = self._ks_first.get(pos)
            if first is None:
                continue
            for c in list(parts):
                left = {i for i in parts[c] if not self.cursor.is_acked(first + i)}
                if left:
                    parts[c] = left
                else:
                    del parts[c]
                    c.pending.discard(pos)
            if not parts:
                del self._ks_pending[pos]
                self._ks_first.pop(pos, None)
                self.redeliveries.pop(pos, None)

    # ------------------------------------------------------------------ acks

    def ack(
        self, consumer: Consumer | None, positions: list[tuple[Position, int]], cumulative: bool
    ) -> None:
        """``positions``: ((segment index, entry id), offset) of each acknowledged message."""
        if cumulative:
            if self.type in ("shared", "keyShared"):
                raise NotSupported(
                    f"cumulative acknowledgement is not allowed on {self.type} subscription "
                    f"{self.name!r}"
                )
            top_pos, top_offset = max(positions, key=lambda p: p[1])
            self.cursor.ack_cumulative(top_offset)
            for pos in [p for p in self.pending if p <= top_pos]:
                self._settle(pos)
        else:
            for pos, offset in positions:
                self.cursor.ack(offset)
                p = self.pending.get(pos)
                if p is not None and self.cursor.all_acked(p.first_offset, p.count):
                    self._settle(pos)
            # entries not pending (e.g. after a reconnect) are filtered when read again
            if self.type == "keyShared":
                self._ks_settle([pos for pos, _offset in positions])
                self._release_held()
        self._dirty = True
        self.wake()

    def _settle(self, pos: Position) -> None:
        p = self.pending.pop(pos, None)
        if p is not None:
            p.consumer.pending.discard(pos)
        self.redeliveries.pop(pos, None)

    def redeliver_unacked(self, consumer: Consumer, positions: list[Position] | None) -> None:
        chosen = (
            sorted(consumer.pending)
            if not positions
            else [p for p in positions if p in consumer.pending]
        )
        for pos in chosen:
            consumer.pending.discard(pos)
            p = self.pending.pop(pos, None)
            if p is not None:
                self._redeliver_offsets[pos] = (p.first_offset, p.count)
            self.redeliveries[pos] = self.redeliveries.get(pos, 0) + 1
            heapq.heappush(self._redeliver, pos)
        self.wake()

    def expire_before(self, offset: int) -> None:
        """Acknowledge everything below ``offset`` (message TTL, backlog eviction)."""
        self.cursor.ack_cumulative(offset - 1)
        if self.read_error is not None:
            self._blocked_until = 0.0  # read the damaged entry again now: it may be skipped
        for pos in [
            p for p, pend in self.pending.items() if pend.first_offset + pend.count <= offset
        ]:
            self._settle(pos)
        self._dirty = True
        self.wake()

    # ------------------------------------------------------------------ seeking

    async def seek_offset(self, offset: int) -> None:
        self.cursor.reset(offset)
        self.read_position = await self.ledger.position_for_offset(offset)
        self._reset_dispatch()

    async def seek_position(self, pos: Position, batch_index: int) -> None:
        entry = await self.ledger.read_one(pos)
        await self.seek_offset(entry.first_offset + max(batch_index, 0))

    async def seek_time(self, timestamp_ms: int) -> None:
        pos = await self.ledger.position_for_time(timestamp_ms)
        npos = self.ledger.normalize(pos)
        if npos is None:
            self.cursor.reset(self.ledger.next_offset)
            self.read_position = pos
        else:
            entry = await self.ledger.read_one(npos)
            self.cursor.reset(entry.first_offset)
            self.read_position = npos
        self._reset_dispatch()

    def _reset_dispatch(self) -> None:
        for c in self.consumers:
            c.pending.clear()
            c.join_offset = None
        self.pending.clear()
        self._ks_pending.clear()
        self._ks_held.clear()
        self._ks_first.clear()
        self._redeliver.clear()
        self._delayed.clear()
        self.redeliveries.clear()
        self._redeliver_offsets.clear()
        self._read_offset = None
        self._unblock()
        self._dirty = True
        self.wake()

    # ------------------------------------------------------------------ persistence

    async def persist(self) -> None:
        """Write the cursor if it changed; one write at a time, so a caller that returns
        knows every acknowledgement before its call is stored."""
        async with self._persist_lock:
            if not self.durable or self.store is None or not self._dirty:
                return
            self._dirty = False
            data = self.cursor.to_json()
            try:
                if self._cursor_version is None:
                    stat = await self.store.get(self.path)
                    if stat is None:
                        await self.store.create(self.path, data)
                        self._cursor_version = 0
                    else:
                        self._cursor_version = await self.store.set(self.path, data)
                else:
                    self._cursor_version = await self.store.set(self.path, data)
            except PigeonError as exc:
                self._dirty = True
                log.warning("cursor persist failed sub=%s error=%s", self.name, exc)

    async def flush(self) -> None:
        """Persist now (used when a consumer closes, so no ack is lost to a crash)."""
        await self.persist()

    async def delete(self) -> None:
        self.closed = True
        self.wake()
        if self.durable and self.store is not None:
            try:
                await self.store.delete(self.path)
            except PigeonError:
                pass

    # ------------------------------------------------------------------ dispatch

    def _pick(self) -> Consumer | None:
        if not self.consumers:
            return None
        if self.type in ("exclusive", "failover"):
            c = self.active_consumer()
            return c if c is not None and c.permits > 0 and not c.conn.closed else None
        n = len(self.consumers)
        for i in range(n):
            c = self.consumers[(self._rr + i) % n]
            if c.permits > 0 and not c.conn.closed:
                self._rr = (self._rr + i + 1) % n
                return c
        return None

    async def run(self) -> None:
        """Dispatch loop: runs until the subscription is closed."""
        persist_at = 0.0
        while not self.closed:
            self._release_delayed()
            if self._dirty and trio.current_time() >= persist_at:
                await self.persist()
                persist_at = trio.current_time() + self.persist_interval
            progressed = await self._dispatch_once()
            if progressed:
                await trio.lowlevel.checkpoint()
                continue
            ledger_event = self.ledger.new_entries_event()
            if self._wakeup.is_set():
                self._wakeup = trio.Event()
                self._stalled = False
            if self._has_work() and not self._stalled:
                continue
            timeout = max(0.0, persist_at - trio.current_time()) if self._dirty else float("inf")
            if self._blocked_until:
                timeout = min(timeout, max(0.0, self._blocked_until - trio.current_time()))
            if self._delayed:
                due_in = (self._delayed[0][0] - self.clock.now_ms()) / 1000
                timeout = min(timeout, max(0.0, due_in))
            with trio.move_on_after(timeout):
                async with trio.open_nursery() as nursery:

                    async def wait(ev: trio.Event) -> None:
                        await ev.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(wait, ledger_event)
                    nursery.start_soon(wait, self._wakeup)
        await self.persist()

    def _release_delayed(self) -> None:
        """Delayed entries whose time has come join the redelivery queue (in order)."""
        if not self._delayed:
            return
        now = self.clock.now_ms()
        while self._delayed and self._delayed[0][0] <= now:
            _at, pos = heapq.heappop(self._delayed)
            heapq.heappush(self._redeliver, pos)

    @property
    def delayed_count(self) -> int:
        return len(self._delayed)

    def _has_work(self) -> bool:
        if self._pick_peek() is None or self._blocked():
            return False
        if self._redeliver:
            return True
        return (
            self.read_position is not None and self.ledger.normalize(self.read_position) is not None
        )

    def _pick_peek(self) -> Consumer | None:
        rr = self._rr
        c = self._pick()
        self._rr = rr
        return c

    async def _dispatch_once(self) -> bool:
        consumer = self._pick_peek()
        if consumer is None or self._blocked():
            return False
        if self._redeliver:
            return await self._redeliver_some()
        pos = self.read_position
        if pos is None:
            return False
        try:
            entries = await self.ledger.read(pos, max_entries=_READ_MAX_ENTRIES)
        except CorruptEntry as exc:
            return await self._on_damaged(pos, exc)
        except PigeonError as exc:
            self._read_failed(pos, exc)
            return False
        self._read_ok()
        if not entries:
            return False
        gap_from = self._read_offset
        if gap_from is not None and entries[0].first_offset > gap_from:
            # offsets no entry holds (the log went on above lost entries): nothing to
            # deliver there, so nothing to wait for
            log.warning(
                "offsets without messages passed over topic=%s sub=%s offsets=%s..%s",
                self.ledger.topic,
                self.name,
                gap_from,
                entries[0].first_offset - 1,
            )
            self.cursor.ack_range(gap_from, entries[0].first_offset)
            self._dirty = True
        last = entries[-1]
        self.read_position = self.ledger.next_position(last.position)
        self._read_offset = last.first_offset + last.num_messages
        self._deliver(entries)
        return True

    async def _redeliver_some(self) -> bool:
        entries: list[Entry] = []
        skipped = False
        while self._redeliver and len(entries) < _READ_MAX_ENTRIES:
            pos = heapq.heappop(self._redeliver)
            if pos in self.pending:
                continue
            try:
                entries.append(await self.ledger.read_one(pos))
            except CorruptEntry as exc:
                if self.corrupt_entry_policy() == "fail":
                    heapq.heappush(self._redeliver, pos)
                    self._stop_at(pos, exc)
                    break
                offsets = self._redeliver_offsets.pop(pos, None)
                if offsets is not None:
                    self._lose(offsets[0], offsets[0] + offsets[1])
                self.redeliveries.pop(pos, None)
                skipped = True
                log.error(  # noqa: TRY400 - the cause is in the message
                    "damaged entry not redelivered topic=%s sub=%s position=%s error=%s",
                    self.ledger.topic,
                    self.name,
                    pos,
                    exc,
                )
                continue
            except PigeonError as exc:
                heapq.heappush(self._redeliver, pos)
                self._read_failed(pos, exc)
                break
            self._redeliver_offsets.pop(pos, None)
        if entries:
            self._read_ok()
        return self._deliver(entries) or bool(entries) or skipped

    # ------------------------------------------------------------------ read failures

    def _blocked(self) -> bool:
        return self._blocked_until > 0 and trio.current_time() < self._blocked_until

    def _unblock(self) -> None:
        self._blocked_until = self._retry_delay = 0.0
        self.read_error = None
        self._failing_at = None

    def _read_ok(self) -> None:
        if self.read_error is not None:
            log.info(
                "delivery resumed topic=%s sub=%s at=%s",
                self.ledger.topic,
                self.name,
                self._failing_at,
            )
        if self._blocked_until or self.read_error is not None:
            self._unblock()

    def _backoff(self, bounds: tuple[float, float]) -> None:
        self._retry_delay = min(max(self._retry_delay * 2, bounds[0]), bounds[1])
        self._blocked_until = trio.current_time() + self._retry_delay

    def _read_failed(self, pos: Position, exc: PigeonError) -> None:
        """A read failed for a reason that may pass (bookies away): retry later."""
        first = self._retry_delay == 0.0
        self._backoff(_RETRY_S)
        if first:
            log.warning(
                "read failed, retrying with backoff topic=%s sub=%s position=%s error=%s",
                self.ledger.topic,
                self.name,
                pos,
                exc,
            )

    def _stop_at(self, pos: Position, exc: PigeonError) -> None:
        """Policy fail: delivery stops at ``pos``; the entry is read again now and then."""
        new = self._failing_at != pos
        self._failing_at = pos
        self.read_error = (
            f"delivery stopped at segment {pos[0]} entry {pos[1]}: {exc} (corrupt_entry_policy"
            f" is 'fail': skip the damaged messages, reset the cursor or set the policy to"
            f" 'skip' to go on)"
        )
        if new:
            self._retry_delay = 0.0
            log.error(
                "delivery stopped at a damaged entry topic=%s sub=%s position=%s"
                " corrupt_entry_policy=fail error=%s",
                self.ledger.topic,
                self.name,
                pos,
                exc,
            )
        self._backoff(_FAIL_RETRY_S)

    async def _on_damaged(self, pos: Position, exc: CorruptEntry) -> bool:
        """The entry at ``pos`` (read in order) is on no replica intact."""
        try:
            run = await self.ledger.skip_damaged(pos)
        except PigeonError as err:
            self._read_failed(pos, err)
            return False
        # offsets below the run's end not read yet belong to its entries
        start = self._read_offset if self._read_offset is not None else self.cursor.mark_delete
        if self.cursor.all_acked(start, max(0, run.end_offset - start)):
            pass  # acknowledged already (an admin skipped them): nothing is lost here
        elif self.corrupt_entry_policy() == "fail":
            self._stop_at(pos, exc)
            return False
        lost = self._lose(start, run.end_offset)
        log.log(
            logging.ERROR if lost else logging.INFO,
            "skipping damaged entries topic=%s sub=%s segment=%s entries=%s..%s"
            " lost_messages=%s corrupt_entry_policy=%s error=%s",
            self.ledger.topic,
            self.name,
            run.segment_id,
            run.first_entry,
            run.last_entry,
            lost,
            self.corrupt_entry_policy(),
            exc,
        )
        self.read_position = run.next
        self._read_offset = run.end_offset
        self._read_ok()
        return True

    def _lose(self, start: int, end: int) -> int:
        """Acknowledge offsets ``[start, end)`` as lost; how many were not acked yet."""
        if end <= start:
            return 0
        lo = max(start, self.cursor.mark_delete)
        lost = max(0, end - lo) - (self.cursor.acked.count_in(lo, end) if end > lo else 0)
        self.cursor.ack_range(start, end)
        self.lost_messages += lost
        self._dirty = True
        return lost

    def _deliver(self, entries: list[Entry]) -> bool:
        """Push entries to consumers with permits; entries nobody can take are requeued."""
        batches: dict[int, tuple[Consumer, list[tuple[Entry, list[int]]]]] = {}
        delivered = False
        now = self.clock.now_ms() if self.type in ("shared", "keyShared") else 0
        if self.type == "keyShared":
            return self._deliver_key_shared(entries, now)
        for entry in entries:
            if self.cursor.all_acked(entry.first_offset, entry.num_messages):
                self.redeliveries.pop(entry.position, None)
                continue
            if entry.deliver_at > now and now:
                # Delayed delivery (shared subscriptions): hold the entry until it is due.
                # Nothing is persisted: after a restart it is read again from the cursor
                # and held again, so the tracker survives broker restarts.
                heapq.heappush(self._delayed, (entry.deliver_at, entry.position))
                continue
            consumer = self._pick()
            if consumer is None:
                heapq.heappush(self._redeliver, entry.position)
                continue
            acked = self.cursor.acked_indexes(entry.first_offset, entry.num_messages)
            consumer.permits -= entry.num_messages - len(acked)
            consumer.pending.add(entry.position)
            self.pending[entry.position] = _Pending(
                consumer, entry.first_offset, entry.num_messages
            )
            batches.setdefault(id(consumer), (consumer, []))[1].append((entry, acked))
            delivered = True
        for consumer, items in batches.values():
            self._push(consumer, items)
        return delivered

    def _push(self, consumer: Consumer, items: list[tuple[Entry, list[int]]]) -> None:
        group: list[tuple[Entry, list[int]]] = []
        size = 0
        for item in items:
            n = len(item[0].data)
            if group and size + n > _PUSH_MAX_BYTES:
                self._send(consumer, group)
                group, size = [], 0
            group.append(item)
            size += n
        if group:
            self._send(consumer, group)

    def _send(self, consumer: Consumer, group: list[tuple[Entry, list[int]]]) -> None:
        metas = []
        for entry, acked in group:
            metas.append(
                {
                    "segmentId": entry.segment_id,
                    "entryId": entry.entry_id,
                    "size": len(entry.data),
                    "redeliveryCount": self.redeliveries.get(entry.position, 0),
                    "ackedIndexes": acked,
                }
            )
            consumer.msgs_out += entry.num_messages
            self.msgs_out += entry.num_messages
        payload: bytes | memoryview = (
            group[0][0].data if len(group) == 1 else b"".join(e.data for e, _ in group)
        )
        consumer.bytes_out += len(payload)
        self.bytes_out += len(payload)
        try:
            consumer.conn.send_nowait(
                "message", {"consumerId": consumer.consumer_id, "entries": metas}, payload
            )
        except PigeonError:
            pass  # connection closing: the consumer's removal requeues its pending entries

    def backlog(self) -> int:
        return max(
            0, self.ledger.next_offset - self.cursor.mark_delete
        ) - self.cursor.acked.count_in(self.cursor.mark_delete, self.ledger.next_offset)

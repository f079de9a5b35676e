"""Subscriptions: a cursor plus the I/O around a dispatcher that pushes entries to consumers.

What goes to whom is decided by the subscription's :class:`~pigeon.broker._dispatch.Dispatcher`
(consumer choice per subscription type, key_shared ring and per-key order, delays,
redelivery, permits; no I/O).  ``Subscription`` only moves entries: it reads them from the
managed ledger (entries queued for redelivery first, then in order), hands them to the
dispatcher, pushes what it decided to the consumers' connections, and persists the cursor.

Dispatch works per *entry* (one producer batch), never per message: each entry goes whole
to one consumer together with the batch indexes it must skip, in frames of at most 1 MiB.

Reads that fail never end a subscription.  A retriable failure (bookies away) is retried
with backoff (0.1 s doubling to 5 s).  An entry no replica holds intact (CorruptEntry
from the ledger) is handled per the corrupt-entry policy: ``skip`` (the default) goes on
after the damaged run, acknowledging its messages as lost (counted in
``lost_messages``, logged once); ``fail`` stops delivery at that entry (``read_error``
says why, in the admin API) and reads it again every 5 s to 60 s, in case a replica came
back, until an admin skips the messages, resets the cursor or changes the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from pigeon.broker._cursor import CursorState
from pigeon.broker._dispatch import Delivery, Dispatcher, Pending
from pigeon.broker._ledger import ManagedLedger
from pigeon.broker._ledger_state import Entry, Position
from pigeon.core.batch import ENTRY_HEADER_SIZE, decode_batch
from pigeon.core.errors import (
    AckNotPersisted,
    BadVersion,
    CorruptEntry,
    EntryNotFound,
    InvalidArgument,
    MetadataError,
    NodeExists,
    NoSuchNode,
    NotOwner,
    PigeonError,
)
from pigeon.core.paths import cursor_path
from pigeon.core.rpc import frame_batch
from pigeon.core.runtime import WallClock

if TYPE_CHECKING:
    from pigeon.core.rpc import Connection

__all__ = ["CORRUPT_ENTRY_POLICIES", "Consumer", "Subscription", "take_cursor"]

log = logging.getLogger(__name__)

_PUSH_MAX_BYTES = 1024 * 1024
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
    #: dispatch state, kept by the dispatcher (see pigeon.broker._dispatch)
    permits: int = 0
    pending: set[Position] = field(default_factory=set)
    join_offset: int | None = None  # key_shared: recently joined
    msgs_out: int = 0
    bytes_out: int = 0

    @property
    def closed(self) -> bool:
        return self.conn.closed


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
        cursor_version: int | None = None,
    ) -> None:
        """``cursor_version``: the version of the stored cursor this broker took over
        (:func:`take_cursor`); None when it is not stored yet."""
        self.name = name
        self.ledger = ledger
        self.cursor = cursor
        self.durable = durable
        self.store = store
        self.persist_interval = persist_interval
        self.path = cursor_path(ledger.topic, name)
        self.codecs = codecs
        self.dispatcher: Dispatcher[Consumer, Entry] = Dispatcher(
            name,
            sub_type,
            cursor,
            partition_index=ledger.topic.partition_index,
            keys_of=self._keys_of,
        )
        self.read_position: Position | None = None
        self.clock = clock or WallClock()
        self._wakeup = trio.Event()
        self._dirty = False
        #: set when the cursor changes: wakes the task that writes it (``_persister``)
        self._dirty_set = trio.Event()
        self._persist_lock = trio.Lock()
        self._cursor_version = cursor_version
        #: changes of the cursor so far (acks, seeks, expiry), and how many of them the
        #: stored cursor holds
        self._changes = 0
        self._changes_stored = 0
        #: why this broker may no longer store the cursor (another one took it over)
        self.fenced: str | None = None
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
        #: read_compacted: the compacted view up to the horizon, then the log after it
        self.read_compacted = False
        #: while reading the compacted ledger: (its id, next entry id)
        self._compacted_from: tuple[int, int] | None = None
        #: the offset asked for when the cursor was created here (None: it was loaded);
        #: a read_compacted consumer starts there even if the log was trimmed past it
        self.requested_start: int | None = None

    # ------------------------------------------------------------------ dispatch state

    @property
    def type(self) -> str:
        return self.dispatcher.type

    @property
    def consumers(self) -> list[Consumer]:
        return self.dispatcher.consumers

    @property
    def pending(self) -> dict[Position, Pending[Consumer]]:
        """Entries delivered whole and not fully acknowledged (not key_shared)."""
        return self.dispatcher.pending

    @property
    def redeliveries(self) -> dict[Position, int]:
        return self.dispatcher.redeliveries

    @property
    def delayed_count(self) -> int:
        return self.dispatcher.delayed_count

    # ------------------------------------------------------------------ consumers

    def add_consumer(self, consumer: Consumer, sub_type: str) -> None:
        self.dispatcher.add_consumer(consumer, sub_type)
        if self.cursor.sub_type != self.dispatcher.type:
            # the type changed (a consumer joined it empty): stored with the cursor
            self.cursor.sub_type = self.dispatcher.type
            self._changed()
        self.wake()

    def remove_consumer(self, consumer: Consumer) -> None:
        self.dispatcher.remove_consumer(consumer)
        self.wake()

    def flow(self, consumer: Consumer, permits: int) -> None:
        self.dispatcher.flow(consumer, permits)
        self.wake()

    def wake(self) -> None:
        self._wakeup.set()

    def _keys_of(self, entry: Entry) -> list[bytes | None]:
        """key_shared: the key of each message (the dispatcher's ``keys_of``)."""
        try:
            batch = decode_batch(memoryview(entry.data)[ENTRY_HEADER_SIZE:], self.codecs)
            return batch.keys() if batch.has_keys else [None] * entry.num_messages
        except PigeonError as exc:
            log.warning("key_shared cannot read keys sub=%s error=%s", self.name, exc)
            return [None] * entry.num_messages

    # ------------------------------------------------------------------ acks

    def ack(
        self,
        consumer: Consumer | None,
        positions: list[tuple[Position, int]],
        cumulative: bool,
        runs: Sequence[tuple[Position, int, int]] = (),
    ) -> None:
        """``positions``: ((segment index, entry id), offset) of each acknowledged message;
        ``runs``: ((segment index, entry id), first offset, count) of runs of them."""
        self.dispatcher.ack(positions, cumulative, runs)
        self._changed()
        self.wake()

    def redeliver_unacked(self, consumer: Consumer, positions: list[Position] | None) -> None:
        self.dispatcher.redeliver_unacked(consumer, positions)
        self.wake()

    def expire_before(self, offset: int) -> None:
        """Acknowledge everything below ``offset`` (message TTL, backlog eviction)."""
        self.dispatcher.expire_before(offset)
        if self.read_error is not None:
            self._blocked_until = 0.0  # read the damaged entry again now: it may be skipped
        self._changed()
        self.wake()

    # ------------------------------------------------------------------ seeking

    async def seek_offset(self, offset: int) -> None:
        self.cursor.reset(offset)
        self.read_position = await self.ledger.position_for_offset(offset)
        self._reset_dispatch()

    async def seek_position(self, pos: Position, batch_index: int) -> None:
        entry = await self._read_again(pos)
        if entry is None:
            raise InvalidArgument(
                f"no message at segment {pos[0]} entry {pos[1]}: the log was trimmed past it"
                " and the compacted view does not hold it"
            )
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

    def enable_read_compacted(self) -> None:
        """A consumer with ``read_compacted`` attached: read the compacted view first
        (unless this subscription has read in order already)."""
        if not self.read_compacted:
            self.read_compacted = True
            if self._read_offset is None and not self.pending:
                c = getattr(self.ledger, "compacted", None)
                wanted = self.requested_start
                if c is not None and wanted is not None and wanted < self.cursor.mark_delete:
                    # a new cursor from before the log's (trimmed) start: the compacted
                    # view still holds what was there
                    self.cursor.reset(min(wanted, c.horizon))
                self._start_compacted()
                self.wake()

    def _start_compacted(self) -> None:
        c = getattr(self.ledger, "compacted", None)
        if self.read_compacted and c is not None and self.cursor.mark_delete < c.horizon:
            self._compacted_from = (c.id, 0)
        else:
            self._compacted_from = None

    def _reset_dispatch(self) -> None:
        self.dispatcher.reset()
        self._read_offset = None
        self._start_compacted()
        self._unblock()
        self._changed()
        self.wake()

    # ------------------------------------------------------------------ persistence

    @property
    def cursor_version(self) -> int | None:
        """The version of the stored cursor this subscription last wrote or took over
        (None: not stored yet); a stored cursor of another version was written by
        another broker, and this subscription's next write is refused (:meth:`persist`)."""
        return self._cursor_version

    def _changed(self) -> None:
        self._changes += 1
        self._mark_dirty()

    def _mark_dirty(self) -> None:
        self._dirty = True
        self._dirty_set.set()

    async def persist(self) -> None:
        """Write the cursor if it changed; one write at a time, so a caller that returns
        knows every change before its call is stored.

        Every write is a compare-and-set at the version this broker wrote (or took over
        when it loaded the subscription, see :func:`take_cursor`): a broker that lost the
        topic without knowing it yet (paused past its metadata session) finds the new
        owner's version there and stops (:attr:`fenced`) instead of storing acks the new
        owner would never see."""
        async with self._persist_lock:
            if not self.durable or self.store is None or not self._dirty or self.fenced:
                return
            self._dirty = False
            data = self.cursor.to_json()
            changes = self._changes
            try:
                if self._cursor_version is None:
                    await self.store.create(self.path, data)
                    self._cursor_version = 0
                else:
                    self._cursor_version = await self.store.set(
                        self.path, data, version=self._cursor_version
                    )
            except (BadVersion, NoSuchNode, NodeExists) as exc:
                self._mark_dirty()
                self._fence(exc)
                return
            except PigeonError as exc:
                self._mark_dirty()
                log.warning("cursor persist failed sub=%s error=%s", self.name, exc)
                return
            self._changes_stored = max(self._changes_stored, changes)

    def _fence(self, exc: PigeonError) -> None:
        """Another writer changed the stored cursor: this subscription stops here (its
        consumers are sent on, and load it again from the store)."""
        what = "deleted" if isinstance(exc, NoSuchNode) else "written by another broker"
        self.fenced = (
            f"the cursor of subscription {self.name!r} was {what} (the topic moved?);"
            " look the topic up again"
        )
        log.warning(
            "cursor fenced topic=%s sub=%s: %s",
            self.ledger.topic,
            self.name,
            self.fenced,
        )
        self.closed = True
        self.wake()

    async def persist_acks(self) -> None:
        """Return once every change of the cursor made before this call (an ack, a seek)
        is in the stored cursor (an ack receipt, a Kafka commit); AckNotPersisted if that
        cannot be confirmed."""
        if not self.durable or self.store is None:
            return  # a reader's cursor is not stored: nothing more to wait for
        changes = self._changes
        if self._changes_stored >= changes:
            return
        if self.closed:
            raise AckNotPersisted(
                self.fenced
                or f"subscription {self.name!r} was closed here before the acknowledgement"
                " was stored; the message may be delivered again"
            )
        await self.persist()
        if self._changes_stored < changes:
            raise AckNotPersisted(
                self.fenced
                or f"the cursor of subscription {self.name!r} could not be stored; the"
                " message may be delivered again"
            )

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

    async def run(self) -> None:
        """Dispatch loop: runs until the subscription is closed.

        It sleeps on its one wake-up event, which the ledger sets too when entries are
        stored (:meth:`ManagedLedger.watch_entries`): a stored entry is pushed in the next
        pass of the scheduler, and a wait starts no task. The cursor is written beside it
        (:meth:`_persister`): no delivery waits for a metadata-store write."""
        self.ledger.watch_entries(self.wake)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._persister)
                try:
                    await self._dispatch_loop()
                finally:
                    nursery.cancel_scope.cancel()  # a write under way ends first (shielded)
        finally:
            self.ledger.unwatch_entries(self.wake)
        await self.persist()
        if self.fenced:
            raise NotOwner(self.fenced)  # its consumers are sent on to look it up again

    async def _persister(self) -> None:
        """Write the cursor when it changed, at most every ``persist_interval``.

        A write (1 to 8 ms on the embedded store, measured) is shielded: once started it
        ends, so a change it took is never taken for stored while it is not."""
        if not self.durable or self.store is None:
            return  # a reader's cursor is not stored
        persist_at = 0.0
        while True:
            if not self._dirty:
                self._dirty_set = trio.Event()
                await self._dirty_set.wait()
            await trio.sleep_until(persist_at)
            with trio.CancelScope(shield=True):
                await self.persist()
            persist_at = trio.current_time() + self.persist_interval

    async def _dispatch_loop(self) -> None:
        while not self.closed:
            self.dispatcher.release_due(self.clock.now_ms())
            progressed = await self._dispatch_once()
            if progressed:
                await trio.lowlevel.checkpoint()
                continue
            # reset before looking: what happens from here on sets the new event
            if self._wakeup.is_set():
                self._wakeup = trio.Event()
            if self._has_work():
                continue
            timeout = float("inf")
            if self._blocked_until:
                timeout = min(timeout, max(0.0, self._blocked_until - trio.current_time()))
            due_ms = self.dispatcher.next_due_ms()
            if due_ms is not None:
                due_in = (due_ms - self.clock.now_ms()) / 1000
                timeout = min(timeout, max(0.0, due_in))
            with trio.move_on_after(timeout):
                await self._wakeup.wait()

    def _has_work(self) -> bool:
        if not self.dispatcher.ready() or self._blocked():
            return False
        if self.dispatcher.has_redeliveries or self._compacted_from is not None:
            return True
        return (
            self.read_position is not None and self.ledger.normalize(self.read_position) is not None
        )

    async def _dispatch_once(self) -> bool:
        if not self.dispatcher.ready() or self._blocked():
            return False
        if self.dispatcher.has_redeliveries:
            return await self._redeliver_some()
        if self._compacted_from is not None:
            return await self._dispatch_compacted()
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
            self._changed()
        last = entries[-1]
        self.read_position = self.ledger.next_position(last.position)
        self._read_offset = last.first_offset + last.num_messages
        self._deliver(entries)
        return True

    async def _dispatch_compacted(self) -> bool:
        """read_compacted: deliver the next entries of the compacted ledger.

        The offsets the compacted view leaves out (older messages of a key, tombstones,
        messages without a key) are acknowledged on the way, as a subscription reading
        the compacted view never gets them; after the last compacted entry the log is
        read from the horizon on.
        """
        assert self._compacted_from is not None
        c = self.ledger.compacted
        start = self._read_offset if self._read_offset is not None else self.cursor.mark_delete
        if c is None or start >= c.horizon:
            self._compacted_from = None
            if c is not None:
                self.read_position = await self.ledger.position_for_offset(start)
            return True
        ledger_id, entry_id = self._compacted_from
        if ledger_id != c.id:  # compacted again meanwhile: the new one holds the view
            entry_id = 0
        try:
            items = await self.ledger.read_compacted(c, entry_id, _READ_MAX_ENTRIES)
        except PigeonError as exc:
            self._read_failed(self.read_position or (c.id, entry_id), exc)
            return False
        self._read_ok()
        if not items:
            # the log goes on at the horizon (or where it starts, if trimmed past it)
            end = max(c.horizon, self.ledger.first_offset)
            if end > start:
                self.cursor.ack_range(start, end)
            self._changed()
            self._read_offset = end
            self.read_position = await self.ledger.position_for_offset(end)
            self._compacted_from = None
            return True
        entries: list[Entry] = []
        for item in items:
            entry = item.entry
            kept = [entry.first_offset + i for i in item.kept]
            if not kept or kept[-1] < start:
                continue
            for offset in kept:
                if offset > start:
                    self.cursor.ack_range(start, offset)
                start = max(start, offset + 1)
            end = entry.first_offset + entry.num_messages
            if end > start:
                self.cursor.ack_range(start, end)
            start = max(start, end)
            entries.append(entry)
        self._changed()
        self._read_offset = start
        self._compacted_from = (c.id, items[-1].entry_id + 1)
        self._deliver(entries)
        return True

    async def _redeliver_some(self) -> bool:
        """Read again what the dispatcher queued for redelivery and deliver it."""
        todo = self.dispatcher.take_redeliveries(_READ_MAX_ENTRIES)
        entries: list[Entry] = []
        skipped = False
        for k, pos in enumerate(todo):
            try:
                entry = await self._read_again(pos)
                if entry is None:  # superseded in the compacted view: not delivered again
                    offsets = self.dispatcher.drop_damaged(pos)
                    if offsets is not None:
                        self.cursor.ack_range(offsets[0], offsets[0] + offsets[1])
                        self._changed()
                    skipped = True
                    continue
                entries.append(entry)
            except CorruptEntry as exc:
                if self.corrupt_entry_policy() == "fail":
                    self.dispatcher.requeue(todo[k:])
                    self._stop_at(pos, exc)
                    break
                offsets = self.dispatcher.drop_damaged(pos)
                if offsets is not None:
                    self._lose(offsets[0], offsets[0] + offsets[1])
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
                self.dispatcher.requeue(todo[k:])
                self._read_failed(pos, exc)
                break
        if entries:
            self._read_ok()
        return self._deliver(entries) or bool(entries) or skipped

    async def _read_again(self, pos: Position) -> Entry | None:
        """The entry at ``pos`` for a redelivery.  A read_compacted subscription may have
        had it from the compacted ledger, the log trimmed since: read there again (None:
        a later compaction dropped it, a newer message of its key replaces it)."""
        try:
            return await self.ledger.read_one(pos)
        except EntryNotFound:
            c = self.ledger.compacted if self.read_compacted else None
            segments = self.ledger.segments
            if c is None or (segments and pos[0] >= segments[0].id):
                raise  # not trimmed: the log's answer stands
            return await self.ledger.read_compacted_at(c, pos)

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
        self._changed()
        return lost

    def _deliver(self, entries: list[Entry]) -> bool:
        """Hand entries to the dispatcher and push what it decided; True if any went out."""
        if not entries:
            return False
        deliveries = self.dispatcher.deliver(entries, self.clock.now_ms())
        by_consumer: dict[int, tuple[Consumer, list[Delivery[Consumer, Entry]]]] = {}
        for d in deliveries:
            by_consumer.setdefault(id(d.consumer), (d.consumer, []))[1].append(d)
        with frame_batch():  # one write per consumer connection, its writer not woken
            for consumer, items in by_consumer.values():
                self._push(consumer, items)
        return bool(deliveries)

    def _push(self, consumer: Consumer, items: list[Delivery[Consumer, Entry]]) -> None:
        group: list[Delivery[Consumer, Entry]] = []
        size = 0
        for item in items:
            n = len(item.entry.data)
            if group and size + n > _PUSH_MAX_BYTES:
                self._send(consumer, group)
                group, size = [], 0
            group.append(item)
            size += n
        if group:
            self._send(consumer, group)

    def _send(self, consumer: Consumer, group: list[Delivery[Consumer, Entry]]) -> None:
        metas = []
        payload: list[bytes | memoryview] = []  # the entries themselves, unjoined (§12)
        size = 0
        for d in group:
            entry = d.entry
            metas.append(
                {
                    "segmentId": entry.segment_id,
                    "entryId": entry.entry_id,
                    "size": len(entry.data),
                    "redeliveryCount": d.redelivery_count,
                    "ackedIndexes": d.skip,
                }
            )
            payload.append(entry.data)
            size += len(entry.data)
            consumer.msgs_out += entry.num_messages
            self.msgs_out += entry.num_messages
        consumer.bytes_out += size
        self.bytes_out += size
        try:
            consumer.conn.send_nowait(
                "message", {"consumerId": consumer.consumer_id, "entries": metas}, payload
            )
        except PigeonError:
            pass  # connection closing: the consumer's removal requeues its pending entries

    def storage_stats(self) -> dict[str, Any]:
        """The cursor and what it holds back, as the admin API reports them."""
        return {
            "backlog_bytes": self.ledger.bytes_after(self.cursor.mark_delete),
            "mark_delete_offset": self.cursor.mark_delete,
            "delayed": self.delayed_count,
            "dropped": 0,
            "lost_messages": self.lost_messages,
            "read_error": self.read_error,
        }

    def cursor_stats(self) -> dict[str, Any]:
        """The cursor's state in detail (the admin API's internal stats)."""
        return {
            "mark_delete_offset": self.cursor.mark_delete,
            "acked_ranges": [list(r) for r in self.cursor.acked.ranges()],
            "read_position": list(self.read_position) if self.read_position else None,
            "pending_entries": len(self.pending),
            "durable": bool(self.durable),
        }

    def backlog(self) -> int:
        return max(
            0, self.ledger.next_offset - self.cursor.mark_delete
        ) - self.cursor.acked.count_in(self.cursor.mark_delete, self.ledger.next_offset)


#: attempts to take a stored cursor over while other writers keep changing it
_TAKE_OVER_ROUNDS = 5


async def take_cursor(store: Any, path: str) -> tuple[CursorState, int] | None:
    """Load the cursor stored at ``path`` and make it this broker's: it is written back
    at the version read, so a broker that held it before (and may not know yet that it
    lost the topic) can no longer store it (its compare-and-set fails, see
    :meth:`Subscription.persist`).  ``(cursor, version)``, or None if none is stored."""
    for _ in range(_TAKE_OVER_ROUNDS):
        stat = await store.get(path)
        if stat is None:
            return None
        try:
            version = await store.set(path, stat.value, version=stat.version)
        except (BadVersion, NoSuchNode):
            continue  # written (or deleted) meanwhile: read it again
        return CursorState.from_json(stat.value), version
    raise MetadataError(f"the cursor at {path} kept changing while it was loaded; try again")

"""Dispatch decisions of a subscription, without I/O.

A :class:`Dispatcher` decides which consumer gets which entry; the trio side
(``pigeon.broker._subscription.Subscription``) reads entries from the managed ledger,
hands them over, sends what the dispatcher decided and persists the cursor.  Nothing here
awaits, reads a clock or touches a socket: the dispatcher is *told* about consumers
joining and leaving, permits, entries read, acknowledgements, redelivery requests and the
time, and it *answers* whether anything can be dispatched, which entries to read again,
and what to send to whom (a list of :class:`Delivery`).

Work is per entry (one producer batch), never per message (DESIGN §12): an entry goes
whole to one consumer together with the batch indexes that consumer must skip (already
acknowledged; for key_shared, also those owned by another consumer).  Only key_shared
looks at each message, because it must: each message's key picks its consumer.

State, all keyed by entry position ``(segment id, entry id)``:

* **permits** (on each consumer): messages the consumer can take.  An entry is handed to
  a consumer while its permit count is positive and costs the messages it carries, so
  the count goes below zero by less than one entry (Pulsar's flow control).
* **pending**: entries delivered and not fully acknowledged, per consumer.  When their
  consumer leaves (or asks for them again) they join the redelivery queue, their
  redelivery count + 1.
* **redelivery queue**: a heap of positions, read again before anything new.
* **delayed**: a heap of ``(deliver_at ms, position)`` for shared and key_shared
  subscriptions; due entries move to the redelivery queue, in order.
* **key_shared** (kept in :class:`pigeon.broker._dispatch_keys.KeyShared`): a
  consistent-hash ring (``RING_POINTS`` per consumer name, CRC-32 of each key); the
  parts of an entry pending on each consumer; entries *held* for a
  recently joined consumer, which gets nothing read after its arrival until the
  mark-delete offset passes everything dispatched before it, nor anything earlier while
  an earlier message of its key is out on another consumer or held; and a *stall*: when the
  consumer of any key in an entry cannot take it, dispatch waits instead of letting
  later keys overtake.

Subscription types: ``exclusive`` (one consumer), ``failover`` (consumers ordered by
priority desc, name, id; partition ``i`` goes to consumer ``i mod n``), ``shared``
(round-robin among consumers with permits) and ``keyShared``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pigeon.broker._cursor import CursorState
from pigeon.broker._dispatch_keys import HASH_RANGE, RING_POINTS, KeyShared, key_hash
from pigeon.core.errors import ConsumerBusy, NotSupported, SubscriptionBusy

__all__ = [
    "HASH_RANGE",
    "RING_POINTS",
    "Delivery",
    "DispatchConsumer",
    "DispatchStatistics",
    "DispatchEntry",
    "Dispatcher",
    "Pending",
    "Position",
    "joined_type",
]

Position = tuple[int, int]


def joined_type(name: str, current: str, requested: str, consumers: Sequence[object]) -> str:
    """The type of subscription ``name`` once a consumer asking for ``requested`` joins
    it: one without consumers takes the type asked for.  SubscriptionBusy or
    ConsumerBusy when the consumer cannot join."""
    if requested != current:
        if consumers:
            raise SubscriptionBusy(f"subscription {name!r} is {current}, not {requested}")
        current = requested
    if current == "exclusive" and consumers:
        raise ConsumerBusy(f"exclusive subscription {name!r} already has a consumer")
    return current


class DispatchEntry(Protocol):
    """What the dispatcher needs to know of an entry read from the ledger (it only reads
    these)."""

    position: Position
    first_offset: int
    num_messages: int
    deliver_at: int


class DispatchConsumer(Protocol):
    """A consumer as the dispatcher sees it: identity and order (which it only reads),
    and the dispatch state the dispatcher keeps on it (``permits``, ``pending``,
    ``join_offset``)."""

    consumer_id: int
    name: str
    priority: int

    @property
    def closed(self) -> bool:
        """The consumer's connection is gone (its removal follows): send it nothing."""
        ...

    permits: int
    pending: set[Position]
    #: key_shared, recently joined: nothing at or above this offset until mark-delete passes it
    join_offset: int | None


C = TypeVar("C", bound=DispatchConsumer)
E = TypeVar("E", bound=DispatchEntry)


@dataclass(slots=True)
class Pending(Generic[C]):
    """An entry delivered whole (not key_shared) and not fully acknowledged."""

    consumer: C
    first_offset: int
    count: int


@dataclass(frozen=True, slots=True)
class Delivery(Generic[C, E]):
    """Send ``entry`` to ``consumer``; the consumer skips the batch indexes in ``skip``."""

    consumer: C
    entry: E
    skip: list[int]
    redelivery_count: int


@dataclass(frozen=True, slots=True)
class DispatchStatistics:
    consumers: int
    #: entries delivered and not fully acknowledged (key_shared: entries with a part pending)
    pending_entries: int
    #: positions queued to be read again
    redelivery_queue: int
    #: entries held until their deliver-at time
    delayed: int
    #: key_shared: entries held for recently joined consumers
    held: int
    #: key_shared: highest offset ever dispatched
    max_dispatched: int
    stalled: bool


class Dispatcher(Generic[C, E]):
    """Dispatch state and decisions of one subscription (see the module docstring).

    ``keys_of(entry)`` gives the key of each message of an entry (key_shared only); it
    may decode the entry, which is why it is passed in rather than done here.
    """

    def __init__(
        self,
        name: str,
        sub_type: str,
        cursor: CursorState,
        *,
        partition_index: int = 0,
        keys_of: Callable[[E], Sequence[bytes | None]] | None = None,
    ) -> None:
        self.name = name
        self.type = sub_type
        self.cursor = cursor
        self.partition_index = max(partition_index, 0)
        self.keys_of = keys_of
        self.consumers: list[C] = []
        self.pending: dict[Position, Pending[C]] = {}
        self.redeliveries: dict[Position, int] = {}
        #: dispatch waits for a consumer (key_shared order): not ready until told more
        #: (consumers, permits, acks, redelivery requests, a seek)
        self.stalled = False
        #: key_shared: highest offset ever dispatched
        self.max_dispatched = -1
        self._rr = 0
        self._redeliver: list[Position] = []
        self._delayed: list[tuple[int, Position]] = []  # (deliver_at ms, position)
        # offsets (first, count) of entries queued for redelivery, to skip them if damaged
        self._redeliver_offsets: dict[Position, tuple[int, int]] = {}
        self._ks: KeyShared[C] = KeyShared(cursor)

    # ------------------------------------------------------------------ consumers

    def add_consumer(self, consumer: C, sub_type: str) -> None:
        self.type = joined_type(self.name, self.type, sub_type, self.consumers)
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
        self._ks.rebuild_ring(self.consumers)
        self.stalled = False
        if previous is not None and self.active_consumer() is not previous:
            # The active consumer changed: what the old one holds unacked moves over.
            self.redeliver_unacked(previous, None)

    def remove_consumer(self, consumer: C) -> None:
        self.stalled = False
        previous = self.active_consumer() if self.type == "failover" else None
        if consumer in self.consumers:
            self.consumers.remove(consumer)
            self._ks.rebuild_ring(self.consumers)
        if self.type == "keyShared":
            for pos in sorted(consumer.pending):
                self._ks.give_back(consumer, pos)
                self._requeue_counted(pos)
            consumer.pending.clear()
            self._release_held()
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
                self._redeliver_offsets[pos] = (p.first_offset, p.count)
                self._requeue_counted(pos)
        consumer.pending.clear()

    def active_consumer(self) -> C | None:
        """Exclusive/failover: the one consumer that receives.

        Failover consumers are ordered by (priority desc, name); partition ``i`` of a
        partitioned topic picks consumer ``i mod n`` of that order, so the partitions
        spread over the consumers and each partition has exactly one active consumer.
        """
        if not self.consumers:
            return None
        if self.type == "failover":
            return self.consumers[self.partition_index % len(self.consumers)]
        return self.consumers[0]

    def flow(self, consumer: C, permits: int) -> None:
        consumer.permits += permits
        self.stalled = False

    def statistics(self) -> DispatchStatistics:
        return DispatchStatistics(
            consumers=len(self.consumers),
            pending_entries=len(self.pending) + len(self._ks.pending),
            redelivery_queue=len(self._redeliver),
            delayed=len(self._delayed),
            held=len(self._ks.held),
            max_dispatched=self.max_dispatched,
            stalled=self.stalled,
        )

    # ------------------------------------------------------------------ what to read

    def ready(self) -> bool:
        """Some consumer could take an entry now (and dispatch is not stalled: entries
        handed back for want of a consumer are not read again until something changes)."""
        if self.stalled:
            return False
        rr = self._rr
        c = self._pick()
        self._rr = rr
        return c is not None

    @property
    def has_redeliveries(self) -> bool:
        return bool(self._redeliver)

    def take_redeliveries(self, limit: int) -> list[Position]:
        """Up to ``limit`` positions to read again (in position order) before anything new.

        Read them and pass the entries to :meth:`deliver`; hand back with
        :meth:`requeue` those that could not be read (or are not read yet).
        """
        out: list[Position] = []
        while self._redeliver and len(out) < limit:
            pos = heapq.heappop(self._redeliver)
            if pos not in self.pending:
                out.append(pos)
        return out

    def requeue(self, positions: Iterable[Position]) -> None:
        """Positions taken by :meth:`take_redeliveries` but not read: read them later."""
        for pos in positions:
            heapq.heappush(self._redeliver, pos)

    def drop_damaged(self, pos: Position) -> tuple[int, int] | None:
        """The entry at ``pos``, taken for redelivery, is damaged beyond repair and will
        not be redelivered; its offsets ``(first, count)`` if known."""
        self.redeliveries.pop(pos, None)
        return self._redeliver_offsets.pop(pos, None)

    # ------------------------------------------------------------------ time

    def release_due(self, now_ms: int) -> None:
        """Delayed entries whose time has come join the redelivery queue (in order)."""
        while self._delayed and self._delayed[0][0] <= now_ms:
            _at, pos = heapq.heappop(self._delayed)
            heapq.heappush(self._redeliver, pos)

    def next_due_ms(self) -> int | None:
        """When the first delayed entry is due (wall-clock ms), None without one."""
        return self._delayed[0][0] if self._delayed else None

    @property
    def delayed_count(self) -> int:
        return len(self._delayed)

    # ------------------------------------------------------------------ entries

    def deliver(self, entries: Sequence[E], now_ms: int) -> list[Delivery[C, E]]:
        """Entries read (in order, or again): who gets which.  Entries nobody can take
        now are queued for redelivery; fully acknowledged ones are dropped.

        Entries queued for redelivery while these were read (their consumer left or
        asked for them again) go first: entries after the head of the queue join it
        instead of overtaking it (per-key order on key_shared, log order on failover).
        """
        for entry in entries:
            self._redeliver_offsets.pop(entry.position, None)
        if self._redeliver and entries and entries[-1].position > self._redeliver[0]:
            head = self._redeliver[0]
            self.requeue(e.position for e in entries if e.position > head)
            entries = [e for e in entries if e.position <= head]
        if self.type == "keyShared":
            return self._deliver_key_shared(entries, now_ms)
        out: list[Delivery[C, E]] = []
        delays = self.type == "shared"
        for entry in entries:
            pos = entry.position
            first, n = entry.first_offset, entry.num_messages
            if self.cursor.all_acked(first, n):
                self.redeliveries.pop(pos, None)
                continue
            if delays and entry.deliver_at > now_ms:
                # Delayed delivery (shared subscriptions): hold the entry until it is due.
                # Nothing is persisted: after a restart it is read again from the cursor
                # and held again, so the tracker survives broker restarts.
                heapq.heappush(self._delayed, (entry.deliver_at, pos))
                continue
            consumer = self._pick()
            if consumer is None:
                heapq.heappush(self._redeliver, pos)
                continue
            acked = self.cursor.acked_indexes(first, n)
            consumer.permits -= n - len(acked)
            consumer.pending.add(pos)
            self.pending[pos] = Pending(consumer, first, n)
            out.append(Delivery(consumer, entry, acked, self.redeliveries.get(pos, 0)))
        return out

    def _pick(self) -> C | None:
        if not self.consumers:
            return None
        if self.type in ("exclusive", "failover"):
            c = self.active_consumer()
            return c if c is not None and c.permits > 0 and not c.closed else None
        n = len(self.consumers)
        for i in range(n):
            c = self.consumers[(self._rr + i) % n]
            if c.permits > 0 and not c.closed:
                self._rr = (self._rr + i + 1) % n
                return c
        return None

    # ------------------------------------------------------------------ acks

    def ack(
        self,
        positions: Sequence[tuple[Position, int]],
        cumulative: bool,
        runs: Sequence[tuple[Position, int, int]] = (),
    ) -> None:
        """``positions``: ((segment index, entry id), offset) of each acknowledged message;
        ``runs`` (individual acks only): ((segment index, entry id), first offset, count)
        of runs of consecutive messages of one entry, one cursor range each."""
        if cumulative and self.type in ("shared", "keyShared"):
            raise NotSupported(
                f"cumulative acknowledgement is not allowed on {self.type} subscription "
                f"{self.name!r}"
            )
        self.stalled = False
        if cumulative:
            self.cursor.ack_cumulative(max(offset for _pos, offset in positions))
            # an entry the acknowledged offset falls inside stays pending for its rest
            for pos in [
                p
                for p, pend in self.pending.items()
                if self.cursor.all_acked(pend.first_offset, pend.count)
            ]:
                self._settle(pos)
            return
        for pos, offset in positions:
            self.cursor.ack(offset)
            p = self.pending.get(pos)
            if p is not None and self.cursor.all_acked(p.first_offset, p.count):
                self._settle(pos)
        for pos, offset, count in runs:
            self.cursor.ack_range(offset, offset + count)
            p = self.pending.get(pos)
            if p is not None and self.cursor.all_acked(p.first_offset, p.count):
                self._settle(pos)
        # entries not pending (e.g. after a reconnect) are filtered when read again
        if self.type == "keyShared":
            settled = [pos for pos, _offset in positions] + [run[0] for run in runs]
            for pos in self._ks.settle(settled):
                # the count goes with the entry, not with a part: other parts may be
                # waiting to be delivered again
                self.redeliveries.pop(pos, None)
            self._release_held()

    def _settle(self, pos: Position) -> None:
        p = self.pending.pop(pos, None)
        if p is not None:
            p.consumer.pending.discard(pos)
        self.redeliveries.pop(pos, None)

    def redeliver_unacked(self, consumer: C, positions: Sequence[Position] | None) -> None:
        """Deliver again what ``consumer`` holds unacked (``positions`` of it, or all)."""
        self.stalled = False
        chosen = (
            sorted(consumer.pending)
            if not positions
            else [p for p in positions if p in consumer.pending]
        )
        for pos in chosen:
            consumer.pending.discard(pos)
            if self.type == "keyShared":
                self._ks.give_back(consumer, pos)
            p = self.pending.pop(pos, None)
            if p is not None:
                self._redeliver_offsets[pos] = (p.first_offset, p.count)
            self._requeue_counted(pos)
        if self.type == "keyShared":
            # what the consumer held no longer blocks its keys elsewhere
            self._release_held()

    def expire_before(self, offset: int) -> None:
        """Acknowledge everything below ``offset`` (message TTL, backlog eviction)."""
        self.stalled = False
        self.cursor.ack_cumulative(offset - 1)
        for pos in [
            p for p, pend in self.pending.items() if pend.first_offset + pend.count <= offset
        ]:
            self._settle(pos)

    def reset(self) -> None:
        """The cursor moved (seek): forget everything delivered, queued or held."""
        for c in self.consumers:
            c.pending.clear()
            c.join_offset = None
        self.pending.clear()
        self._ks.clear()
        self._redeliver.clear()
        self._delayed.clear()
        self.redeliveries.clear()
        self._redeliver_offsets.clear()
        self.stalled = False

    def _requeue_counted(self, pos: Position) -> None:
        self.redeliveries[pos] = self.redeliveries.get(pos, 0) + 1
        heapq.heappush(self._redeliver, pos)

    # ------------------------------------------------------------------ key_shared

    def owner_of(self, key: bytes | None) -> C | None:
        """key_shared: the consumer a key maps to (None without consumers)."""
        return self._ks.owner_of(key)

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
        for pos in self._ks.take_held():
            heapq.heappush(self._redeliver, pos)

    def _deliver_key_shared(self, entries: Sequence[E], now: int) -> list[Delivery[C, E]]:
        out: list[Delivery[C, E]] = []
        ks = self._ks
        for k, entry in enumerate(entries):
            pos = entry.position
            first, n = entry.first_offset, entry.num_messages
            if self.cursor.all_acked(first, n):
                self.redeliveries.pop(pos, None)
                continue
            if entry.deliver_at > now:
                heapq.heappush(self._delayed, (entry.deliver_at, pos))
                continue
            if not ks.ring:
                for rest in entries[k:]:
                    heapq.heappush(self._redeliver, rest.position)
                self.stalled = True
                break
            skip = set(self.cursor.acked_indexes(first, n)) | ks.out(pos)
            keys = self.keys_of(entry) if self.keys_of is not None else [None] * n
            hashes = [key_hash(key) for key in keys]
            groups = ks.route(hashes, n, skip)
            if any(c.permits <= 0 or c.closed for c in groups):
                # Order per key: wait for the consumer rather than skip ahead.
                for rest in entries[k:]:
                    heapq.heappush(self._redeliver, rest.position)
                self.stalled = True
                break
            md = self.cursor.mark_delete
            for c, idx in groups.items():
                if (
                    c.join_offset is not None
                    and md < c.join_offset
                    and (first + idx[-1] >= c.join_offset or ks.blocked(c, first, idx, hashes))
                ):
                    ks.hold(pos, (first, n), hashes)
                    continue
                c.permits -= len(idx)
                c.pending.add(pos)
                ks.give(c, pos, idx, (first, n), hashes)
                self.max_dispatched = max(self.max_dispatched, first + idx[-1])
                chosen = set(idx)
                others = [i for i in range(n) if i not in chosen]
                out.append(Delivery(c, entry, others, self.redeliveries.get(pos, 0)))
        return out

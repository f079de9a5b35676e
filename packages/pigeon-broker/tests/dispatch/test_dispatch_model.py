"""Dispatcher (pigeon.broker._dispatch): a stateful test against a model of who holds which
message.

The machine plays the subscription's part (reading entries in order or again, handing
them to the dispatcher, with consumers joining, leaving, granting permits, acknowledging
and asking for redelivery while a read is in flight) and checks every decision against a
model that knows, per message, whether it is acknowledged and which consumer holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from dispatch_fakes import NOW, FakeConsumer, FakeEntry, keys_of
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pigeon.broker import CursorState
from pigeon.broker._dispatch import Delivery, Dispatcher, Position
from pigeon.core.errors import ConsumerBusy, NotSupported, SubscriptionBusy

# ------------------------------------------------------------------ stateful

TYPES = ["exclusive", "failover", "shared", "keyShared"]
NAMES = ["a", "b", "c", "d"]
KEYS: list[bytes | None] = [None, b"x", b"y", b"z", b"w"]
READ_MAX = 3  # entries per read (the subscription reads up to 64)
MAX_ENTRY = 4  # messages per entry


class DispatchMachine(RuleBasedStateMachine):
    """A Dispatcher against a model of the log and of who holds which message.

    Checked on every decision: a message goes to at most one consumer at a time and is
    never sent again while held or once acknowledged; only to attached consumers with
    positive permits (which then fall by exactly what was sent); exclusive and failover
    send only to the active consumer; delayed entries not before their time; key_shared
    never sends a message while an earlier message of its key is held by another consumer
    or (if it is new) waiting to be delivered; a redelivered entry carries the number of
    times it was handed back.  Checked after each step: pending state agrees with the
    model; what a consumer gave back (leaving, failover switch, redelivery request) is
    read again before anything new; a stalled dispatcher does not re-read the same entries
    without news.  Checked at the end: with permits and time, every message is delivered
    and acknowledged (nothing stranded).
    """

    def __init__(self) -> None:
        super().__init__()
        self.log: list[FakeEntry] = []
        self.by_pos: dict[Position, FakeEntry] = {}
        self.key: list[bytes | None] = []  # per offset
        self.entry_at: list[FakeEntry] = []  # per offset
        self.consumers: list[FakeConsumer] = []  # attached (model)
        self.ids = 0
        self.now = NOW
        self.read_index = 0  # next log entry read in order
        self.in_flight: tuple[list[FakeEntry], bool] | None = None  # (entries, fresh read)
        # model, per message offset
        self.acked: set[int] = set()
        self.holder: dict[int, FakeConsumer] = {}
        self.delivered: set[int] = set()  # delivered at least once since the last seek
        self.handed_back: dict[int, int] = {}  # times held and given back
        self.awaiting: set[int] = set()  # given back, not delivered again yet
        self.nacked: set[int] = set()  # given back by request: own order given up
        self.entry_count: dict[Position, int] = {}  # times an entry was handed back
        self.granted: dict[int, int] = {}  # consumer id -> permits in the model
        self.noop_take: list[Position] | None = None  # last redelivery read sent nothing

    SUB_TYPE = "shared"  # one machine per subscription type, below

    @initialize(partition=st.integers(0, 3))
    def start(self, partition: int) -> None:
        self.type = sub_type = self.SUB_TYPE
        self.cursor = CursorState(0)
        self.d: Dispatcher[FakeConsumer, FakeEntry] = Dispatcher(
            "s", sub_type, self.cursor, partition_index=partition, keys_of=keys_of
        )
        self.partition = partition

    # ------------------------------------------------------------ model helpers

    @property
    def next_offset(self) -> int:
        return len(self.key)

    def news(self) -> None:
        """Something the dispatcher is told: a stalled dispatcher may try again."""
        self.noop_take = None

    def model_active(self) -> FakeConsumer | None:
        order = sorted(self.consumers, key=lambda c: (-c.priority, c.name, c.consumer_id))
        if not order or self.type in ("shared", "keyShared"):
            return None
        return order[self.partition % len(order)] if self.type == "failover" else order[0]

    def give_back(
        self, consumer: FakeConsumer, positions: set[Position] | None, nack: bool
    ) -> None:
        """The model of a consumer handing back what it holds (of ``positions``)."""
        mine = sorted(o for o, c in self.holder.items() if c is consumer)
        touched: set[Position] = set()
        for o in mine:
            pos = self.entry_at[o].position
            if positions is not None and pos not in positions:
                continue
            del self.holder[o]
            self.handed_back[o] = self.handed_back.get(o, 0) + 1
            self.awaiting.add(o)
            if nack:
                self.nacked.add(o)
            touched.add(pos)
        for pos in touched:
            self.entry_count[pos] = self.entry_count.get(pos, 0) + 1

    def ack_model(self, offsets: Sequence[int]) -> None:
        for o in offsets:
            self.acked.add(o)
            self.holder.pop(o, None)
            self.awaiting.discard(o)

    def held_by(self, consumer: FakeConsumer) -> list[int]:
        return sorted(o for o, c in self.holder.items() if c is consumer)

    # ------------------------------------------------------------ the log and time

    @rule(
        batches=st.lists(
            st.tuples(
                st.lists(st.sampled_from(KEYS), min_size=1, max_size=MAX_ENTRY),
                st.sampled_from([0, 0, 0, 50, 400]),
            ),
            min_size=1,
            max_size=3,
        )
    )
    def publish(self, batches: list[tuple[list[bytes | None], int]]) -> None:
        """Producers append entries: (the key of each message, delay in ms) each."""
        for keys, delay in batches:
            i = len(self.log)
            entry = FakeEntry(
                (1 + i // 3, i % 3),
                self.next_offset,
                len(keys),
                self.now + delay if delay else 0,
                tuple(keys),
            )
            self.log.append(entry)
            self.by_pos[entry.position] = entry
            self.key.extend(keys)
            self.entry_at.extend([entry] * len(keys))

    @rule(ms=st.sampled_from([10, 100, 500]))
    def tick(self, ms: int) -> None:
        self.now += ms
        self.d.release_due(self.now)

    # ------------------------------------------------------------ consumers

    @rule(
        name=st.sampled_from(NAMES),
        priority=st.integers(0, 2),
        other_type=st.sampled_from([False, False, False, True]),
        permits=st.integers(0, 8),
    )
    def subscribe(self, name: str, priority: int, other_type: bool, permits: int) -> None:
        """A consumer subscribes (and, as clients do, grants its first permits)."""
        self.ids += 1
        c = FakeConsumer(self.ids, name, priority)
        if other_type:
            # (an empty subscription takes the new type: a unit test covers that)
            if self.consumers:
                other = TYPES[(TYPES.index(self.type) + 1) % len(TYPES)]
                with pytest.raises(SubscriptionBusy):
                    self.d.add_consumer(c, other)
            return
        if self.type == "exclusive" and self.consumers:
            with pytest.raises(ConsumerBusy):
                self.d.add_consumer(c, self.type)
            return
        before = self.model_active()
        self.d.add_consumer(c, self.type)
        self.news()
        self.consumers.append(c)
        self.granted[c.consumer_id] = 0
        if before is not None and self.model_active() is not before:
            self.give_back(before, None, nack=False)
        if permits:
            self.d.flow(c, permits)
            self.granted[c.consumer_id] += permits

    @precondition(lambda self: self.consumers)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        self.remove(data.draw(st.sampled_from(self.consumers)))

    def remove(self, c: FakeConsumer) -> None:
        before = self.model_active()
        self.d.remove_consumer(c)
        self.news()
        self.consumers.remove(c)
        if before is not None and before is not c and before is not self.model_active():
            self.give_back(before, None, nack=False)
        self.give_back(c, None, nack=False)

    @precondition(lambda self: any(not c.closed for c in self.consumers))
    @rule(data=st.data())
    def connection_lost(self, data: st.DataObject) -> None:
        """The connection closes; the consumer's removal follows (rule ``leave``)."""
        c = data.draw(st.sampled_from([c for c in self.consumers if not c.closed]))
        c.closed = True

    @precondition(lambda self: self.consumers)
    @rule(data=st.data(), permits=st.integers(1, 6))
    def flow(self, data: st.DataObject, permits: int) -> None:
        c = data.draw(st.sampled_from(self.consumers))
        self.d.flow(c, permits)
        self.news()
        self.granted[c.consumer_id] += permits

    # ------------------------------------------------------------ acks

    @precondition(lambda self: self.delivered)
    @rule(data=st.data(), how=st.sampled_from(["one", "entry", "entry", "late"]))
    def ack(self, data: st.DataObject, how: str) -> None:
        """A consumer acknowledges one message it holds ("one"), everything it holds of
        an entry in one request ("entry"), or something delivered earlier, whoever holds
        it now ("late": a consumer that lost it to a failover switch still works on it)."""
        if how == "late" or not self.holder:
            o = data.draw(st.sampled_from(sorted(self.delivered)))
            acks = [o]
        else:
            o = data.draw(st.sampled_from(sorted(self.holder)))
            c, pos = self.holder[o], self.entry_at[o].position
            mine = [x for x in self.held_by(c) if self.entry_at[x].position == pos]
            acks = [o] if how == "one" else mine
        self.d.ack([(self.entry_at[x].position, x) for x in acks], cumulative=False)
        self.news()
        self.ack_model(acks)

    @precondition(lambda self: self.holder)
    @rule(data=st.data())
    def ack_cumulative(self, data: st.DataObject) -> None:
        o = data.draw(st.sampled_from(sorted(self.holder)))
        if self.type in ("shared", "keyShared"):
            with pytest.raises(NotSupported):
                self.d.ack([(self.entry_at[o].position, o)], cumulative=True)
            return
        self.d.ack([(self.entry_at[o].position, o)], cumulative=True)
        self.news()
        self.ack_model(range(o + 1))

    @precondition(lambda self: self.consumers)
    @rule(data=st.data(), everything=st.booleans())
    def redeliver_unacked(self, data: st.DataObject, everything: bool) -> None:
        """A negative ack or ack timeout: the consumer gives back some or all it holds."""
        c = data.draw(st.sampled_from(self.consumers))
        held = sorted({self.entry_at[o].position for o in self.held_by(c)})
        # (no positions, on the wire an empty list, means everything the consumer holds)
        chosen = (
            None
            if everything or not held
            else data.draw(st.sets(st.sampled_from(held), min_size=1))
        )
        self.d.redeliver_unacked(c, sorted(chosen) if chosen is not None else None)
        self.news()
        self.give_back(c, chosen, nack=True)

    @rule(offset=st.integers(0, 40), seek=st.booleans())
    def move_cursor(self, offset: int, seek: bool) -> None:
        """Message TTL or backlog eviction acknowledges everything below ``offset``; or
        a seek moves the cursor there (either way)."""
        offset = min(offset, self.next_offset)
        if not seek:
            self.d.expire_before(offset)
            self.news()
            self.ack_model(range(offset))
            return
        self.cursor.reset(offset)
        self.d.reset()
        self.news()
        self.in_flight = None  # the subscription reads from the new position
        self.read_index = next(
            (i for i, e in enumerate(self.log) if e.first_offset + e.num_messages > offset),
            len(self.log),
        )
        self.acked = set(range(offset))
        self.holder.clear()
        self.delivered.clear()
        self.handed_back.clear()
        self.awaiting.clear()
        self.nacked.clear()
        self.entry_count.clear()

    # ------------------------------------------------------------ reading and dispatching

    def read(self) -> bool:
        """What Subscription._dispatch_once does up to the read; False if nothing to read."""
        assert self.in_flight is None
        if not self.d.ready():
            return False
        todo = self.d.take_redeliveries(READ_MAX)
        if todo:
            if todo == self.noop_take:
                self.d.requeue(todo)
                raise AssertionError(
                    f"re-reading {todo} with nothing new since they were sent nowhere (busy loop)"
                )
            self.in_flight = ([self.by_pos[p] for p in todo], False)
            return True
        if self.read_index >= len(self.log):
            return False
        if self.type != "keyShared":
            waiting = sorted(self.awaiting - self.acked)
            assert not waiting, f"new entries read while {waiting} wait for redelivery"
        batch = self.log[self.read_index : self.read_index + READ_MAX]
        self.read_index += len(batch)
        self.in_flight = (batch, True)
        return True

    def deliver(self) -> list[Delivery]:
        assert self.in_flight is not None
        batch, fresh = self.in_flight
        self.in_flight = None
        out = self.d.deliver(batch, self.now)
        for x in out:
            self.check_delivery(x)
        if not fresh and not out:
            self.noop_take = [e.position for e in batch]
        elif out:
            self.noop_take = None
        return out

    def check_delivery(self, x: Delivery) -> None:
        c, entry = x.consumer, x.entry
        assert c in self.consumers and not c.closed, f"sent to a gone consumer {c.name}"
        assert self.granted[c.consumer_id] > 0, f"{c.name} had no permits"
        active = self.model_active()
        if self.type in ("exclusive", "failover"):
            assert c is active, f"{c.name} is not the active consumer"
        if self.type in ("shared", "keyShared"):
            assert entry.deliver_at <= self.now, "delayed entry sent early"
        sent_offsets = [
            entry.first_offset + i for i in range(entry.num_messages) if i not in x.skip
        ]
        assert sent_offsets, "an entry sent with nothing in it"
        if self.type != "keyShared":
            acked = [i for i in range(entry.num_messages) if entry.first_offset + i in self.acked]
            assert x.skip == acked, "the consumer must skip exactly the acknowledged messages"
        self.granted[c.consumer_id] -= len(sent_offsets)
        counts = [self.handed_back.get(o, 0) for o in sent_offsets]
        if self.type == "keyShared":
            # per entry: at least as often as any message in it was handed back
            assert x.redelivery_count >= max(counts), (x.redelivery_count, counts)
        else:
            expected = self.entry_count.get(entry.position, 0)
            assert x.redelivery_count == expected, (entry.position, x.redelivery_count, expected)
        for o in sent_offsets:
            assert o not in self.acked, f"acknowledged message {o} sent again"
            holder = self.holder.get(o)
            assert holder is None, f"message {o} sent to {c.name} while {holder.name} holds it"
            if self.type == "keyShared":
                self.check_key_order(c, o)
            elif o not in self.delivered:
                waiting = sorted(e for e in self.awaiting - self.acked if e < o)
                assert not waiting, f"new message {o} sent before {waiting} came back"
            self.holder[o] = c
            self.delivered.add(o)
            self.awaiting.discard(o)

    def check_key_order(self, c: FakeConsumer, o: int) -> None:
        k = self.key[o]
        for earlier in range(o):
            if self.key[earlier] != k or earlier in self.acked:
                continue
            holder = self.holder.get(earlier)
            if holder is not None:
                assert holder is c or o in self.nacked, (
                    f"key {k!r}: {o} sent to {c.name} while {earlier} is held by {holder.name}"
                )
            elif o not in self.delivered and self.entry_at[earlier].deliver_at <= self.now:
                assert o in self.nacked, (
                    f"key {k!r}: new message {o} sent to {c.name} before {earlier}"
                )

    @precondition(lambda self: self.in_flight is None)
    @rule(until_idle=st.booleans())
    def dispatch(self, until_idle: bool) -> None:
        """One round of the subscription's loop (read, deliver), or rounds until idle."""
        for _ in range(20 if until_idle else 1):
            if not self.read():
                break
            self.deliver()

    @precondition(lambda self: self.in_flight is None)
    @rule()
    def start_read(self) -> None:
        """A read that is still in flight while other rules run (the ledger awaits)."""
        self.read()

    @precondition(lambda self: self.in_flight is not None)
    @rule(data=st.data(), fail=st.booleans())
    def finish_read(self, data: st.DataObject, fail: bool) -> None:
        """The read completes; or reading entries again failed part way (``fail``), and
        what was not read goes back to the queue."""
        assert self.in_flight is not None
        batch, fresh = self.in_flight
        if fail and not fresh and batch:
            k = data.draw(st.integers(0, len(batch) - 1))
            self.d.requeue([e.position for e in batch[k:]])
            self.in_flight = (batch[:k], False)
            self.noop_take = None
        self.deliver()

    # ------------------------------------------------------------ invariants

    @invariant()
    def pending_agrees(self) -> None:
        if not hasattr(self, "d"):
            return
        for c in self.consumers:
            held = {self.entry_at[o].position for o in self.held_by(c)}
            why = f"pending on {c.name}: {sorted(c.pending)}, it holds {sorted(held)}"
            if self.type == "keyShared":
                assert c.pending >= held, why
            else:
                assert c.pending == held, why
                assert all(self.d.pending[p].consumer is c for p in held), why
        if self.type in ("exclusive", "failover"):
            active = self.model_active()
            assert all(p.consumer is active for p in self.d.pending.values()), (
                "something is pending on a consumer that is not the active one"
            )

    @invariant()
    def cursor_agrees(self) -> None:
        if hasattr(self, "d"):
            got = [o for o in range(self.next_offset) if self.cursor.is_acked(o)]
            assert got == sorted(self.acked), "cursor and model disagree on what is acked"

    @invariant()
    def permits_agree(self) -> None:
        for c in self.consumers:
            assert c.permits == self.granted[c.consumer_id], c.name
            assert c.permits > -MAX_ENTRY, "permits overshoot by more than one entry"

    # ------------------------------------------------------------ liveness

    def drain(self) -> None:
        """Give every consumer permits and time, acknowledge whatever arrives: every
        message must end up acknowledged (nothing is stranded)."""
        if self.in_flight is not None:
            self.deliver()
        for c in [c for c in self.consumers if c.closed]:
            self.remove(c)
        if not self.consumers:
            return
        self.now += 1000
        self.d.release_due(self.now)
        self.news()
        for _round in range(50):
            for c in self.consumers:
                self.d.flow(c, 100)
                self.granted[c.consumer_id] += 100
            for _step in range(200):
                if not self.read():
                    break
                self.deliver()
            for c in self.consumers:
                by_entry: dict[Position, list[int]] = {}
                for o in self.held_by(c):
                    by_entry.setdefault(self.entry_at[o].position, []).append(o)
                for pos, offsets in by_entry.items():
                    self.d.ack([(pos, o) for o in offsets], cumulative=False)
                    self.ack_model(offsets)
            self.news()
            if len(self.acked) >= self.next_offset and self.read_index >= len(self.log):
                break
        missing = sorted(set(range(self.next_offset)) - self.acked)
        assert not missing, f"messages never delivered: {missing}"
        assert self.cursor.mark_delete == self.next_offset, "cursor behind the model"

    @precondition(lambda self: self.consumers)
    @rule()
    def everything_arrives(self) -> None:
        self.drain()

    def teardown(self) -> None:
        if hasattr(self, "d"):
            self.drain()


class ExclusiveMachine(DispatchMachine):
    SUB_TYPE = "exclusive"


class FailoverMachine(DispatchMachine):
    SUB_TYPE = "failover"


class SharedMachine(DispatchMachine):
    SUB_TYPE = "shared"


class KeySharedMachine(DispatchMachine):
    SUB_TYPE = "keyShared"


MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=80, deadline=None)
TestExclusive = ExclusiveMachine.TestCase
TestFailover = FailoverMachine.TestCase
TestShared = SharedMachine.TestCase
TestKeyShared = KeySharedMachine.TestCase
TestExclusive.settings = TestFailover.settings = MACHINE_SETTINGS
TestShared.settings = TestKeyShared.settings = MACHINE_SETTINGS

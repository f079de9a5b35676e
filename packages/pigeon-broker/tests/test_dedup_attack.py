"""Hostile tests of de-duplication as the broker uses it (issue #12): sends held by the
``producer_request_hold`` backlog quota, resends whose original is in flight, failures
with earlier flights pending, and the state after a topic is unloaded and loaded again.

What a user would notice is checked: a producer's future that resolves successfully means
the message is in the log, in the producer's order, once; a duplicate receipt names the
stored original.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from standalone_support import PREFIX, consume_all, set_backlog_quota

from pigeon.broker._dedup import Decision, Deduplication
from pigeon.client._link import ProducerLink
from pigeon.core import TopicName
from pigeon.core._batch import read_header
from pigeon.core.errors import PigeonError, ServiceUnavailable

# ------------------------------------------------------------------ producer_request_hold


async def _holding_producer(cluster: Any, client: Any, topic_name: str) -> tuple[Any, Any]:
    """producer_request_hold over 1000 bytes of backlog; a producer (one message per
    entry, 60 s send timeout) that has stored ``m0``, and the broker's topic."""
    await set_backlog_quota(cluster, 1000, "producer_request_hold")
    producer = await client.create_producer(topic_name, batching_max_messages=1, send_timeout=60)
    await producer.send(b"m0")
    return producer, cluster.service.topics[TopicName.parse(topic_name).full]


async def test_a_send_after_a_held_one_is_not_stored_before_it(
    pigeon_standalone, client: Any, autojump_clock: Any
) -> None:
    """producer_request_hold: send A is held (backlog over the quota); the backlog drops
    (a consumer acknowledged) and send B of the same producer arrives before the held
    sends are released.  B must not overtake A.

    Before the fix: B was appended at once and A 50 ms later: the log had B before A,
    and de-duplication's persisted sequence jumped over A (which was still in flight)."""
    topic_name = PREFIX + "hold-order"
    producer, topic = await _holding_producer(pigeon_standalone, client, topic_name)
    sends = []

    def backlog_bytes() -> int:
        # over the quota for A's send; under it for B's (a consumer acknowledged
        # meanwhile); the held sends are released once B has arrived
        caller = sys._getframe(1).f_code.co_name
        if caller == "_send":
            sends.append(caller)
            return 10_000 if len(sends) == 1 else 0
        return 0 if len(sends) >= 2 or len(topic._held) >= 2 else 10_000

    topic.backlog_bytes = backlog_bytes
    answers: list[Any] = []
    await producer.send_async(b"A", callback=lambda m, e: answers.append(("A", m, e)))
    await producer.send_async(b"B", callback=lambda m, e: answers.append(("B", m, e)))
    with trio.fail_after(30):
        await producer.flush()
    assert [a[2] for a in answers] == [None, None]
    got = await consume_all(client, topic_name, 3)
    assert [m.value for m in got] == [b"m0", b"A", b"B"], "B overtook the held A"


async def test_a_held_send_refused_on_release_is_not_acknowledged_by_a_later_one(
    pigeon_standalone, client: Any, autojump_clock: Any
) -> None:
    """producer_request_hold: A and B are held; when they are released the ledger refuses
    A (it cannot write right now) and takes B.  A's resend must be stored, not answered
    "duplicate" because B's sequence id is persisted.

    Before the fix: the released B was appended although A had just failed (and the
    producer been fenced): persisted moved past A, A's resend was answered duplicate with
    position -1 -- acknowledged, never stored."""
    topic_name = PREFIX + "hold-refused"
    producer, topic = await _holding_producer(pigeon_standalone, client, topic_name)
    backlog = [10_000]
    topic.backlog_bytes = lambda: backlog[0]
    ledger = topic.ledger
    real = ledger.append_nowait
    refused: list[bool] = []

    def flaky(payload: Any, n: int, callback: Any, **kw: Any) -> None:
        if not refused and bytes(payload).endswith(b"A"):
            refused.append(True)
            raise ServiceUnavailable("the ledger cannot write right now")
        real(payload, n, callback, **kw)

    ledger.append_nowait = flaky  # type: ignore[method-assign]
    answers: list[Any] = []
    await producer.send_async(b"A", callback=lambda m, e: answers.append(("A", m, e)))
    await producer.send_async(b"B", callback=lambda m, e: answers.append(("B", m, e)))
    for _ in range(50):
        await trio.lowlevel.checkpoint()
        if len(topic._held) == 2:
            break
    assert len(topic._held) == 2, "A and B were not both held"
    backlog[0] = 0
    with trio.fail_after(30):
        await producer.flush()
    assert refused, "the refusal was never exercised"
    assert sorted(a[0] for a in answers if a[2] is None) == ["A", "B"]
    got = await consume_all(client, topic_name, 3)
    values = [m.value for m in got]
    assert b"A" in values, "A was acknowledged but never stored"
    assert values == [b"m0", b"A", b"B"]


# ------------------------------------------------------------------ the state class


def test_a_resend_batched_differently_gets_no_receipt_naming_another_entry() -> None:
    """A resend whose batch starts inside an earlier flight and ends inside a later one
    waits for the later one; its receipt must not name a position that is not its own
    (the later batch's entry with an offset shifted before that entry's first)."""
    d = Deduplication()
    d.pushed("p", 0, 5)  # messages 0..4
    d.pushed("p", 5, 5)  # messages 5..9
    assert d.check("p", 3, 5) is Decision.IN_FLIGHT  # messages 3..7
    answers: list[Any] = []
    d.wait("p", 3, 5, lambda r, e: answers.append((r, e)))
    d.persisted("p", 0, 5, (1, 0, 100))
    d.persisted("p", 5, 5, (1, 1, 105))
    assert len(answers) == 1
    receipt, error = answers[0]
    assert error is None
    if receipt is not None and receipt[1] == 1:
        assert receipt[2] >= 105, f"receipt names entry 1 with offset {receipt[2]} before it"


async def test_sends_held_when_the_topic_is_unloaded_are_answered_and_not_kept(
    pigeon_standalone, client: Any, autojump_clock: Any
) -> None:
    """producer_request_hold: the topic is unloaded while a send is held.  The held send
    is answered (a retriable error: the client resends it to the topic's next owner) and
    the unloaded topic keeps nothing: no held send, no task polling its backlog.

    Before the fix: the held sends stayed on the unloaded topic, and its release task
    polled the backlog every 50 ms for as long as the broker ran."""
    from pigeon.broker._admin_ops import unload_topic

    service = pigeon_standalone.service
    topic_name = PREFIX + "hold-unload"
    producer, old = await _holding_producer(pigeon_standalone, client, topic_name)
    old.backlog_bytes = lambda: 10_000
    answers: list[Any] = []
    await producer.send_async(b"A", callback=lambda m, e: answers.append((m, e)))
    for _ in range(50):
        await trio.lowlevel.checkpoint()
        if old._held:
            break
    assert old._held, "A was not held"
    await unload_topic(service, TopicName.parse(topic_name))
    await trio.sleep(1)
    assert old._held == [], "the unloaded topic still holds a send"
    with trio.fail_after(30):
        await producer.flush()
    assert [e for _m, e in answers] == [None]
    got = await consume_all(client, topic_name, 2)
    assert [m.value for m in got] == [b"m0", b"A"]


# ------------------------------------------------------------------ model-based: the send path
#
# The real ``NativeProtocol.on_send`` over the core (de-duplication, fencing, producer_request_hold)
# and the client's real ``ProducerLink`` (attach, resend, receipts), over a model of the network
# (answers in order per connection, lost with the connection) and of the ledger (stores in order,
# fails a suffix, refuses while unwritable, closes with some of what was pending stored but answered
# with an error), and of a topic unloaded (or its broker killed) and loaded again from the
# de-duplication snapshot plus a replay of the log.


class _Policies:
    def __init__(self) -> None:
        from pigeon.broker._policies import NamespacePolicies

        self.value = NamespacePolicies()

    def cached(self, _ns: Any) -> Any:
        return self.value


class _Conn:
    def __init__(self) -> None:
        self.closed = False
        self.outbox: list[tuple[str, Any, Any]] = []  # (kind, request id, fields/error)

    def respond(self, request_id: int, kind: str, fields: Any = None) -> None:
        if not self.closed:
            self.outbox.append((kind, request_id, fields))

    def respond_error(self, request_id: int, error: BaseException) -> None:
        if not self.closed:
            self.outbox.append(("error", request_id, error))

    def send_nowait(self, kind: str, fields: Any) -> None:
        if not self.closed:
            self.outbox.append((kind, 0, fields))


class _Req:
    def __init__(self, request_id: int, producer_id: int, batch: Any) -> None:
        from types import SimpleNamespace

        self.request_id = request_id
        self.body = SimpleNamespace(
            producerId=producer_id, sequenceId=batch.sequence_id, numMessages=batch.num_messages
        )
        self.payload = batch.payload


class _ModelTopic:
    """The parts of Topic that on_send uses, over a modelled ledger."""

    persistent = True

    def __init__(self, model: SendPathModel, incarnation: int) -> None:
        self.model = model
        self.incarnation = incarnation
        self.name = TopicName.parse("dedup-model")
        self.producers: dict[str, Any] = {}
        self.dedup = Deduplication(recent_entries=4)
        self._held: list[Any] = []
        self.pending: list[tuple[int, Any, int, Any]] = []  # (offset, batch, n, done)
        self.unavailable = False
        self.closed = False
        self.confirmed = -1  # index in the log of the last entry confirmed here

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def backlog_bytes(self) -> int:
        return 10_000 if self.model.over_quota else 0

    def hold(self, send: Any) -> None:
        self._held.append(send)

    def append(self, payload: bytes, n: int, callback: Any, *, deliver_at: int = 0) -> None:
        if self.closed:
            raise ServiceUnavailable("topic is closed")
        if self.unavailable:
            raise ServiceUnavailable("too few bookies")
        self.pending.append((self.model.next_offset, payload, n, callback))
        self.model.next_offset += n

    def confirm_sequence(self, segment_id: int, entry_id: int) -> None:
        self.confirmed = entry_id

    def may_find_original(self, name: str, first: int) -> bool:
        return False  # the model's log is not read back: unknown positions stay unknown

    def store_next(self) -> None:
        offset, payload, n, callback = self.pending.pop(0)
        receipt = self.model.store(payload, n, offset, self.incarnation)
        callback(receipt, None)

    def fail_from(self, k: int) -> None:
        failed, self.pending = self.pending[k:], self.pending[:k]
        if failed:
            self.model.next_offset = failed[0][0]
        for _offset, _payload, _n, callback in failed:
            callback(None, ServiceUnavailable("not stored"))


class SendPathModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        from pigeon.broker._native import NativeProtocol
        from pigeon.broker._producer_access import AccessControl
        from pigeon.broker._service import BrokerService

        self.svc = BrokerService.__new__(BrokerService)
        self.svc.access = AccessControl(None)  # shared producers only: the store is unused
        self.door = NativeProtocol(self.svc)
        self.svc.policies = _Policies()
        self.svc.policies.value.backlog_quota_bytes = 1000
        self.svc.policies.value.backlog_quota_policy = "producer_request_hold"
        self.svc.config = type("C", (), {"max_message_size": 5 << 20})()
        self.log: list[tuple[int, int, tuple[int, int, int]]] = []  # (first seq, n, receipt)
        self.next_offset = 0
        self.over_quota = False
        self.incarnations = 0
        self.topic = self._new_topic()
        self.snapshot: tuple[dict[str, int], int] = ({}, -1)
        # the client
        self.link = ProducerLink()
        self.next_seq = 0
        self.completed: dict[int, tuple[Any, Any]] = {}  # first seq -> (result, error)
        self.conn: _Conn | None = None
        self.requests: dict[int, tuple[int, Any]] = {}  # request id -> (epoch, batch)
        self.request_ids = itertools.count(1)
        self.producer_id = 7

    # ------------------------------------------------------------------ model helpers

    def _new_topic(self) -> _ModelTopic:
        self.incarnations += 1
        return _ModelTopic(self, self.incarnations)

    def store(self, payload: bytes, n: int, offset: int, incarnation: int) -> Any:
        first = read_header(payload).sequence_id
        receipt = (incarnation, len(self.log), offset)
        self.log.append((first, n, receipt))
        return receipt

    def _send(self, batch: Any, epoch: int) -> None:
        assert self.conn is not None and self.link.can_send(epoch)
        rid = next(self.request_ids)
        self.requests[rid] = (epoch, batch)
        try:
            self.door.on_send(self.conn, _Req(rid, self.producer_id, batch))
        except PigeonError as exc:  # Connection._handle answers it
            self.conn.respond_error(rid, exc)

    def _client_sees(self, kind: str, rid: int, body: Any) -> None:
        if kind == "closedByBroker":
            self.link.detach(self.link.epoch)
            return
        epoch, batch = self.requests[rid]
        if kind == "error":
            self.link.on_result(epoch, batch, None, body)
        else:
            result = (body["segmentId"], body["entryId"], body["firstOffset"])
            self.link.on_result(epoch, batch, result, None)

    # ------------------------------------------------------------------ client rules

    @rule(count=st.integers(1, 3))
    def send_new(self, count: int) -> None:
        from types import SimpleNamespace

        from pigeon.core._codecs import NONE
        from pigeon.core.batch import encode_batch

        first = self.next_seq
        self.next_seq += count
        payload = encode_batch(
            [b"x"] * count, producer_name="p", sequence_id=first, publish_time=1, codec=NONE
        )
        batch = SimpleNamespace(sequence_id=first, num_messages=count, payload=payload, created=0.0)
        batch.callback = lambda r, e, f=first: self.completed.__setitem__(f, (r, e))
        if self.link.submit(batch):
            self._send(batch, self.link.epoch)

    @precondition(lambda self: self.link.state.value == "detached")
    @rule()
    def attach(self) -> None:
        from pigeon.broker._native import _ConnState
        from pigeon.broker._topic import Producer

        epoch = self.link.begin_attach()
        if self.conn is None or self.conn.closed:
            self.conn = _Conn()
            self.door.conns[self.conn] = _ConnState()
        if self.topic.closed:
            self.link.attach_failed(epoch)
            return
        producer = Producer(self.conn, self.producer_id, "p", self.topic)  # type: ignore[arg-type]
        self.topic.producers["p"] = producer
        self.door.conns[self.conn].producers[self.producer_id] = producer
        for batch in self.link.attach_succeeded(epoch) or ():
            self._send(batch, epoch)

    @precondition(lambda self: self.conn is not None and self.conn.outbox)
    @rule()
    def deliver(self) -> None:
        assert self.conn is not None
        kind, rid, body = self.conn.outbox.pop(0)
        self._client_sees(kind, rid, body)

    @precondition(lambda self: self.conn is not None and not self.conn.closed)
    @rule()
    def drop_connection(self) -> None:
        assert self.conn is not None
        self.conn.closed = True
        self.conn.outbox.clear()
        self.door.connection_closed(self.conn)  # type: ignore[arg-type]
        self.link.detach(self.link.epoch)

    # ------------------------------------------------------------------ broker rules

    @precondition(lambda self: self.topic.pending)
    @rule()
    def ledger_stores(self) -> None:
        self.topic.store_next()

    @precondition(lambda self: self.topic.pending)
    @rule(data=st.data())
    def ledger_fails_a_suffix(self, data: st.DataObject) -> None:
        self.topic.fail_from(data.draw(st.integers(0, len(self.topic.pending) - 1)))

    @rule()
    def toggle_unavailable(self) -> None:
        self.topic.unavailable = not self.topic.unavailable

    @rule()
    def toggle_backlog(self) -> None:
        self.over_quota = not self.over_quota

    @precondition(lambda self: self.topic._held)
    @rule()
    def release_held(self) -> None:
        if self.over_quota and not self.topic.closed:
            return
        held, self.topic._held = self.topic._held, []
        for send in held:
            send()

    @rule()
    def snapshot_dedup(self) -> None:
        self.snapshot = (self.topic.dedup.persisted_map(), self.topic.confirmed)

    @rule(stored=st.integers(0, 3), crash=st.booleans())
    def reload_topic(self, stored: int, crash: bool) -> None:
        """Unload (or the broker dies): clients are disconnected, the ledger closes with
        the first ``stored`` pending appends stored but answered with an error (or, on a
        crash, not answered at all), the rest lost; the topic is loaded again from the
        snapshot and a replay of the log after it."""
        old = self.topic
        if self.conn is not None and not self.conn.closed:
            self.drop_connection()
        old.closed = True
        for offset, payload, n, callback in old.pending[:stored]:
            self.store(payload, n, offset, old.incarnation)
            if not crash:
                callback(None, ServiceUnavailable("topic was closed"))
        rest = old.pending[stored:]
        old.pending = []
        if rest:
            self.next_offset = rest[0][0]
        if not crash:
            for _o, _p, _n, callback in rest:
                callback(None, ServiceUnavailable("topic was closed"))
            held, old._held = old._held, []
            for send in held:
                send()
            self.snapshot = (old.dedup.persisted_map(), old.confirmed)
        new = self._new_topic()
        persisted, position = self.snapshot
        new.dedup.restore(persisted)
        new.dedup.replay(("p", first, n, receipt) for first, n, receipt in self.log[position + 1 :])
        new.confirmed = len(self.log) - 1
        self.topic = new

    # ------------------------------------------------------------------ invariants

    @invariant()
    def acknowledged_means_stored_once_in_order(self) -> None:
        firsts = [first for first, _n, _r in self.log]
        assert firsts == sorted(set(firsts)), f"log out of order or duplicated: {firsts}"
        stored = {first: (n, i) for i, (first, n, _r) in enumerate(self.log)}
        for first, (result, error) in self.completed.items():
            if error is not None:
                continue
            assert first in stored, f"batch {first} acknowledged, not in the log {firsts}"
            if result[1] >= 0:
                assert result[1] == stored[first][1], f"receipt of {first} names another entry"

    def teardown(self) -> None:
        # everything heals: every batch completes, successfully
        self.over_quota = False
        self.topic.unavailable = False
        for _ in range(500):
            if not self.link.pending:
                break
            if self.link.state.value == "detached":
                self.attach()
            elif self.conn is not None and self.conn.outbox:
                self.deliver()
            elif self.topic._held:
                self.release_held()
            elif self.topic.pending:
                self.ledger_stores()
            else:
                # nothing moves: the client waits on an answer that will never come
                waiting = [b.sequence_id for b in self.link.pending.values() if b.outcome is None]
                raise AssertionError(f"wedged: batches {waiting} wait forever")
            self.acknowledged_means_stored_once_in_order()
        assert not self.link.pending, "batches still pending after 500 healing steps"
        assert all(e is None for _r, e in self.completed.values()), self.completed


SendPathModel.TestCase.settings = settings(
    max_examples=int(__import__("os").environ.get("ATTACK_EXAMPLES", "300")),
    stateful_step_count=40,
    deadline=None,
)
test_send_path_model = SendPathModel.TestCase


def _deliver_one(m: SendPathModel) -> None:
    if m.conn is not None and m.conn.outbox:
        m.deliver()


def test_a_resend_waiting_on_a_lost_original_fences_its_attachment() -> None:
    """Found by the model: b0 is in flight when the connection drops; after the
    re-attach, the client resends b0 (it waits for the original) and sends b1.  The
    original b0 fails, then b1 is stored.  b0's resend must be stored, never answered as a
    duplicate of b1.

    Before the fix: the failure of b0 fenced only the producer of the dropped connection;
    b1, sent on the new attachment before the client saw b0's error, was stored; b0's next
    resend waited on b1's flight and was answered "duplicate" (-1): acknowledged, lost."""
    m = SendPathModel()
    m.attach()
    m.send_new(1)  # b0, appended
    m.drop_connection()
    m.attach()  # b0 resent: waits for the original
    m.topic.fail_from(0)  # the original b0 is not stored
    m.send_new(1)  # b1 goes out before the client saw b0's error
    m.deliver()
    m.attach()
    m.ledger_stores()
    m.teardown()


def test_a_late_failure_of_a_held_send_does_not_undo_its_resend() -> None:
    """Found by the model: b1 is held (backlog over the quota) when the failure of an
    earlier b0 settles it; after the re-attach both are resent (held behind it).  When the
    held sends are released, the stale b1 fails (its producer was fenced); that failure
    must not drop the *resend's* flight, or a further resend of b1 is stored twice.

    Before the fix: Deduplication.failed matched flights by sequence ids only."""
    m = SendPathModel()
    m.attach()
    m.send_new(1)  # b0, appended
    m.drop_connection()
    m.over_quota = True
    m.send_new(1)  # b1: pending on the client
    m.attach()  # b0 resent (waits), b1 held
    m.topic.fail_from(0)
    _deliver_one(m)
    m.attach()  # b0 and b1 resent: held behind the stale b1
    _deliver_one(m)
    m.drop_connection()
    m.attach()
    m.drop_connection()
    m.teardown()

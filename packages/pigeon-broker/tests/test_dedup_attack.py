"""Hostile tests of de-duplication as the broker uses it (issue #12): sends held by the
``producer_request_hold`` backlog quota, resends whose original is in flight, failures
with earlier flights pending, and the state after a topic is unloaded and loaded again.

What a user would notice is checked: a producer's future that resolves successfully means
the message is in the log, in the producer's order, once; a duplicate receipt names the
stored original.
"""

from __future__ import annotations

import sys
from typing import Any

import trio

from pigeon.broker._dedup import Decision, Deduplication
from pigeon.client.trio import Client
from pigeon.core import TopicName
from pigeon.core.errors import ServiceUnavailable

NS = "public/default"
PREFIX = "persistent://public/default/"


async def _read_all(client: Client, topic: str, n: int) -> list[Any]:
    consumer = await client.subscribe(topic, "check", initial_position="earliest")
    out: list[Any] = []
    with trio.move_on_after(30):
        while len(out) < n:
            out.extend(await consumer.batch_receive(n - len(out)))
    with trio.move_on_after(1):
        while True:
            out.extend(await consumer.batch_receive(100))
    await consumer.close()
    return out


# ------------------------------------------------------------------ producer_request_hold


async def test_a_send_after_a_held_one_is_not_stored_before_it(
    pigeon_standalone: Any, autojump_clock: Any
) -> None:
    """producer_request_hold: send A is held (backlog over the quota); the backlog drops
    (a consumer acknowledged) and send B of the same producer arrives before the held
    sends are released.  B must not overtake A.

    Before the fix: B was appended at once and A 50 ms later: the log had B before A,
    and de-duplication's persisted sequence jumped over A (which was still in flight)."""
    service = pigeon_standalone.service
    topic_name = PREFIX + "hold-order"
    await service.policies.set(
        NS, {"backlog_quota_bytes": 1000, "backlog_quota_policy": "producer_request_hold"}
    )
    async with Client(pigeon_standalone.url) as client:
        producer = await client.create_producer(
            topic_name, batching_max_messages=1, send_timeout=60
        )
        await producer.send(b"m0")
        topic = service.topics[TopicName.parse(topic_name).full]
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
        got = await _read_all(client, topic_name, 3)
        assert [m.value for m in got] == [b"m0", b"A", b"B"], "B overtook the held A"


async def test_a_held_send_refused_on_release_is_not_acknowledged_by_a_later_one(
    pigeon_standalone: Any, autojump_clock: Any
) -> None:
    """producer_request_hold: A and B are held; when they are released the ledger refuses
    A (it cannot write right now) and takes B.  A's resend must be stored, not answered
    "duplicate" because B's sequence id is persisted.

    Before the fix: the released B was appended although A had just failed (and the
    producer been fenced): persisted moved past A, A's resend was answered duplicate with
    position -1 -- acknowledged, never stored."""
    service = pigeon_standalone.service
    topic_name = PREFIX + "hold-refused"
    await service.policies.set(
        NS, {"backlog_quota_bytes": 1000, "backlog_quota_policy": "producer_request_hold"}
    )
    async with Client(pigeon_standalone.url) as client:
        producer = await client.create_producer(
            topic_name, batching_max_messages=1, send_timeout=60
        )
        await producer.send(b"m0")
        topic = service.topics[TopicName.parse(topic_name).full]
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
        got = await _read_all(client, topic_name, 3)
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
    pigeon_standalone: Any, autojump_clock: Any
) -> None:
    """producer_request_hold: the topic is unloaded while a send is held.  The held send
    is answered (a retriable error: the client resends it to the topic's next owner) and
    the unloaded topic keeps nothing: no held send, no task polling its backlog.

    Before the fix: the held sends stayed on the unloaded topic, and its release task
    polled the backlog every 50 ms for as long as the broker ran."""
    from pigeon.broker._admin_ops import unload_topic

    service = pigeon_standalone.service
    topic_name = PREFIX + "hold-unload"
    await service.policies.set(
        NS, {"backlog_quota_bytes": 1000, "backlog_quota_policy": "producer_request_hold"}
    )
    async with Client(pigeon_standalone.url) as client:
        producer = await client.create_producer(
            topic_name, batching_max_messages=1, send_timeout=60
        )
        await producer.send(b"m0")
        old = service.topics[TopicName.parse(topic_name).full]
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
        got = await _read_all(client, topic_name, 2)
        assert [m.value for m in got] == [b"m0", b"A"]

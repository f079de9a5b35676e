"""Acknowledged sends are stored (issue #12, mechanisms 1 and 7), through a real client
and an in-process standalone: a send the ledger refuses or loses is resent by the client
and stored once, in order; its receipt names where it is; offsets stay dense."""

from __future__ import annotations

from standalone_support import consume_all

from pigeon.core import TopicName
from pigeon.core.errors import ServiceUnavailable

TOPIC = "persistent://public/default/safety"


async def test_a_refused_append_is_resent_and_stored_not_answered_as_duplicate(
    pigeon_standalone, client, autojump_clock
):
    """Before the fix: the broker raised the producer's sequence id before the append,
    the ledger refused it synchronously, and the resend was answered `duplicate` with
    position -1: acknowledged, never stored."""
    service = pigeon_standalone.service
    producer = await client.create_producer(TOPIC, batching_max_messages=1)
    await producer.send(b"m0")
    topic = service.topics[TopicName.parse(TOPIC).full]
    real = topic.ledger.append_nowait
    refused = []

    def flaky(payload, n, callback, **kw):  # type: ignore[no-untyped-def]
        if not refused:
            refused.append(True)
            raise ServiceUnavailable("the ledger cannot write right now")
        return real(payload, n, callback, **kw)

    topic.ledger.append_nowait = flaky
    ids = [await producer.send(f"m{i}".encode()) for i in range(1, 6)]
    assert refused, "the refusal was never exercised"
    assert all(i.segment_id >= 0 and i.entry_id >= 0 for i in ids), ids
    got = await consume_all(client, TOPIC, 6)
    assert [m.value for m in got] == [f"m{i}".encode() for i in range(6)]
    assert [m.offset for m in got] == list(range(6)), "offsets must stay dense"
    assert [m.message_id for m in got[1:]] == ids


async def test_a_lost_write_with_later_sends_in_flight_keeps_order_and_loses_nothing(
    pigeon_standalone, client, autojump_clock
):
    """The writer fails with several batches of one producer in flight: every one is
    stored exactly once, in the producer's order."""
    service = pigeon_standalone.service
    producer = await client.create_producer(TOPIC + "-2", batching_max_messages=1)
    await producer.send(b"warm-up")
    ledger = service.topics[TopicName.parse(TOPIC + "-2").full].ledger
    answers: list = []

    def done(msg_id, error):  # type: ignore[no-untyped-def]
        answers.append((msg_id, error))

    for i in range(20):
        await producer.send_async(f"x{i}".encode(), callback=done)
    # the writer fails under the in-flight batches (as when a bookie dies)
    ledger._writer.abort(ServiceUnavailable("bookie went away"))
    for i in range(20, 40):
        await producer.send_async(f"x{i}".encode(), callback=done)
    await producer.flush()
    assert len(answers) == 40
    assert [e for _m, e in answers if e is not None] == []
    got = await consume_all(client, TOPIC + "-2", 41)
    values = [m.value for m in got]
    assert values == [b"warm-up"] + [f"x{i}".encode() for i in range(40)]
    assert [m.offset for m in got] == list(range(41))

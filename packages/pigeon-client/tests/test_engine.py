"""The engine's re-attach loop (``_engine.Reconnecting``, run by the producer and consumer
engines): producers and consumers re-attach until they succeed, and lose nothing
acknowledged (issue #12, mechanisms 3 and 4), against an in-process standalone in virtual
time.

* A topic unloaded again and again under a producer that keeps sending: every
  acknowledged message is stored once, in order (the old client sent new batches on the
  old connection while it re-attached; the newer ones reached the reloaded topic first
  and the older ones were then answered ``duplicate``: acknowledged, never stored).
* A re-attach that fails (the broker cannot reach a bookie, is not the owner yet, a
  metadata race, an internal error) is retried with backoff: the consumer receives again,
  the producer's messages are delivered (the old consumer set its connection before the
  subscribe succeeded and then waited on it forever).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from pigeon.broker._admin_ops import unload_topic
from pigeon.client.trio import Client
from pigeon.core import TopicName
from pigeon.core.errors import (
    NoSuchNode,
    NotOwner,
    PigeonError,
    SegmentFenced,
    ServiceUnavailable,
    StorageError,
    Timeout,
)

PREFIX = "persistent://public/default/"


async def read_values(client: Client, topic: str) -> list[bytes]:
    reader = await client.create_reader(topic, "earliest")
    out: list[bytes] = []
    while True:
        try:
            out.extend(m.value for m in await reader.batch_receive(1000, timeout=2.0))
        except Timeout:
            break
    await reader.close()
    return out


async def receive_until(consumer: Any, value: bytes, within: float = 30.0) -> bool:
    with trio.move_on_after(within):
        while (await consumer.receive()).value != value:
            pass
        return True
    return False


async def unload(service: Any, topic: str) -> None:
    await unload_topic(service, TopicName.parse(PREFIX + topic))


# ----------------------------------------------------------------------------- producer


@pytest.mark.parametrize("batch", [1, 20])
async def test_unloads_under_a_sending_producer_lose_no_acknowledged_message(
    pigeon_standalone, autojump_clock, batch: int
):
    service = pigeon_standalone.service
    topic = f"unloaded-{batch}"
    acked: list[int] = []
    failed: list[tuple[int, BaseException]] = []

    def done(i: int) -> Any:
        def callback(msg_id: Any, error: BaseException | None) -> None:
            if error is None:
                acked.append(i)
            else:
                failed.append((i, error))

        return callback

    async with Client(pigeon_standalone.url) as client:
        producer = await client.create_producer(
            topic, batching_max_messages=batch, batching_max_delay_ms=1
        )
        unloads = 0

        async def unloader() -> None:
            nonlocal unloads
            for _ in range(12):
                await trio.sleep(0.013)
                await unload(service, topic)
                unloads += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(unloader)
            for i in range(2000):
                await producer.send_async(f"{i:06d}".encode(), callback=done(i))
                if i % 5 == 0:
                    await trio.sleep(0.0005)
        await producer.flush()
        await producer.close()
        assert unloads == 12
        got = [int(v) for v in await read_values(client, topic)]
    assert failed == []
    assert sorted(acked) == list(range(2000))
    missing = sorted(set(acked) - set(got))
    assert missing == [], f"{len(missing)} acknowledged messages lost, first {missing[:5]}"
    assert len(got) == len(set(got)), "a message was stored twice"
    assert got == sorted(got), "messages stored out of the producer's order"


async def test_batches_sent_while_reattaching_do_not_overtake_the_waiting_ones(
    pigeon_standalone, autojump_clock, monkeypatch
):
    """Sends refused by the unloaded topic wait; the broker then registers the
    re-attached producer but its answer is still on the way: the old client sent new
    batches meanwhile, they were stored first, and the older waiting batches, resent after
    the answer, were answered ``duplicate`` (lost)."""
    service = pigeon_standalone.service
    real = service.native._create_producer
    attaches = [0]

    async def slow_answer(conn: Any, request_id: int, *args: Any) -> None:
        attaches[0] += 1
        if attaches[0] == 1:
            return await real(conn, request_id, *args)
        respond = conn.respond

        async def later(*answer: Any) -> None:
            await trio.sleep(0.05)
            respond(*answer)

        def delayed(rid: int, *rest: Any) -> None:
            if rid == request_id:
                service.nursery.start_soon(later, rid, *rest)
            else:
                respond(rid, *rest)

        await trio.sleep(0.02)  # sends meanwhile reach the unloaded topic: refused
        conn.respond = delayed
        try:
            return await real(conn, request_id, *args)
        finally:
            del conn.respond

    monkeypatch.setattr(service.native, "_create_producer", slow_answer)
    acked: list[int] = []
    async with Client(pigeon_standalone.url) as client:
        producer = await client.create_producer("overtake", batching_max_messages=1)
        async with trio.open_nursery() as nursery:

            async def unloader() -> None:
                for _ in range(3):
                    await trio.sleep(0.1)
                    await unload(service, "overtake")

            nursery.start_soon(unloader)
            for i in range(400):
                await producer.send_async(
                    str(i).encode(),
                    callback=lambda m, e, i=i: acked.append(i) if e is None else None,
                )
                await trio.sleep(0.001)
        await producer.flush()
        await producer.close()
        got = [int(v) for v in await read_values(client, "overtake")]
    assert attaches[0] >= 3
    assert sorted(acked) == list(range(400))
    missing = sorted(set(acked) - set(got))
    assert missing == [], f"{len(missing)} acknowledged messages lost, first {missing[:5]}"
    assert got == list(range(400))


async def test_acknowledgements_arrive_in_order_across_reattaches(
    pigeon_standalone, autojump_clock
):
    service = pigeon_standalone.service
    order: list[int] = []
    async with Client(pigeon_standalone.url) as client:
        producer = await client.create_producer("in-order", batching_max_messages=1)
        for i in range(300):
            await producer.send_async(
                str(i).encode(), callback=lambda m, e, i=i: order.append(i) if e is None else None
            )
            if i % 50 == 25:
                await unload(service, "in-order")
        await producer.flush()
        await producer.close()
    assert order == list(range(300))


_TRANSIENT = [
    ServiceUnavailable("cannot connect to bookie"),
    NotOwner("not the owner yet"),
    Timeout("metadata store slow"),
    StorageError("bookie I/O error"),
    SegmentFenced("fenced by the new owner"),
    NoSuchNode("ownership node gone"),
    PigeonError("internal error: something broke"),
]


def _fail_first(monkeypatch: pytest.MonkeyPatch, service: Any, name: str, error: Exception):
    """Make ``service.<name>`` (an async handler of the native front door) raise
    ``error`` the next 3 times."""
    real = getattr(service, name)
    left = [3]

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        if left[0] > 0:
            left[0] -= 1
            raise error
        return await real(*args, **kwargs)

    monkeypatch.setattr(service, name, flaky)
    return left


@pytest.mark.parametrize("error", _TRANSIENT, ids=lambda e: type(e).__name__)
async def test_producer_reattach_failures_are_retried(
    pigeon_standalone, autojump_clock, monkeypatch, error
):
    service = pigeon_standalone.service
    async with Client(pigeon_standalone.url) as client:
        producer = await client.create_producer("p-retry", batching_max_messages=1)
        await producer.send(b"before")
        left = _fail_first(monkeypatch, service.native, "_create_producer", error)
        await unload(service, "p-retry")
        with trio.fail_after(20):
            ids = [await producer.send(f"after-{i}".encode()) for i in range(3)]
        assert left == [0], "the re-attach never failed"
        assert [i.offset for i in ids] == [1, 2, 3]
        await producer.close()
        assert await read_values(client, "p-retry") == [
            b"before",
            b"after-0",
            b"after-1",
            b"after-2",
        ]


# ----------------------------------------------------------------------------- consumer


@pytest.mark.parametrize("error", _TRANSIENT, ids=lambda e: type(e).__name__)
async def test_consumer_resubscribes_after_failed_subscribes(
    pigeon_standalone, autojump_clock, monkeypatch, error
):
    service = pigeon_standalone.service
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("c-retry", "s", initial_position="earliest")
        producer = await client.create_producer("c-retry", batching_max_messages=1)
        await producer.send(b"before")
        first = await consumer.receive(timeout=5)
        assert first.value == b"before"
        await consumer.acknowledge(first)
        left = _fail_first(monkeypatch, service.native, "_subscribe", error)
        await unload(service, "c-retry")
        await producer.send(b"after")
        # (b"before" may come again: its acknowledgement may not have reached the broker)
        assert await receive_until(consumer, b"after")  # the old client waited forever
        assert left == [0], "the re-subscribe never failed"
        (sub,) = service.topics[PREFIX + "c-retry"].subscriptions.values()
        assert len(sub.consumers) == 1, "a failed subscribe left a consumer behind"
        await consumer.close()
        await producer.close()


async def test_exclusive_consumer_resubscribes_after_subscribes_that_timed_out(
    pigeon_standalone, autojump_clock, monkeypatch
):
    """A subscribe the client gave up on may still take effect on the broker: the client
    closes its consumer id after every failed try, or an exclusive subscription would stay
    busy with a consumer nobody reads from."""
    service = pigeon_standalone.service
    async with Client(pigeon_standalone.url, operation_timeout=2.0) as client:
        consumer = await client.subscribe("c-slow", "s", initial_position="earliest")
        producer = await client.create_producer("c-slow", batching_max_messages=1)
        real = service.native._subscribe
        delays = [3.0, 1.5]  # both answered after the client's operation timeout

        async def late(*args: Any, **kwargs: Any) -> Any:
            if delays:
                await trio.sleep(delays.pop(0))
            return await real(*args, **kwargs)

        monkeypatch.setattr(service.native, "_subscribe", late)
        await unload(service, "c-slow")
        await producer.send(b"after")
        assert await receive_until(consumer, b"after")
        assert delays == []
        (sub,) = service.topics[PREFIX + "c-slow"].subscriptions.values()
        assert len(sub.consumers) == 1
        await consumer.close()
        await producer.close()


@pytest.mark.parametrize("partitions", [0, 2])
async def test_a_reader_goes_on_after_what_it_read_when_its_topic_moves(
    pigeon_standalone: Any, autojump_clock: Any, partitions: int
) -> None:
    """A reader (non-durable cursor) re-attaches after the last message the application
    took, not at its original start: the nemesis saw readers start again from the
    earliest message after every broker failover, re-reading everything (and never
    catching up)."""
    topic = f"{PREFIX}reader-moves-{partitions}"
    service = pigeon_standalone.service
    async with Client(pigeon_standalone.url) as client:
        if partitions:
            await client.create_topic(topic, partitions)
        producer = await client.create_producer(topic, batching_max_messages=3)
        for i in range(30):
            await producer.send_async(f"m{i:02d}".encode())
        await producer.flush()
        reader = await client.create_reader(topic, "earliest", receiver_queue_size=8)
        seen = [(await reader.read_next(timeout=10)).value for _ in range(10)]
        for name in [topic] if not partitions else [f"{topic}-partition-{i}" for i in range(2)]:
            await unload_topic(service, TopicName.parse(name))
        for i in range(30, 40):
            await producer.send_async(f"m{i:02d}".encode())
        await producer.flush()
        with trio.move_on_after(30):
            while len(seen) < 40:
                seen.append((await reader.read_next(timeout=10)).value)
        assert len(seen) == len(set(seen)) == 40, f"read again or missed: {seen}"
        assert sorted(seen) == [f"m{i:02d}".encode() for i in range(40)]
        await reader.close()

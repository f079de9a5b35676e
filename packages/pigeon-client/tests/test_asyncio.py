"""The asyncio face against a real ``pigeon standalone`` process, over loopback.

Every test is a plain function that runs its scenario with ``asyncio.run`` (as an asyncio
program would), so pytest-trio leaves it alone.  One server serves the whole module; each
test uses its own topic names.  Waits are bounded; timing checks only ever assert
generous bounds that a slow machine can weaken but not break.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from _timerfds import OwnClockLoop, RecordingLoop, open_timerfds

from pigeon.client import DeadLetterPolicy, Message, MessageId, Timeout
from pigeon.client._timer import LoopTimers
from pigeon.client.asyncio import Client, Consumer, Producer
from pigeon.core.errors import (
    AlreadyClosed,
    ConsumerBusy,
    InvalidArgument,
    NotSupported,
    PigeonError,
    ProducerQueueFull,
    UnknownCodec,
)

pytestmark = pytest.mark.integration

OP_TIMEOUT = 10.0


def topic_name(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def run(scenario: Callable[[Client], Awaitable[None]], url: str) -> None:
    """``asyncio.run`` a scenario with a fresh client (closed afterwards)."""

    async def main() -> None:
        async with Client(url, operation_timeout=OP_TIMEOUT) as client:
            await asyncio.wait_for(scenario(client), 25)

    asyncio.run(main())


async def receive_n(consumer: Consumer, n: int, within: float = 10.0) -> list[Message]:
    out: list[Message] = []
    deadline = time.monotonic() + within
    while len(out) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"received {len(out)} of {n} messages within {within}s"
        try:
            out.extend(await consumer.batch_receive(n - len(out), timeout=min(left, 1.0)))
        except Timeout:
            pass
    return out


def scenario(test: Callable[[Client, str], Awaitable[None]]) -> Callable[[str], None]:
    """A test written as ``async def test_x(client, topic)``: run as an asyncio program
    (see :func:`run`) with a fresh client and a topic name of its own."""

    def run_test(url: str) -> None:
        run(lambda client: test(client, topic_name()), url)

    run_test.__name__ = run_test.__qualname__ = test.__name__
    run_test.__doc__ = test.__doc__
    return run_test


class Ticker:
    """A task that notes every time it runs: a blocked event loop shows as a gap."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.ticks = 0
        self.max_gap = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.period)
            now = time.monotonic()
            self.max_gap = max(self.max_gap, now - last)
            last = now
            self.ticks += 1

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task


# ----------------------------------------------------------------------------- producing


@scenario
async def test_round_trip_with_keys_properties_and_futures(client: Client, topic: str) -> None:
    async with await client.subscribe(topic, "sub", initial_position="earliest") as consumer:
        async with await client.create_producer(topic, producer_name="p-rt") as producer:
            assert producer.topic == f"persistent://public/default/{topic}"
            assert producer.producer_name == "p-rt"
            first = await producer.send(b"a", key="k1", properties={"x": "1"}, event_time=7)
            called: list[asyncio.Future[MessageId]] = []
            fut = producer.send_async(b"b", key=b"k2", callback=called.append)
            assert isinstance(fut, asyncio.Future)
            await producer.flush()
            assert fut.done() and called == [fut]
            second = fut.result()
        assert isinstance(first, MessageId) and isinstance(second, MessageId)
        assert second.offset == first.offset + 1

        msgs = await receive_n(consumer, 2)
        assert [m.value for m in msgs] == [b"a", b"b"]
        assert [m.key for m in msgs] == ["k1", "k2"]
        assert msgs[0].properties == {"x": "1"} and msgs[0].event_time == 7
        assert [m.message_id for m in msgs] == [first, second]
        for m in msgs:
            await consumer.acknowledge(m)
        assert consumer.subscription == "sub"

    # acknowledged before close: a new consumer on the subscription gets nothing
    async with await client.subscribe(topic, "sub") as again:
        with pytest.raises(Timeout):
            await again.receive(timeout=0.3)


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")


def timer_calls_at(loop: RecordingLoop, producer: Producer) -> list[float]:
    """When the loop was asked to call the producer's batching timer (``call_at``)."""
    return [when for when, callback in loop.calls_at if callback == producer._timer_fired]


@linux
def test_the_batching_timer_wakes_on_a_timerfd_armed_for_the_batch_due_time(url: str) -> None:
    # asyncio's loop rounds a call_at's wait up to the next whole millisecond; the timer
    # is a timerfd armed for the due time instead, and the batch never leaves before it
    topic = topic_name()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, RecordingLoop)
        async with Client(url, operation_timeout=OP_TIMEOUT) as client:
            producer = await client.create_producer(topic, batching_max_delay_ms=5)
            timers = producer._timers
            assert isinstance(timers, LoopTimers)
            armed: list[tuple[int, int]] = []
            arm = timers._arm
            timers._arm = lambda fd, ns: (armed.append((fd, ns)), arm(fd, ns))[1]
            for round_ in range(3):
                before = time.monotonic()
                futures = [producer.send_async(b"%d-%d" % (round_, i)) for i in range(5)]
                after = time.monotonic()
                ids = await asyncio.wait_for(asyncio.gather(*futures), OP_TIMEOUT)
                acked = time.monotonic()
                assert len(armed) == round_ + 1, "the batch's timer was not a timerfd"
                due = armed[-1][1] / 1e9
                assert before + 0.005 <= due <= after + 0.005, "armed for another time"
                assert acked >= due, "the batch left before it was due"
                assert len({(i.segment_id, i.entry_id) for i in ids}) == 1, "split batch"
            assert len({fd for fd, _ in armed}) == 1, "a partition's timerfd was not reused"
            assert timer_calls_at(loop, producer) == [], "the batching timer took call_at"
            await producer.close()

    with asyncio.Runner(loop_factory=RecordingLoop) as runner:
        runner.run(main())


@linux
def test_producer_and_client_close_close_the_timerfds(url: str) -> None:
    topic = topic_name()

    async def main() -> None:
        before = open_timerfds()
        client = Client(url, operation_timeout=OP_TIMEOUT)
        try:
            await client.create_topic(topic, partitions=2)
            closed = await client.create_producer(topic, batching_max_delay_ms=2)
            left_open = await client.create_producer(topic, batching_max_delay_ms=2)
            for producer in (closed, left_open):
                futures = [producer.send_async(b"x", key=f"k{i}") for i in range(20)]
                await asyncio.wait_for(asyncio.gather(*futures), OP_TIMEOUT)
            assert open_timerfds() == before + 4, "not one timerfd per partition timed"
            await closed.close()
            assert open_timerfds() == before + 2, "the closed producer's timerfds are open"
        finally:
            await client.close()
        assert open_timerfds() == before, "the client closed and left timerfds open"
        with pytest.raises(AlreadyClosed):
            left_open.send_async(b"late")

    asyncio.run(main())


@scenario
async def test_sends_while_close_runs_fail_or_are_stored(client: Client, topic: str) -> None:
    """A task sending while ``close()`` waits for its flush: each send raises
    AlreadyClosed or gets a receipt (none is left in a batch nothing seals, as when
    ``closed`` was set only after the flush)."""
    producer = await client.create_producer(topic, batching_max_delay_ms=300)
    accepted: list[asyncio.Future[MessageId]] = []
    started = asyncio.Event()

    async def sender() -> None:
        with contextlib.suppress(AlreadyClosed):
            for i in range(100_000):
                accepted.append(producer.send_async(b"m%d" % i))
                if i % 50 == 49:
                    started.set()
                    await asyncio.sleep(0)

    task = asyncio.create_task(sender())
    await started.wait()
    await producer.close()
    await asyncio.wait_for(task, OP_TIMEOUT)
    done, pending = await asyncio.wait(accepted, timeout=OP_TIMEOUT)
    assert not pending, f"{len(pending)} sends accepted during close() got no receipt"
    assert all(f.exception() is None for f in done)


def test_a_loop_with_its_own_clock_keeps_call_at_and_batches_on_time(url: str) -> None:
    topic = topic_name()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, OwnClockLoop)
        async with Client(url, operation_timeout=OP_TIMEOUT) as client:
            producer = await client.create_producer(topic, batching_max_delay_ms=5)
            assert producer._timers is None, "a timerfd for a clock it cannot stand for"
            before = loop.time()
            futures = [producer.send_async(b"%d" % i) for i in range(5)]
            after = loop.time()
            ids = await asyncio.wait_for(asyncio.gather(*futures), OP_TIMEOUT)
            assert loop.time() >= before + 0.005, "the batch left before it was due"
            assert len({(i.segment_id, i.entry_id) for i in ids}) == 1
            [when] = timer_calls_at(loop, producer)
            assert before + 0.005 <= when <= after + 0.005
            await producer.close()

    with asyncio.Runner(loop_factory=OwnClockLoop) as runner:
        runner.run(main())


def test_many_concurrent_sends(url: str) -> None:
    topic = topic_name()
    n_async, n_tasks = 3000, 200

    async def scenario(client: Client) -> None:
        async with await client.create_producer(topic, batching_max_messages=100) as producer:
            futs = [producer.send_async(b"m%d" % i) for i in range(n_async)]
            ids = await asyncio.gather(
                *(producer.send(b"t%d" % i, key=str(i)) for i in range(n_tasks))
            )
            ids = [*await asyncio.gather(*futs), *ids]
        assert len({(i.segment_id, i.entry_id, i.batch_index) for i in ids}) == n_async + n_tasks
        offsets = [i.offset for i in ids[:n_async]]
        assert offsets == sorted(offsets) and len(set(offsets)) == n_async

        async with await client.subscribe(
            topic, "s", initial_position="earliest", receiver_queue_size=10, consumer_name="c1"
        ) as consumer:  # a small queue: permits are granted again and again from the loop
            msgs = await receive_n(consumer, n_async + n_tasks)
        assert [m.value for m in msgs[:n_async]] == [b"m%d" % i for i in range(n_async)]

    run(scenario, url)


def test_partitioned_topic_and_routing(url: str) -> None:
    topic = topic_name("part")

    async def scenario(client: Client) -> None:
        await client.create_topic(topic, 3)
        assert f"persistent://public/default/{topic}" in await client.list_topics()
        async with await client.subscribe(
            topic, "s", subscription_type="shared", initial_position="earliest"
        ) as consumer:
            async with await client.create_producer(topic, routing_mode="key_hash") as producer:
                sent = await asyncio.gather(
                    *(producer.send(b"%d" % i, key=f"k{i}") for i in range(30))
                )
            async with await client.create_producer(
                topic, message_router=lambda key, n: n - 1, compression="gzip"
            ) as routed:
                last = await routed.send(b"to-last")
            assert last.partition == 2
            assert {mid.partition for mid in sent} == {0, 1, 2}

            msgs = await receive_n(consumer, 31)
            expected = [b"%d" % i for i in range(30)] + [b"to-last"]
            assert sorted(m.value for m in msgs) == sorted(expected)
            by_value = {m.value: m for m in msgs}
            for i, mid in enumerate(sent):
                assert by_value[b"%d" % i].message_id == mid
            assert by_value[b"to-last"].topic.endswith("-partition-2")

    run(scenario, url)


@scenario
async def test_delayed_delivery(client: Client, topic: str) -> None:
    async with await client.subscribe(
        topic, "s", subscription_type="shared", initial_position="earliest"
    ) as consumer:
        async with await client.create_producer(topic) as producer:
            start = time.monotonic()
            await producer.send(b"later", deliver_after=0.5)
            await producer.send(b"at", deliver_at=int(time.time() * 1000) + 500)
            await producer.send(b"now")
        assert (await consumer.receive(timeout=5)).value == b"now"
        later = {(await consumer.receive(timeout=5)).value for _ in range(2)}
        assert later == {b"later", b"at"}
        assert time.monotonic() - start >= 0.45
        with pytest.raises(InvalidArgument):
            await producer.send(b"x", deliver_at=1, deliver_after=1)


@scenario
async def test_queue_full_and_closed_errors(client: Client, topic: str) -> None:
    producer = await client.create_producer(
        topic, max_pending_messages=1, block_if_queue_full=False, batching_max_delay_ms=50
    )
    fut = producer.send_async(b"1")
    with pytest.raises(ProducerQueueFull):
        producer.send_async(b"2")
    await producer.flush()
    assert isinstance(fut.result(), MessageId)
    producer.send_async(b"3")  # space again
    await producer.close()
    with pytest.raises(AlreadyClosed):
        producer.send_async(b"4")
    with pytest.raises(AlreadyClosed):
        await producer.send(b"4")
    with pytest.raises(UnknownCodec):
        await client.create_producer(topic, compression="no-such-codec")
    with pytest.raises(InvalidArgument):
        await client.subscribe(topic, "s", subscription_type="no-such-type")
    async with await client.subscribe(topic, "shared", subscription_type="shared") as c:
        with pytest.raises(NotSupported):
            await c.acknowledge_cumulative(MessageId(1, 0))


@scenario
async def test_blocking_send_waits_for_space(client: Client, topic: str) -> None:
    async with await client.create_producer(topic, max_pending_messages=5) as producer:
        ids = await asyncio.gather(*(producer.send(b"%d" % i) for i in range(50)))
    assert [i.offset for i in ids] == sorted(i.offset for i in ids)
    assert len({i.offset for i in ids}) == 50


# ----------------------------------------------------------------------------- consuming


@scenario
async def test_reader(client: Client, topic: str) -> None:
    async with await client.create_producer(topic) as producer:
        ids = [await producer.send(b"%d" % i) for i in range(5)]
    async with await client.create_reader(topic, "earliest") as reader:
        got = [await reader.read_next(timeout=5) for _ in range(5)]
        assert [m.value for m in got] == [b"%d" % i for i in range(5)]
        assert not await reader.has_message_available()
    async with await client.create_reader(topic, ids[1]) as reader:
        assert await reader.has_message_available()
        assert (await reader.read_next(timeout=5)).value == b"2"
    async with await client.create_reader(topic, ids[1], start_message_id_inclusive=True) as r:
        assert (await r.read_next(timeout=5)).value == b"1"


@contextlib.asynccontextmanager
async def shared_with_one(
    client: Client, topic: str, value: bytes, **options: Any
) -> AsyncIterator[Consumer]:
    """A shared subscription from the earliest message, with ``options``, and one message
    sent to its topic."""
    async with await client.subscribe(
        topic, "s", subscription_type="shared", initial_position="earliest", **options
    ) as consumer:
        async with await client.create_producer(topic, send_timeout=5) as producer:
            await producer.send(value)
        yield consumer


@scenario
async def test_negative_ack_redelivery(client: Client, topic: str) -> None:
    async with shared_with_one(
        client, topic, b"again", negative_ack_redelivery_delay=0.2
    ) as consumer:
        first = await consumer.receive(timeout=5)
        assert first.redelivery_count == 0
        await consumer.negative_acknowledge(first)
        second = await consumer.receive(timeout=5)
        assert second.value == b"again" and second.redelivery_count >= 1
        await consumer.acknowledge(second)
        await consumer.redeliver_unacknowledged_messages()
        with pytest.raises(Timeout):
            await consumer.receive(timeout=0.3)


@scenario
async def test_ack_timeout_redelivers(client: Client, topic: str) -> None:
    async with shared_with_one(
        client, topic, b"forgotten", ack_timeout=0.3, priority=1
    ) as consumer:
        first = await consumer.receive(timeout=5)
        start = time.monotonic()
        again = await consumer.receive(timeout=5)  # never acknowledged: sent again
        assert again.value == b"forgotten" and again.redelivery_count >= 1
        assert time.monotonic() - start >= 0.2
        assert again.message_id == first.message_id
        await consumer.acknowledge(again)


def test_dead_letter_and_reconsume_later(url: str) -> None:
    topic = topic_name()
    policy = DeadLetterPolicy(max_redeliver_count=1, enable_retry=True)

    async def scenario(client: Client) -> None:
        async with (
            await client.subscribe(
                topic,
                "s",
                subscription_type="shared",
                initial_position="earliest",
                negative_ack_redelivery_delay=0.1,
                dead_letter_policy=policy,
            ) as consumer,
            await client.subscribe(f"{topic}-s-DLQ", "dlq", initial_position="earliest") as dlq,
        ):
            async with await client.create_producer(topic) as producer:
                await producer.send(b"retry-me")
                await producer.send(b"fails", key="k")
            retried = asyncio.Event()
            nacks = 0

            async def work() -> None:
                nonlocal nacks
                while True:
                    m = await consumer.receive()
                    if m.value == b"fails":  # nacked until it is dead-lettered
                        nacks += 1
                        await consumer.negative_acknowledge(m)
                    elif not m.topic.endswith("-RETRY"):
                        await consumer.reconsume_later(m, 0.1)
                    else:
                        assert m.properties["RECONSUMETIMES"] == "1"
                        await consumer.acknowledge(m)
                        retried.set()

            worker = asyncio.create_task(work())
            try:
                dead = await dlq.receive(timeout=10)
                await asyncio.wait_for(retried.wait(), 10)
            finally:
                worker.cancel()
            assert dead.value == b"fails" and dead.key == "k"
            assert dead.properties["REAL_TOPIC"] == f"persistent://public/default/{topic}"
            assert nacks == 2  # delivered, redelivered once, then dead-lettered

    run(scenario, url)


@scenario
async def test_seek_and_cumulative_ack(client: Client, topic: str) -> None:
    async with await client.subscribe(topic, "s", initial_position="earliest") as consumer:
        async with await client.create_producer(topic) as producer:
            for i in range(5):
                producer.send_async(b"%d" % i)
        msgs = [await consumer.receive(timeout=5) for _ in range(5)]
        await consumer.acknowledge_cumulative(msgs[-1])
        await consumer.seek(offset=msgs[0].offset)
        assert (await consumer.receive(timeout=2)).value == b"0"
        await consumer.seek(msgs[2].message_id)
        assert (await consumer.receive(timeout=2)).value == b"2"
        await consumer.seek(timestamp=0)
        assert (await consumer.receive(timeout=2)).value == b"0"


@scenario
async def test_seek_arguments(client: Client, topic: str) -> None:
    async with await client.create_producer(topic) as producer:
        mid = await producer.send(b"x")
    async with await client.create_reader(topic, "latest") as reader:
        with pytest.raises(InvalidArgument):
            await reader.seek()
        with pytest.raises(InvalidArgument):
            await reader.seek(mid, offset=0)
        with pytest.raises(Timeout):
            await reader.read_next(timeout=0.2)
        await reader.seek(offset=0)  # completes; what arrives after is racy (see above)


def test_list_and_pattern_subscriptions(url: str) -> None:
    prefix = topic_name("pat")
    a, b = f"{prefix}-a", f"{prefix}-b"

    async def scenario(client: Client) -> None:
        async with await client.create_producer(a) as pa, await client.create_producer(b) as pb:
            await pa.send(b"A")
            await pb.send(b"B")
        async with await client.subscribe([a, b], "list", initial_position="earliest") as c:
            assert sorted(m.value for m in await receive_n(c, 2)) == [b"A", b"B"]
        pattern = re.compile(f"persistent://public/default/{prefix}-.*")
        async with await client.subscribe(pattern, "pat", initial_position="earliest") as c:
            assert sorted(m.value for m in await receive_n(c, 2)) == [b"A", b"B"]
            await c.unsubscribe()
            with pytest.raises(AlreadyClosed):
                await c.receive(timeout=1)

    run(scenario, url)


# ----------------------------------------------------------------------------- the loop


@scenario
async def test_receive_timeout_does_not_block_the_loop(client: Client, topic: str) -> None:
    async with await client.subscribe(topic, "s") as consumer:
        async with Ticker() as ticker:
            start = time.monotonic()
            with pytest.raises(Timeout):
                await consumer.receive(timeout=1.0)
            elapsed = time.monotonic() - start
        assert 0.9 <= elapsed < 5
        # a blocked loop would show one gap of about a second and a handful of ticks
        assert ticker.max_gap < 0.5, ticker.max_gap
        assert ticker.ticks >= 10

        with pytest.raises(Timeout):
            await consumer.batch_receive(10, timeout=0)


@scenario
async def test_slow_receive_lets_other_tasks_run(client: Client, topic: str) -> None:
    async with (
        await client.subscribe(topic, "s") as consumer,
        await client.create_producer(topic) as producer,
    ):

        async def produce_later() -> None:
            await asyncio.sleep(0.5)
            await producer.send(b"late")

        async with Ticker() as ticker:
            sender = asyncio.create_task(produce_later())
            msg = await consumer.receive(timeout=10)
            await sender
        assert msg.value == b"late"
        assert ticker.max_gap < 0.4 and ticker.ticks >= 5


@scenario
async def test_cancelled_receive_leaves_consumer_usable(client: Client, topic: str) -> None:
    async with await client.subscribe(topic, "s", initial_position="earliest") as consumer:
        pending = asyncio.create_task(consumer.receive())
        await asyncio.sleep(0.2)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(consumer.receive(), 0.1)

        async with await client.create_producer(topic) as producer:
            await producer.send(b"1")
            await producer.send(b"2")
        # nothing was taken by the cancelled receives
        assert [m.value for m in await receive_n(consumer, 2)] == [b"1", b"2"]

        # close wakes a pending receive with AlreadyClosed
        waiting = asyncio.create_task(consumer.receive())
        await asyncio.sleep(0.1)
        await consumer.close()
        with pytest.raises(AlreadyClosed):
            await waiting


@scenario
async def test_cancelled_subscribe_leaves_no_consumer_behind(client: Client, topic: str) -> None:
    await client.create_topic(topic)
    # cancel at different points of the exchange with the engine and the broker
    for delay in (0, 0.0002, 0.0005, 0.001, 0.002, 0.004, 0.008):
        for opening in (
            lambda: client.subscribe(topic, "excl"),
            lambda: client.create_producer(topic),
        ):
            task: asyncio.Future[Any] = asyncio.ensure_future(opening())
            await asyncio.sleep(delay)
            task.cancel()
            try:
                opened = await task
            except (asyncio.CancelledError, ConsumerBusy):
                continue  # cancelled; or the last orphan is still being closed
            await opened.close()  # finished before the cancel arrived
    # exclusive: a consumer left attached would make this fail with ConsumerBusy
    deadline = time.monotonic() + 5
    while True:
        try:
            consumer = await client.subscribe(topic, "excl")
            break
        except PigeonError:
            assert time.monotonic() < deadline, "an orphaned consumer stayed attached"
            await asyncio.sleep(0.05)
    await consumer.close()
    async with await client.create_producer(topic) as producer:
        await producer.send(b"still fine")


def test_two_clients_in_one_program(url: str) -> None:
    topic = topic_name()

    async def main() -> None:
        async with Client(url) as a, Client(url) as b:
            consumer = await b.subscribe(topic, "s", initial_position="earliest")
            producer = await a.create_producer(topic)

            async def produce() -> list[MessageId]:
                return [await producer.send(b"%d" % i) for i in range(20)]

            ids, msgs = await asyncio.gather(produce(), receive_n(consumer, 20))
            assert [m.message_id for m in msgs] == ids
            await producer.close()
            await consumer.close()
        with pytest.raises(AlreadyClosed):
            await a.list_topics()

    asyncio.run(main())


def test_client_close_with_open_producer_and_consumer(url: str) -> None:
    topic = topic_name()

    async def main() -> Any:
        client = Client(url)
        producer = await client.create_producer(topic, batching_max_delay_ms=1000)
        consumer = await client.subscribe(topic, "s")
        fut = producer.send_async(b"x")
        await client.close()
        await client.close()  # idempotent
        assert fut.done()
        await producer.close()  # no-ops after the client closed
        await consumer.close()
        assert not client.engine_thread.thread.is_alive()

    asyncio.run(main())

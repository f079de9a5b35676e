"""Message listeners, pause/resume and redelivery backoff on the sync and asyncio faces,
against one real ``pigeon standalone`` process for the module (the trio face, in virtual
time: ``test_listeners``).

Waits are bounded; timing checks only assert what no slow machine can break: a
redelivery never comes *before* its delay, and a close that must wait has not returned
while the listener it waits for is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from typing import Any

import pytest

import pigeon.client.asyncio as asyncio_face
from pigeon.client import Client, Message, MultiplierRedeliveryBackoff, Timeout
from pigeon.core.errors import NotSupported

pytestmark = pytest.mark.integration

OP_TIMEOUT = 10.0
SENT = [f"m{i}".encode() for i in range(20)]


@pytest.fixture
def topic() -> str:
    return f"l-{uuid.uuid4().hex[:10]}"


def produce(client: Client, topic: str, values: list[bytes]) -> None:
    with client.create_producer(topic, batching_max_messages=1) as producer:
        for v in values:
            producer.send(v)


def wait_until(cond: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def drain(consumer: Any, idle: float = 1.0) -> list[Message]:
    out: list[Message] = []
    while True:
        try:
            out.extend(consumer.batch_receive(100, timeout=idle))
        except Timeout:
            return out


def gaps_of(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


# ----------------------------------------------------------------------------- sync face


def test_sync_listener_order_errors_and_no_receive(url: str, topic: str, caplog: Any) -> None:
    seen: list[tuple[bytes, int, str]] = []

    def listener(consumer: Any, msg: Message) -> None:
        seen.append((msg.value, msg.redelivery_count, threading.current_thread().name))
        if msg.value == b"m3" and msg.redelivery_count == 0:
            raise RuntimeError("m3 failed once")
        consumer.acknowledge(msg)

    caplog.set_level(logging.WARNING)
    with Client(url, operation_timeout=OP_TIMEOUT) as client:
        consumer = client.subscribe(
            topic, "s", message_listener=listener, negative_ack_redelivery_delay=0.1
        )
        produce(client, topic, SENT[:10])
        wait_until(lambda: len(seen) == 11)
        with pytest.raises(NotSupported, match="message_listener"):
            consumer.receive(timeout=0.1)
        consumer.close()
    first = [(v, n) for v, n, _ in seen]
    assert first[:10] == [(v, 0) for v in SENT[:10]] and first[10] == (b"m3", 1)
    assert all(name.startswith("pigeon-listener") for _, _, name in seen)
    failed = [r for r in caplog.records if "message listener failed" in r.getMessage()]
    assert len(failed) == 1 and "m3 failed once" in failed[0].getMessage()


def test_sync_listeners_of_two_consumers_run_in_parallel_each_in_order(
    url: str, topic: str
) -> None:
    """Two listener threads: both consumers' listeners meet at a barrier (they run at the
    same time), yet each consumer's messages come one at a time, in order."""
    barrier = threading.Barrier(2, timeout=10)
    lock = threading.Lock()
    running: dict[str, int] = {"a": 0, "b": 0}
    most: dict[str, int] = {"a": 0, "b": 0}
    got: dict[str, list[bytes]] = {"a": [], "b": []}

    def listener_of(name: str) -> Any:
        def listener(consumer: Any, msg: Message) -> None:
            with lock:
                running[name] += 1
                most[name] = max(most[name], running[name])
            if msg.value == b"m0":
                barrier.wait()
            time.sleep(0.001)
            with lock:
                running[name] -= 1
                got[name].append(msg.value)

        return listener

    with Client(url, operation_timeout=OP_TIMEOUT, message_listener_threads=2) as client:
        a = client.subscribe(topic + "-a", "s", message_listener=listener_of("a"))
        b = client.subscribe(topic + "-b", "s", message_listener=listener_of("b"))
        produce(client, topic + "-a", SENT)
        produce(client, topic + "-b", SENT)
        wait_until(lambda: len(got["a"]) == len(got["b"]) == len(SENT))
        a.close()
        b.close()
    assert got == {"a": SENT, "b": SENT}
    assert most == {"a": 1, "b": 1}


def test_sync_close_waits_for_the_running_call_and_stops_the_listener(url: str, topic: str) -> None:
    calls: list[str] = []
    started, release = threading.Event(), threading.Event()

    def listener(consumer: Any, msg: Message) -> None:
        calls.append(f"start {msg.value.decode()}")
        started.set()
        release.wait(10)
        calls.append(f"end {msg.value.decode()}")

    with Client(url, operation_timeout=OP_TIMEOUT) as client:
        consumer = client.subscribe(topic, "s", message_listener=listener)
        produce(client, topic, SENT[:5])
        assert started.wait(10)
        closer = threading.Thread(target=consumer.close)
        closer.start()
        closer.join(0.3)
        assert closer.is_alive(), "close returned while the listener was still running"
        release.set()
        closer.join(10)
        assert calls == ["start m0", "end m0"]
        time.sleep(0.3)
        assert calls == ["start m0", "end m0"]

        # the client's close stops a listener still open the same way
        def slow(consumer: Any, msg: Message) -> None:
            calls.append(f"start {msg.value.decode()}")
            time.sleep(0.5)
            calls.append(f"end {msg.value.decode()}")

        client.subscribe(topic, "s", message_listener=slow)
        wait_until(lambda: len(calls) == 3)
    assert calls[2:] == ["start m0", "end m0"]


def test_sync_pause_and_resume(url: str, topic: str) -> None:
    got: list[bytes] = []
    with Client(url, operation_timeout=OP_TIMEOUT) as client:
        consumer = client.subscribe(topic, "s", receiver_queue_size=4)
        consumer.pause()
        produce(client, topic, SENT)
        first = drain(consumer)
        assert [m.value for m in first] == SENT[:4], "a paused consumer asked for more"
        consumer.resume()
        assert [m.value for m in drain(consumer)] == SENT[4:]
        consumer.close()
        # with a listener: nothing is handed to it while paused
        listening = client.subscribe(
            topic + "-l", "s", message_listener=lambda c, m: got.append(m.value)
        )
        listening.pause()
        produce(client, topic + "-l", SENT[:5])
        time.sleep(0.5)
        assert got == []
        listening.resume()
        wait_until(lambda: len(got) == 5)
        assert got == SENT[:5]
        listening.close()


def test_sync_negative_ack_backoff(url: str, topic: str) -> None:
    backoff = MultiplierRedeliveryBackoff(min_delay=0.2, max_delay=0.8, multiplier=2.0)
    with Client(url, operation_timeout=OP_TIMEOUT) as client:
        consumer = client.subscribe(topic, "s", negative_ack_redelivery_backoff=backoff)
        produce(client, topic, [b"x"])
        times = []
        for _ in range(5):
            msg = consumer.receive(timeout=10)
            times.append(time.monotonic())
            consumer.negative_acknowledge(msg)
        consumer.close()
    for gap, delay in zip(gaps_of(times), [0.2, 0.4, 0.8, 0.8], strict=True):
        assert gap >= delay - 0.01, gaps_of(times)


# ----------------------------------------------------------------------------- asyncio face


def run(scenario: Any, url: str) -> None:
    async def main() -> None:
        async with asyncio_face.Client(url, operation_timeout=OP_TIMEOUT) as client:
            await asyncio.wait_for(scenario(client), 25)

    asyncio.run(main())


async def until(cond: Any, within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while not cond():  # noqa: ASYNC110 - state set by the listener task
            await asyncio.sleep(0.01)


async def aproduce(client: asyncio_face.Client, topic: str, values: list[bytes]) -> None:
    async with await client.create_producer(topic, batching_max_messages=1) as producer:
        for v in values:
            await producer.send(v)


@pytest.mark.parametrize("kind", ["function", "coroutine"])
def test_asyncio_listener_order_errors_and_no_receive(
    url: str, topic: str, kind: str, caplog: Any
) -> None:
    seen: list[tuple[bytes, int]] = []
    loops: set[Any] = set()

    def plain(consumer: Any, msg: Message) -> None:
        loops.add(asyncio.get_running_loop())
        seen.append((msg.value, msg.redelivery_count))
        if msg.value == b"m3" and msg.redelivery_count == 0:
            raise RuntimeError("m3 failed once")

    async def coroutine(consumer: Any, msg: Message) -> None:
        await asyncio.sleep(0)
        plain(consumer, msg)
        await consumer.acknowledge(msg)

    async def scenario(client: asyncio_face.Client) -> None:
        consumer = await client.subscribe(
            topic,
            "s",
            message_listener=coroutine if kind == "coroutine" else plain,
            negative_ack_redelivery_delay=0.1,
        )
        await aproduce(client, topic, SENT[:10])
        await until(lambda: len(seen) == 11)
        with pytest.raises(NotSupported, match="message_listener"):
            await consumer.receive(timeout=0.1)
        assert loops == {asyncio.get_running_loop()}
        await consumer.close()

    caplog.set_level(logging.WARNING)
    run(scenario, url)
    assert seen[:10] == [(v, 0) for v in SENT[:10]] and seen[10] == (b"m3", 1)
    assert sum("message listener failed" in r.getMessage() for r in caplog.records) == 1


def test_asyncio_close_waits_for_the_running_call(url: str, topic: str) -> None:
    calls: list[str] = []

    async def scenario(client: asyncio_face.Client) -> None:
        started, release = asyncio.Event(), asyncio.Event()

        async def listener(consumer: Any, msg: Message) -> None:
            calls.append(f"start {msg.value.decode()}")
            started.set()
            await release.wait()
            calls.append(f"end {msg.value.decode()}")

        consumer = await client.subscribe(topic, "s", message_listener=listener)
        await aproduce(client, topic, SENT[:5])
        await asyncio.wait_for(started.wait(), 10)
        closing = asyncio.create_task(consumer.close())
        await asyncio.sleep(0.3)
        assert not closing.done(), "close returned while the listener was still running"
        release.set()
        await closing
        assert calls == ["start m0", "end m0"]
        await asyncio.sleep(0.3)
        assert calls == ["start m0", "end m0"]
        # the client's close stops a listener still open the same way

        async def slow(consumer: Any, msg: Message) -> None:
            calls.append(f"start {msg.value.decode()}")
            await asyncio.sleep(0.5)
            calls.append(f"end {msg.value.decode()}")

        await client.subscribe(topic, "s", message_listener=slow)
        await until(lambda: len(calls) == 3)

    run(scenario, url)
    assert calls[2:] == ["start m0", "end m0"]


def test_asyncio_pause_resume_and_backoff(url: str, topic: str) -> None:
    backoff = MultiplierRedeliveryBackoff(min_delay=0.2, max_delay=0.8, multiplier=2.0)
    got: list[bytes] = []
    times: list[float] = []

    async def scenario(client: asyncio_face.Client) -> None:
        consumer = await client.subscribe(topic, "s", receiver_queue_size=4)
        consumer.pause()
        await aproduce(client, topic, SENT)
        first = []
        with contextlib.suppress(Timeout):
            while True:
                first.extend(await consumer.batch_receive(100, timeout=1.0))
        assert [m.value for m in first] == SENT[:4], "a paused consumer asked for more"
        consumer.resume()
        for _ in range(16):
            got.append((await consumer.receive(timeout=10)).value)
        await consumer.close()

        nacking = await client.subscribe(
            topic + "-nack", "s", negative_ack_redelivery_backoff=backoff
        )
        await aproduce(client, topic + "-nack", [b"x"])
        for _ in range(5):
            msg = await nacking.receive(timeout=10)
            times.append(time.monotonic())
            await nacking.negative_acknowledge(msg)
        await nacking.close()

    run(scenario, url)
    assert got == SENT[4:]
    for gap, delay in zip(gaps_of(times), [0.2, 0.4, 0.8, 0.8], strict=True):
        assert gap >= delay - 0.01, gaps_of(times)

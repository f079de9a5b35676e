"""Message listeners, pause/resume and redelivery backoff on the trio face, against an
in-process standalone in virtual time (the sync and asyncio faces: ``test_listeners_faces``).

* A listener gets every message, in order, one at a time; what it raises is logged and
  the message comes back (negatively acknowledged); ``receive`` is refused; after
  ``close`` returns nothing more reaches it, and the call running then finished first.
* A paused consumer asks for nothing more: it gets what the broker was already allowed to
  send (``receiver_queue_size``), then nothing, across a reconnect and on every topic of a
  multi-topic consumer; ``resume`` brings the rest.
* With a ``MultiplierRedeliveryBackoff``, a message nacked (or timed out) again and again
  comes back after delays that double up to ``max_delay``.
"""

from __future__ import annotations

import itertools
import logging
import re
from typing import Any

import pytest
import trio

from pigeon.broker._admin_ops import unload_topic
from pigeon.client import Message, MultiplierRedeliveryBackoff
from pigeon.client._options import ConsumerOptions, ReaderOptions
from pigeon.client.trio import Client, Consumer
from pigeon.core import TopicName
from pigeon.core.errors import InvalidArgument, NotSupported, Timeout
from pigeon.core.testing import drain

PREFIX = "persistent://public/default/"
SENT = [f"m{i}".encode() for i in range(20)]


async def produce(client: Client, topic: str, values: list[bytes]) -> None:
    producer = await client.create_producer(topic, batching_max_messages=1)
    for v in values:
        await producer.send(v)
    await producer.close()


class Seen(list[Any]):
    """What a listener saw; ``await seen.until(n)`` waits (in virtual time) for n items."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = trio.Event()

    def append(self, item: Any) -> None:
        super().append(item)
        self._changed.set()

    async def until(self, n: int, within: float = 30.0) -> None:
        with trio.fail_after(within):
            while len(self) < n:
                self._changed = trio.Event()
                await self._changed.wait()


# ----------------------------------------------------------------------------- options


def test_backoff_grows_by_its_multiplier_up_to_max_delay() -> None:
    b = MultiplierRedeliveryBackoff(min_delay=0.5, max_delay=5.0, multiplier=3.0)
    assert [b.next(n) for n in range(5)] == [0.5, 1.5, 4.5, 5.0, 5.0]
    assert b.next(10**6) == 5.0  # no overflow
    assert MultiplierRedeliveryBackoff().next(0) == 1.0  # Pulsar's defaults: 1 s .. 60 s, x2


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: MultiplierRedeliveryBackoff(min_delay=-1), "min_delay"),
        (lambda: MultiplierRedeliveryBackoff(min_delay=2, max_delay=1), "max_delay"),
        (lambda: MultiplierRedeliveryBackoff(multiplier=0.5), "multiplier"),
        (lambda: MultiplierRedeliveryBackoff(max_delay=float("inf")), "max_delay"),
        (lambda: ConsumerOptions("t", "s", message_listener=3), "message_listener"),
        (lambda: ReaderOptions("t", reader_listener="f"), "reader_listener"),
        (lambda: ConsumerOptions("t", "s", negative_ack_redelivery_backoff=2.0), "negative_ack"),
        (
            lambda: ConsumerOptions(
                "t", "s", ack_timeout_redelivery_backoff=MultiplierRedeliveryBackoff()
            ),
            "ack_timeout",
        ),
        (lambda: Client("pigeon://127.0.0.1:1", message_listener_threads=0), "listener_threads"),
    ],
)
def test_bad_options_are_refused_when_built(make: Any, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        make()


# ----------------------------------------------------------------------------- listeners


@pytest.mark.parametrize("kind", ["function", "coroutine"])
async def test_listener_gets_every_message_in_order_one_at_a_time(
    pigeon_standalone, autojump_clock, kind
):
    got = Seen()
    running = [0, 0]  # now, most at once

    async def slow(consumer: Consumer, msg: Message) -> None:
        running[0] += 1
        running[1] = max(running[1], running[0])
        await trio.sleep(0.01)
        got.append(msg.value)
        await consumer.acknowledge(msg)
        running[0] -= 1

    def plain(consumer: Consumer, msg: Message) -> None:
        got.append(msg.value)

    listener = slow if kind == "coroutine" else plain
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("ls", "s", message_listener=listener)
        await produce(client, "ls", SENT)
        await got.until(len(SENT))
        assert got == SENT
        assert running[1] <= 1
        with pytest.raises(NotSupported, match="message_listener"):
            await consumer.receive(timeout=1)
        with pytest.raises(NotSupported):
            await consumer.batch_receive(10, timeout=1)
        await consumer.close()


async def test_listener_error_is_logged_and_the_message_comes_back(
    pigeon_standalone, autojump_clock, caplog
):
    seen = Seen()

    def listener(consumer: Consumer, msg: Message) -> None:
        seen.append((msg.value, msg.redelivery_count))
        if msg.value == b"m1" and msg.redelivery_count == 0:
            raise ValueError("cannot handle m1 yet")

    caplog.set_level(logging.WARNING)
    async with Client(pigeon_standalone.url) as client:
        await client.subscribe(
            "lerr", "s", message_listener=listener, negative_ack_redelivery_delay=0.5
        )
        await produce(client, "lerr", SENT[:3])
        await seen.until(4)
        assert seen == [(b"m0", 0), (b"m1", 0), (b"m2", 0), (b"m1", 1)]
    failed = [r for r in caplog.records if "message listener failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING
    assert "cannot handle m1 yet" in failed[0].getMessage() and failed[0].exc_info is None


async def test_close_lets_the_running_call_finish_and_hands_over_nothing_after(
    pigeon_standalone, autojump_clock
):
    calls = Seen()

    async def listener(consumer: Consumer, msg: Message) -> None:
        calls.append(f"start {msg.value.decode()}")
        await trio.sleep(5)
        calls.append(f"end {msg.value.decode()}")

    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("lclose", "s", message_listener=listener)
        await produce(client, "lclose", SENT[:5])
        await calls.until(1)
        await consumer.close()
        assert calls == ["start m0", "end m0"]
        await trio.sleep(10)
        assert calls == ["start m0", "end m0"]
        # the client's close does the same for a listener that is still open
        consumer = await client.subscribe("lclose", "s", message_listener=listener)
        await calls.until(3)
    assert calls[2:] == ["start m0", "end m0"]


async def test_a_listener_may_close_its_own_consumer(pigeon_standalone, autojump_clock):
    got = Seen()

    async def listener(consumer: Consumer, msg: Message) -> None:
        got.append(msg.value)
        if msg.value == b"m2":
            await consumer.close()

    async with Client(pigeon_standalone.url) as client:
        await client.subscribe("lself", "s", message_listener=listener)
        await produce(client, "lself", SENT[:6])
        await trio.sleep(5)
    assert got == SENT[:3]


async def test_reader_listener(pigeon_standalone, autojump_clock):
    got = Seen()
    async with Client(pigeon_standalone.url) as client:
        await produce(client, "lread", SENT[:5])
        reader = await client.create_reader(
            "lread", "earliest", reader_listener=lambda r, m: got.append(m.value)
        )
        await got.until(5)
        with pytest.raises(NotSupported, match="reader_listener"):
            await reader.read_next(timeout=1)
        await reader.close()
    assert got == SENT[:5]


# ----------------------------------------------------------------------------- pause


async def test_paused_consumer_gets_only_what_it_had_asked_for(pigeon_standalone, autojump_clock):
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("pause", "s", receiver_queue_size=4)
        consumer.pause()
        assert consumer.paused
        await produce(client, "pause", SENT)
        first = await drain(consumer, idle=2.0)
        assert [m.value for m in first] == SENT[:4], "a paused consumer asked for more"
        for m in first:
            await consumer.acknowledge(m)
        consumer.resume()
        rest = await drain(consumer, idle=2.0)
        assert [m.value for m in rest] == SENT[4:]
        await consumer.close()


async def test_a_paused_consumer_stays_paused_across_a_reconnect(pigeon_standalone, autojump_clock):
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("pause-re", "s", receiver_queue_size=4)
        consumer.pause()
        await produce(client, "pause-re", SENT)
        first = await drain(consumer, idle=2.0)
        for m in first:
            await consumer.acknowledge(m)
        await trio.sleep(1)  # the grouped acks go out
        engine = consumer._handle.engines[0]
        generation = engine.generation
        await unload_topic(pigeon_standalone.service, TopicName.parse(PREFIX + "pause-re"))
        with trio.fail_after(30):
            while not (engine.generation > generation and engine.attached):  # noqa: ASYNC110
                await trio.sleep(0.05)  # the engine's own state: nothing to wait on
        with pytest.raises(Timeout):
            await consumer.receive(timeout=5)
        consumer.resume()
        rest = await drain(consumer, idle=2.0)
        assert [m.value for m in first] == SENT[:4]
        assert [m.value for m in rest] == SENT[4:]
        await consumer.close()


async def test_pause_holds_back_the_listener(pigeon_standalone, autojump_clock):
    got = Seen()
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe(
            "pause-l", "s", message_listener=lambda c, m: got.append(m.value)
        )
        await produce(client, "pause-l", SENT[:5])
        await got.until(5)
        consumer.pause()
        await produce(client, "pause-l", SENT[5:])
        await trio.sleep(5)
        assert got == SENT[:5]
        consumer.resume()
        await got.until(len(SENT))
        assert got == SENT
        await consumer.close()


@pytest.mark.parametrize("how", ["list", "pattern"])
async def test_pause_holds_back_every_topic(pigeon_standalone, autojump_clock, how):
    """A multi-topic consumer, and a pattern consumer finding its topics while paused."""
    a, b = f"pause-{how}-a", f"pause-{how}-b"
    topics: Any = [a, b] if how == "list" else re.compile(PREFIX + f"pause-{how}-.*")
    async with Client(pigeon_standalone.url) as client:
        if how == "list":
            await produce(client, a, [])
            await produce(client, b, [])
        consumer = await client.subscribe(
            topics,
            "s",
            receiver_queue_size=4,
            initial_position="earliest",
            pattern_auto_discovery_period=1.0,
        )
        consumer.pause()
        await produce(client, a, SENT[:10])
        await produce(client, b, SENT[10:])
        await trio.sleep(3)  # the pattern consumer finds both topics
        first = await drain(consumer, idle=2.0)
        assert len(consumer._handle.engines) == 2
        if how == "list":  # what each topic was allowed to send before the pause
            assert sorted(m.value for m in first) == sorted(SENT[:4] + SENT[10:14])
        else:  # a topic found while paused is asked for nothing
            assert first == []
        consumer.resume()
        rest = await drain(consumer, idle=2.0)
        assert sorted(m.value for m in first + rest) == sorted(SENT)
        await consumer.close()


# ----------------------------------------------------------------------------- backoff


async def redelivery_gaps(consumer: Consumer, rounds: int, nack: bool) -> list[float]:
    """The (virtual) time between ``rounds`` successive deliveries of one message, the
    consumer nacking it each time (or letting its ack timeout run out)."""
    times = []
    for _ in range(rounds):
        msg = await consumer.receive(timeout=120)
        times.append(trio.current_time())
        if nack:
            await consumer.negative_acknowledge(msg)
    return [round(b - a, 2) for a, b in itertools.pairwise(times)]


async def test_negative_ack_backoff_doubles_the_delay(pigeon_standalone, autojump_clock):
    backoff = MultiplierRedeliveryBackoff(min_delay=1.0, max_delay=8.0, multiplier=2.0)
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("nack-bo", "s", negative_ack_redelivery_backoff=backoff)
        await produce(client, "nack-bo", [b"x"])
        gaps = await redelivery_gaps(consumer, 6, nack=True)
        # delays 1, 2, 4, 8, 8 (each redelivered up to one 0.1 s housekeeping tick late)
        for gap, delay in zip(gaps, [1, 2, 4, 8, 8], strict=True):
            assert delay <= gap <= delay + 0.3, gaps
        await consumer.close()


async def test_without_backoff_the_nack_delay_is_fixed(pigeon_standalone, autojump_clock):
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("nack-fix", "s", negative_ack_redelivery_delay=1.0)
        await produce(client, "nack-fix", [b"x"])
        gaps = await redelivery_gaps(consumer, 4, nack=True)
        assert all(1 <= g <= 1.3 for g in gaps), gaps
        await consumer.close()


async def test_ack_timeout_backoff_adds_a_growing_delay(pigeon_standalone, autojump_clock):
    backoff = MultiplierRedeliveryBackoff(min_delay=1.0, max_delay=4.0, multiplier=2.0)
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe(
            "ato-bo", "s", ack_timeout=2.0, ack_timeout_redelivery_backoff=backoff
        )
        await produce(client, "ato-bo", [b"x"])
        gaps = await redelivery_gaps(consumer, 5, nack=False)
        # ack timeout 2 s, then the backoff: 1, 2, 4, 4
        for gap, delay in zip(gaps, [3, 4, 6, 6], strict=True):
            assert delay <= gap <= delay + 0.3, gaps
        await consumer.close()

"""What a message carries, and compression codecs, end to end (in-process standalone).

These tests run on trio's real clock (no ``autojump_clock``) where publish times are
compared with the wall clock; everything else is in virtual time.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from pigeon.client import MessageId
from pigeon.client.trio import Client, Producer
from pigeon.core import PluginManager
from pigeon.core.errors import UnknownCodec
from pigeon.core.testing import drain

PREFIX = "persistent://public/default/"
CODECS = ["none", "gzip", "lz4", "zstd"]


async def send_batched(
    client: Client, topic: str, values: list[bytes], batch: int, codec: str = "none", **options: Any
) -> Producer:
    """A producer of ``batch``-message batches (no batching delay to speak of) that sent
    ``values`` (each with ``options``) and flushed them."""
    producer = await client.create_producer(
        topic, compression=codec, batching_max_messages=batch, batching_max_delay_ms=1000
    )
    for value in values:
        await producer.send_async(value, **options)
    await producer.flush()
    return producer


# ----------------------------------------------------------------------------- metadata


async def test_message_fields(pigeon_standalone):
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("fields", "s", negative_ack_redelivery_delay=0.2)
        producer = await client.create_producer("fields", batching_max_messages=1)
        before = time.time() * 1000
        ids = [
            await producer.send(
                f"v{i}".encode(),
                key=f"user-{i}",
                properties={"source": "web", "i": str(i)},
                event_time=1_700_000_000_000 + i,
            )
            for i in range(5)
        ]
        await producer.send(b"bare")
        after = time.time() * 1000
        msgs = [await consumer.receive(timeout=5) for _ in range(6)]
        for i, m in enumerate(msgs[:5]):
            assert m.value == f"v{i}".encode() and m.data == m.value
            assert m.key == f"user-{i}"
            assert m.properties == {"source": "web", "i": str(i)}
            assert m.event_time == 1_700_000_000_000 + i
            assert m.message_id == ids[i]
            assert m.offset == ids[i].offset == i
            assert m.message_id.partition == -1
            assert m.redelivery_count == 0
            assert m.topic == PREFIX + "fields"
        bare = msgs[5]
        assert (bare.key, bare.properties, bare.event_time) == (None, {}, 0)
        publish = [m.publish_time for m in msgs]
        assert publish == sorted(publish), "publish times go backwards"
        assert before - 1000 <= publish[0] and publish[-1] <= after + 1000, (before, publish, after)
        await consumer.negative_acknowledge(msgs[2])
        again = await consumer.receive(timeout=5)
        assert again.message_id == ids[2] and again.redelivery_count == 1
        assert again.publish_time == msgs[2].publish_time and again.key == "user-2"
        await producer.close()
        await consumer.close()


async def test_batched_messages_have_their_own_ids_and_offsets(pigeon_standalone, autojump_clock):
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("batched", "s")
        results: list = []
        values = [f"b{i}".encode() for i in range(8)]
        producer = await send_batched(
            client, "batched", values, 4, callback=lambda mid, err: results.append(mid)
        )
        got = await drain(consumer, idle=1.0)
        assert [m.value for m in got] == values
        assert [m.offset for m in got] == list(range(8))
        assert [m.message_id.batch_index for m in got] == [0, 1, 2, 3, 0, 1, 2, 3]
        assert len({(m.message_id.segment_id, m.message_id.entry_id) for m in got}) == 2
        assert sorted(results) == [m.message_id for m in got]
        # a message id survives serialisation
        mid = got[5].message_id
        assert MessageId.deserialize(mid.serialize()) == mid
        assert MessageId.deserialize(mid.serialize()).offset == 5
        await producer.close()
        await consumer.close()


async def test_last_sequence_id_follows_what_the_broker_stored(pigeon_standalone, autojump_clock):
    """Pulsar's ``last_sequence_id``: -1 for a new name, each acknowledged send, and what
    an earlier session of the same producer name stored."""
    async with Client(pigeon_standalone.url) as client:
        producer = await client.create_producer("lastseq", producer_name="p1")
        assert producer.last_sequence_id == -1
        await producer.send(b"a")
        assert producer.last_sequence_id == 0
        for i in range(5):
            await producer.send_async(b"b%d" % i)
        await producer.flush()
        assert producer.last_sequence_id == 5
        await producer.close()
        again = await client.create_producer("lastseq", producer_name="p1")
        assert again.last_sequence_id == 5
        await again.close()


async def test_acknowledging_part_of_a_batch_redelivers_only_the_rest(
    pigeon_standalone, autojump_clock
):
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("partial", "s", initial_position="earliest")
        producer = await send_batched(client, "partial", [f"p{i}".encode() for i in range(4)], 4)
        got = await drain(consumer, idle=1.0)
        assert len({m.message_id.entry_id for m in got}) == 1
        await consumer.acknowledge(got[0])
        await consumer.acknowledge(got[2])
        await consumer.close()
        consumer = await client.subscribe("partial", "s")
        again = await drain(consumer, idle=1.0)
        assert [m.value for m in again] == [b"p1", b"p3"]
        assert [m.message_id.batch_index for m in again] == [1, 3]
        await producer.close()
        await consumer.close()


# ----------------------------------------------------------------------------- compression


@pytest.mark.parametrize("codec", CODECS)
async def test_every_codec_round_trips(pigeon_standalone, autojump_clock, codec):
    topic = f"codec-{codec}"
    values = [(f"message {i} " * 50).encode() for i in range(20)]
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe(topic, "s")
        producer = await send_batched(
            client, topic, values, 20, codec, key="k", properties={"codec": codec}
        )
        got = await drain(consumer, idle=1.0)
        assert [m.value for m in got] == values
        assert all(m.key == "k" and m.properties == {"codec": codec} for m in got)
        stored = pigeon_standalone.service.topics[PREFIX + topic].ledger.bytes_in
        raw = sum(len(v) for v in values)
        if codec == "none":
            assert stored > raw
        else:
            assert stored < raw / 3, f"{codec} did not compress ({stored} of {raw} bytes stored)"
        await producer.close()
        await consumer.close()


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
async def test_consumer_without_the_codec_gets_unknown_codec(
    pigeon_standalone, autojump_clock, codec
):
    topic = f"missing-{codec}"
    async with (
        Client(pigeon_standalone.url) as client,
        Client(pigeon_standalone.url, plugins=PluginManager(load_entry_points=False)) as bare,
    ):
        consumer = await bare.subscribe(topic, "s")
        producer = await client.create_producer(topic, compression=codec)
        await producer.send(b"squeezed")
        with pytest.raises(UnknownCodec) as info:
            await consumer.receive(timeout=5)
        assert codec in str(info.value)
        with pytest.raises(UnknownCodec) as info:
            await bare.create_producer(topic, compression=codec)
        assert codec in str(info.value)
        # builtin codecs still work for that client
        plain = await bare.create_producer(topic, compression="gzip")
        await plain.close()
        await producer.close()
        await consumer.close()


async def test_each_batch_leaves_when_due_though_one_timer_serves_several(
    pigeon_standalone, autojump_clock
):
    # A partition's batching timer task, woken for a batch that left full, sleeps on
    # until the batch opened meanwhile is due (that batch started no timer of its own):
    # the later batch still leaves batching_max_delay_ms after its first message.
    import trio

    async with Client(pigeon_standalone.url) as client:
        producer = await client.create_producer(
            "timer-rearm", batching_max_messages=2, batching_max_delay_ms=100
        )
        done: list[tuple[float, Any]] = []
        all_done = trio.Event()

        def record(mid: Any, error: Any) -> None:
            done.append((trio.current_time(), error))
            if len(done) == 3:
                all_done.set()

        start = trio.current_time()
        await producer.send_async(b"a", callback=record)  # opens batch 1: its timer starts
        await trio.sleep(0.01)
        await producer.send_async(b"b", callback=record)  # batch 1 is full: it leaves
        await trio.sleep(0.01)
        await producer.send_async(b"c", callback=record)  # batch 2 opens at 20 ms
        with trio.fail_after(1):
            await all_done.wait()
        assert [error for _at, error in done] == [None, None, None]
        # batch 2 left when due (20 + 100 ms), not with the first timer (100 ms), not never
        assert done[2][0] - start == pytest.approx(0.12, abs=0.005)
        await producer.close()

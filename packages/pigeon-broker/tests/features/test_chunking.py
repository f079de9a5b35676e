"""Chunking: messages larger than an entry travel as chunks and come back whole.

The trio face in virtual time against an in-process standalone; producers chunk small
messages with ``chunk_max_message_size`` (the broker's limit is megabytes).  The sync and
asyncio faces (and the 50 MB message) are in ``packages/pigeon-client/tests/test_chunking.py``.
"""

from __future__ import annotations

import re
import time

import pytest
import trio
from standalone_support import CHUNK, PREFIX, backlog, chunking_producer, raw_sends

from pigeon.client import ChunkMessageId, MessageTooLarge
from pigeon.client.trio import Client
from pigeon.core.batch import encode_batch
from pigeon.core.codecs import NONE
from pigeon.core.errors import InvalidArgument
from pigeon.core.testing import drain, receive_n

#: a value of five chunks and a bit (every byte position distinguishable)
BIG = bytes(range(256)) * (5 * CHUNK // 256) + b"tail"


async def test_a_chunked_message_comes_back_whole_and_one_ack_acks_every_chunk(
    client, pigeon_standalone, autojump_clock
):
    consumer = await client.subscribe("big", "s", initial_position="earliest")
    producer = await chunking_producer(client, "big")
    sent = await producer.send(BIG, key="k1", properties={"kind": "blob"}, event_time=7)
    await producer.send(b"small")
    assert isinstance(sent, ChunkMessageId)
    assert sent.first_chunk_message_id.offset == 0 and sent.offset == 5
    msg = await consumer.receive(timeout=10)
    assert msg.value == BIG and msg.data == BIG
    assert (msg.key, msg.properties, msg.event_time) == ("k1", {"kind": "blob"}, 7)
    assert msg.message_id == sent and len(msg.message_id.chunk_ids) == 6
    small = await consumer.receive(timeout=10)
    assert small.value == b"small" and small.offset == 6
    assert backlog(pigeon_standalone, "big", "s") == 7
    await consumer.acknowledge(msg)
    await consumer.acknowledge(small)
    await consumer.close()
    assert backlog(pigeon_standalone, "big", "s") == 0, "every chunk is acknowledged"
    await producer.close()


async def test_chunking_is_refused_with_batching_and_without_it_a_large_message_is(client):
    with pytest.raises(InvalidArgument, match="batching_enabled=False"):
        await client.create_producer("refused", chunking_enabled=True)
    plain = await client.create_producer("refused", batching_enabled=False)
    with pytest.raises(MessageTooLarge):
        await plain.send(b"x" * (6 * 1024 * 1024))
    await plain.close()


async def test_a_message_just_under_max_message_size_is_refused_saying_why(client):
    """max_message_size (5 MiB here) bounds the entry as stored: a value of 5 MiB - 100
    bytes does not fit beside the batch header, and the error says so and how large a
    value may be; a value of exactly that size is stored."""
    producer = await client.create_producer("just-under", batching_enabled=False)
    with pytest.raises(MessageTooLarge) as info:
        await producer.send(b"x" * (5 * 1024 * 1024 - 100))
    text = str(info.value)
    assert "bytes of batch header" in text and "max_message_size 5,242,880" in text, text
    found = re.search(r"a value alone may be at most ([\d,]+) bytes", text)
    assert found, text
    largest = int(found.group(1).replace(",", ""))
    assert 5 * 1024 * 1024 - 1024 < largest < 5 * 1024 * 1024 - 100
    await producer.send(b"x" * largest)  # the size the error names is stored
    with pytest.raises(MessageTooLarge):
        await producer.send(b"x" * (largest + 1))
    await producer.close()


async def test_nack_redelivers_the_whole_message(client, autojump_clock):
    consumer = await client.subscribe(
        "nacked", "s", initial_position="earliest", negative_ack_redelivery_delay=5
    )
    producer = await chunking_producer(client, "nacked")
    await producer.send(BIG)
    first = await consumer.receive(timeout=10)
    await consumer.negative_acknowledge(first)
    again = await consumer.receive(timeout=30)
    assert again.value == BIG and again.redelivery_count == 1
    assert again.message_id == first.message_id
    await consumer.acknowledge(again)
    assert await drain(consumer, idle=10) == []
    await consumer.close()
    await producer.close()


async def test_cumulative_ack_and_seek_to_a_chunked_message(
    client, pigeon_standalone, autojump_clock
):
    consumer = await client.subscribe("seek", "s", initial_position="earliest")
    producer = await chunking_producer(client, "seek")
    await producer.send(b"before")
    await producer.send(BIG)
    await producer.send(b"after")
    msgs = await receive_n(consumer, 3)
    assert [len(m.value) for m in msgs] == [6, len(BIG), 5]
    await consumer.seek(msgs[1].message_id)
    again = await receive_n(consumer, 2)
    assert again[0].value == BIG and again[1].value == b"after"
    await consumer.acknowledge_cumulative(again[0])
    await consumer.close()
    assert backlog(pigeon_standalone, "seek", "s") == 1, "only 'after' is left"
    await producer.close()


async def test_readers_reassemble_and_start_at_a_chunked_message(client, autojump_clock):
    producer = await chunking_producer(client, "read")
    ids = [await producer.send(v) for v in (b"a", BIG, b"b")]
    reader = await client.create_reader("read", "earliest")
    assert [m.value for m in await receive_n(reader, 3)] == [b"a", BIG, b"b"]
    await reader.close()
    reader = await client.create_reader("read", ids[1], start_message_id_inclusive=True)
    assert [m.value for m in await receive_n(reader, 2)] == [BIG, b"b"]
    await reader.close()
    await producer.close()


async def test_key_shared_consumers_each_get_whole_messages(client, autojump_clock):
    c1 = await client.subscribe("keys", "s", subscription_type="key_shared")
    c2 = await client.subscribe("keys", "s", subscription_type="key_shared")
    producer = await chunking_producer(client, "keys")
    for i in range(8):
        producer_value = bytes([i]) * len(BIG)
        await producer.send_async(producer_value, key=f"key-{i}")
    await producer.flush()
    got = await drain(c1, idle=5) + await drain(c2, idle=5)
    assert sorted(m.key for m in got) == [f"key-{i}" for i in range(8)]
    for m in got:
        i = int(m.key.split("-")[1])
        assert m.value == bytes([i]) * len(BIG)
    await c1.close()
    await c2.close()
    await producer.close()


# -- a producer that stops half-way, and resends ------------------------------------------


def chunk_entry(name: str, seq: int, chunk_id: int, parts: list[bytes]) -> tuple[int, int, bytes]:
    """The send of chunk ``chunk_id`` of a message of ``parts``, first sequence id ``seq``."""
    return (
        seq + chunk_id,
        1,
        encode_batch(
            [parts[chunk_id]],
            keys=["k"],
            producer_name=name,
            sequence_id=seq + chunk_id,
            publish_time=int(time.time() * 1000),
            codec=NONE,
            chunk=(f"{name}-{seq}", chunk_id, len(parts), sum(map(len, parts))),
        ),
    )


PARTS = [b"A" * 1000, b"B" * 1000, b"C" * 10]


async def test_a_producer_that_dies_mid_message_leaves_nothing_visible(
    client, pigeon_standalone, autojump_clock
):
    consumer = await client.subscribe("orphans", "s", initial_position="earliest")
    url = pigeon_standalone.url
    # two of three chunks stored, then the producer's connection is gone
    await raw_sends(
        url, PREFIX + "orphans", "crashed", [chunk_entry("crashed", 0, i, PARTS) for i in (0, 1)]
    )
    producer = await client.create_producer("orphans")
    await producer.send(b"next")
    got = await drain(consumer, idle=10)
    assert [m.value for m in got] == [b"next"], "no half message"
    await consumer.acknowledge(got[0])
    await trio.sleep(1)  # acknowledgements go out in groups
    assert backlog(pigeon_standalone, "orphans", "s") == 2, "the orphan chunks wait to expire"
    assert await drain(consumer, idle=70) == []
    assert backlog(pigeon_standalone, "orphans", "s") == 0, "expired chunks are acknowledged"
    await consumer.close()
    await producer.close()


async def test_a_resend_after_a_reconnect_completes_the_message_once(
    client, pigeon_standalone, autojump_clock
):
    consumer = await client.subscribe("resend", "s", initial_position="earliest")
    url, topic = pigeon_standalone.url, PREFIX + "resend"
    await raw_sends(url, topic, "p", [chunk_entry("p", 10, i, PARTS) for i in (0, 1)])
    # reconnected: everything unacknowledged is sent again, under the same sequence ids
    receipts = await raw_sends(url, topic, "p", [chunk_entry("p", 10, i, PARTS) for i in (0, 1, 2)])
    assert [r["duplicate"] for r in receipts] == [True, True, False]
    got = await drain(consumer, idle=10)
    assert [m.value for m in got] == [b"".join(PARTS)]
    assert got[0].key == "k"
    await consumer.close()


async def test_oldest_incomplete_message_is_dropped_when_too_many_are_pending(
    client, pigeon_standalone, autojump_clock
):
    consumer = await client.subscribe(
        "pending",
        "s",
        initial_position="earliest",
        max_pending_chunked_message=1,
        auto_ack_oldest_chunked_message_on_queue_full=True,
        expire_time_of_incomplete_chunked_message=0,
    )
    url, topic = pigeon_standalone.url, PREFIX + "pending"
    # the first chunk of message 0, then message 1 whole: message 0 is pushed out
    await raw_sends(
        url,
        topic,
        "p",
        [chunk_entry("p", 0, 0, PARTS), *(chunk_entry("p", 3, i, PARTS) for i in range(3))],
    )
    got = await drain(consumer, idle=10)
    assert [m.value for m in got] == [b"".join(PARTS)]
    await consumer.acknowledge(got[0])
    await consumer.close()
    assert backlog(pigeon_standalone, "pending", "s") == 0, "the dropped chunk was acked"


@pytest.mark.parametrize("stored_before_drop", [1, 4])
async def test_a_client_producer_that_loses_its_connection_mid_message_stores_it_once(
    client, pigeon_standalone, autojump_clock, stored_before_drop
):
    consumer = await client.subscribe("dropped", "s", initial_position="earliest")
    topic = pigeon_standalone.service.topics[PREFIX + "dropped"]
    # the producer has a client of its own: dropping its connection leaves the consumer's
    async with Client(pigeon_standalone.url) as producing:
        producer = await chunking_producer(producing, "dropped", producer_name="dropper")
        done = trio.Event()
        await producer.send_async(BIG, callback=lambda mid, error: done.set())
        with trio.fail_after(10):
            while topic.next_offset < stored_before_drop:  # noqa: ASYNC110 (no event to wait on)
                await trio.sleep(0.001)
        producer._handle.engines[0].conn.close()  # the network drops the connection
        with trio.fail_after(30):
            await done.wait()  # re-attached and resent what had no receipt
        await producer.close()
    got = await drain(consumer, idle=10)
    assert [m.value for m in got] == [BIG]
    assert topic.next_offset == 6, "every chunk stored once"
    await consumer.close()


async def test_a_message_of_more_chunks_than_the_receiver_queue_still_arrives(
    client, autojump_clock
):
    consumer = await client.subscribe(
        "narrow", "s", initial_position="earliest", receiver_queue_size=2
    )
    producer = await chunking_producer(client, "narrow")
    await producer.send(BIG)  # six chunks
    assert (await consumer.receive(timeout=10)).value == BIG
    await consumer.close()
    await producer.close()

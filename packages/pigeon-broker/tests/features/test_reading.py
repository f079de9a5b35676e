"""Readers, seeking, initial positions, multi-topic and pattern subscriptions (virtual time)."""

from __future__ import annotations

import re

import pytest
import trio
from standalone_support import PREFIX, drain, produce, values

from pigeon.client import MessageId
from pigeon.client.trio import Client
from pigeon.core.errors import InvalidArgument, Timeout

VALUES = [f"value-{i:02d}".encode() for i in range(10)]


# ----------------------------------------------------------------------------- readers


async def test_reader_from_earliest_and_latest(client, autojump_clock):
    await produce(client, "r1", VALUES[:5])
    earliest = await client.create_reader("r1", "earliest")
    latest = await client.create_reader("r1", "latest")
    await produce(client, "r1", VALUES[5:])
    assert values(await drain(earliest)) == VALUES
    assert values(await drain(latest)) == VALUES[5:]
    await earliest.close()
    await latest.close()


async def test_reader_from_a_message_id_exclusive_and_inclusive(client, autojump_clock):
    ids = await produce(client, "r2", VALUES)
    after = await client.create_reader("r2", ids[3])
    assert values(await drain(after)) == VALUES[4:]
    inclusive = await client.create_reader("r2", ids[3], start_message_id_inclusive=True)
    assert values(await drain(inclusive)) == VALUES[3:]
    # a MessageId that went through (de)serialisation works the same
    restored = MessageId.deserialize(ids[6].serialize())
    assert values(await drain(await client.create_reader("r2", restored))) == VALUES[7:]
    with pytest.raises(InvalidArgument):
        await client.create_reader("r2", "middle")
    for r in (after, inclusive):
        await r.close()


async def test_read_next_and_has_message_available(client, autojump_clock):
    await produce(client, "r3", VALUES[:4])
    reader = await client.create_reader("r3", "earliest")
    got = []
    while await reader.has_message_available():
        got.append(await reader.read_next(timeout=5))
    assert values(got) == VALUES[:4]
    assert not await reader.has_message_available()
    with pytest.raises(Timeout):
        await reader.read_next(timeout=2)
    await produce(client, "r3", [b"more"])
    assert await reader.has_message_available()
    assert (await reader.read_next(timeout=5)).value == b"more"
    assert not await reader.has_message_available()
    await reader.close()


async def test_readers_leave_no_durable_subscription(pigeon_standalone, client, autojump_clock):
    await produce(client, "r4", VALUES[:2])
    reader = await client.create_reader("r4", "earliest")
    assert len(await drain(reader)) == 2
    await reader.close()
    subs = pigeon_standalone.service.topics[PREFIX + "r4"].subscriptions
    assert all(not s.durable for s in subs.values())


# ----------------------------------------------------------------------------- seeking


async def test_consumer_seek_by_message_id_offset_and_timestamp(client, autojump_clock):
    consumer = await client.subscribe("seek", "s", initial_position="earliest")
    producer = await client.create_producer("seek", batching_max_messages=1)
    for v in VALUES:
        await producer.send(v)
        await trio.sleep(0.01)
    got = await drain(consumer)
    assert values(got) == VALUES
    await consumer.acknowledge_cumulative(got[-1])

    await consumer.seek(got[4].message_id)
    assert values(await drain(consumer)) == VALUES[4:]

    await consumer.seek(offset=7)
    assert values(await drain(consumer)) == VALUES[7:]

    await consumer.seek(offset=0)
    again = await drain(consumer)
    assert values(again) == VALUES, "seek back to an acknowledged offset redelivers"

    ts = got[6].publish_time
    await consumer.seek(timestamp=ts)
    expected = [m.value for m in got if m.publish_time >= ts]
    assert values(await drain(consumer)) == expected and expected[0] <= VALUES[6]

    await consumer.seek(timestamp=got[-1].publish_time + 60_000)
    assert await drain(consumer) == []
    await producer.close()
    await consumer.close()


async def test_seek_is_durable_for_the_subscription(client, autojump_clock):
    consumer = await client.subscribe("seek-durable", "s", initial_position="earliest")
    await produce(client, "seek-durable", VALUES)
    got = await drain(consumer)
    await consumer.acknowledge_cumulative(got[-1])
    await consumer.seek(offset=8)
    await consumer.close()
    consumer = await client.subscribe("seek-durable", "s")
    assert values(await drain(consumer)) == VALUES[8:]
    await consumer.close()


async def test_reader_seek(client, autojump_clock):
    ids = await produce(client, "reader-seek", VALUES)
    reader = await client.create_reader("reader-seek", "earliest")
    assert values(await drain(reader)) == VALUES
    await reader.seek(ids[2])
    assert values(await drain(reader)) == VALUES[2:]
    await reader.seek(offset=9)
    assert (await reader.read_next(timeout=5)).value == VALUES[9]
    await reader.close()


async def test_offsets_and_message_ids_still_point_right_after_segment_rollovers(
    small_segments, autojump_clock
):
    """Two-entry segments: seeks and reader starts land on the asked-for message."""
    async with Client(small_segments.url) as client:
        ids = await produce(client, "rolled", VALUES)
        assert len({mid.segment_id for mid in ids}) >= 4
        assert [mid.offset for mid in ids] == list(range(10))
        for k in range(9):
            reader = await client.create_reader("rolled", ids[k])
            first = await reader.read_next(timeout=5)
            assert (first.value, first.offset) == (VALUES[k + 1], k + 1), f"reader after {ids[k]}"
            await reader.close()
        consumer = await client.subscribe("rolled", "s", initial_position="earliest")
        assert values(await drain(consumer)) == VALUES
        for k in (2, 5, 8):
            await consumer.seek(offset=k)
            assert values(await drain(consumer)) == VALUES[k:], f"seek(offset={k})"
        await consumer.close()


# ----------------------------------------------------------------------------- positions


async def test_initial_position_earliest_and_latest(client, autojump_clock):
    await produce(client, "pos", VALUES[:3])
    early = await client.subscribe("pos", "early", initial_position="earliest")
    late = await client.subscribe("pos", "late")  # latest is the default
    await produce(client, "pos", VALUES[3:5])
    assert values(await drain(early)) == VALUES[:5]
    assert values(await drain(late)) == VALUES[3:5]
    await early.close()
    await late.close()
    # an existing subscription resumes at its cursor, whatever initial_position says
    await produce(client, "pos", VALUES[5:6])
    late = await client.subscribe("pos", "late", initial_position="earliest")
    assert values(await drain(late)) == VALUES[3:6]
    await late.close()


# ----------------------------------------------------------------------------- multi-topic


async def test_multi_topic_subscription(client, autojump_clock):
    consumer = await client.subscribe(["orders", "refunds"], "billing")
    await produce(client, "orders", [b"o1", b"o2"])
    await produce(client, "refunds", [b"r1"])
    got = await drain(consumer)
    assert sorted(values(got)) == [b"o1", b"o2", b"r1"]
    assert {m.topic for m in got} == {PREFIX + "orders", PREFIX + "refunds"}
    for m in got:
        await consumer.acknowledge(m)
    await consumer.close()
    consumer = await client.subscribe(["orders", "refunds"], "billing")
    assert await drain(consumer) == [], "acks through a multi-topic consumer were lost"
    await consumer.close()


async def test_pattern_subscription_picks_up_new_topics(client, autojump_clock):
    await produce(client, "sensor-a", [b"a0"])
    await produce(client, "other", [b"no"])
    consumer = await client.subscribe(
        re.compile(r"persistent://public/default/sensor-.*"),
        "all-sensors",
        initial_position="earliest",
        pattern_auto_discovery_period=5,
    )
    assert values(await drain(consumer, idle=1)) == [b"a0"]
    await client.create_topic("sensor-b")
    start = trio.current_time()
    await produce(client, "sensor-b", [b"b0"])
    msg = await consumer.receive(timeout=10)
    assert msg.value == b"b0" and msg.topic == PREFIX + "sensor-b"
    assert trio.current_time() - start <= 5.5, "discovered later than its period"
    await produce(client, "other-2", [b"no"])
    assert await drain(consumer, idle=8) == []
    await consumer.close()


async def test_reader_from_earliest_after_trimming_starts_at_the_first_stored_message(
    small_segments, autojump_clock
):
    """Retention trims consumed head segments; 'earliest' is the oldest message still stored."""
    cluster = small_segments
    async with Client(cluster.url) as client:
        consumer = await client.subscribe("trimmed", "s", initial_position="earliest")
        await produce(client, "trimmed", VALUES)
        got = await drain(consumer)
        await consumer.acknowledge_cumulative(got[4])
        await trio.sleep(3)  # maintenance trims the consumed segments (retention 0)
        led = cluster.service.topics[PREFIX + "trimmed"].ledger
        stored = []
        pos = led.start_position()
        while entries := await led.read(pos):
            stored += [e.first_offset + i for e in entries for i in range(e.num_messages)]
            pos = led.next_position(entries[-1].position)
        assert 0 < len(stored) < 10 and stored == list(range(10 - len(stored), 10))
        reader = await client.create_reader("trimmed", "earliest")
        assert [m.offset for m in await drain(reader)] == stored, "'earliest' skipped stored data"
        late = await client.subscribe("trimmed", "late", initial_position="earliest")
        assert [m.offset for m in await drain(late)] == stored
        # the segments' metadata agrees with what they hold
        for seg in led.segments:
            if seg.entries:
                first = await led.read_one((seg.id, 0))
                assert seg.first_offset == first.first_offset, seg
        await reader.close()
        await late.close()
        await consumer.close()

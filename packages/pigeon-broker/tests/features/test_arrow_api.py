"""The Arrow producer and consumer API (``send_arrow``, ``receive_arrow``, ``read_arrow``,
``acknowledge_arrow``): the trio face in virtual time against an in-process standalone;
thin sync and asyncio tests against one standalone thread per module."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import pyarrow as pa
import pytest
import trio
from standalone_support import drain

from pigeon.client import Client, EntryReceipt, MessageId
from pigeon.client import asyncio as aio
from pigeon.client.arrow import SOURCE_COLUMNS
from pigeon.core.errors import InvalidArgument, MessageTooLarge, Timeout

PROPS = pa.map_(pa.string(), pa.string())
TS = pa.timestamp("us", tz="UTC")


def table(n: int, start: int = 0) -> pa.Table:
    """``n`` rows with every column kind: null keys, empty and missing properties, unset
    event times."""
    rows = range(start, start + n)
    return pa.table(
        {
            "v": pa.array([f"value-{i}".encode() for i in rows], pa.binary()),
            "k": pa.array([None if i % 3 == 0 else f"key-{i}" for i in rows], pa.string()),
            "p": pa.array(
                [
                    None if i % 4 == 0 else {} if i % 4 == 1 else {"i": str(i), "z": "é"}
                    for i in rows
                ],
                PROPS,
            ),
            "t": pa.array(
                [None if i % 5 == 0 else 1_700_000_000_000 + i for i in rows], pa.int64()
            ),
        }
    )


def expected(t: pa.Table) -> list[tuple[Any, ...]]:
    return [
        (
            r["k"].encode() if r["k"] is not None else None,
            r["v"],
            dict(r["p"] or []),
            r["t"] or None,
        )
        for r in t.to_pylist()
    ]


def seen(rb: pa.RecordBatch | pa.Table) -> list[tuple[Any, ...]]:
    return [
        (
            r["key"],
            r["value"],
            dict(r["properties"]),
            int(r["event_time"].timestamp() * 1000) if r["event_time"] is not None else None,
        )
        for r in rb.to_pylist()
    ]


def address_range(data: Any) -> tuple[int, int]:
    buf = pa.py_buffer(data)
    return buf.address, buf.address + buf.size


async def receive_rows(consumer: Any, n: int, max_rows: int = 10_000) -> list[pa.RecordBatch]:
    out: list[pa.RecordBatch] = []
    got = 0
    with trio.fail_after(30):
        while got < n:
            rb = await consumer.receive_arrow(max_rows, timeout=10)
            out.append(rb)
            got += rb.num_rows
    assert got == n
    return out


# ----------------------------------------------------------------------------- trio face


async def test_round_trip_of_every_column_kind_split_into_entries(client, autojump_clock):
    consumer = await client.subscribe("arrow-rt", "s")
    producer = await client.create_producer(
        "arrow-rt", batching_max_messages=40, batching_max_bytes=1 << 20
    )
    data = table(100)
    receipts = await producer.send_arrow(data, value="v", key="k", properties="p", event_time="t")
    assert [r.num_rows for r in receipts] == [40, 40, 20], "split at batching_max_messages"
    assert all(isinstance(r, EntryReceipt) for r in receipts)
    assert [o for r in receipts for o in r.offsets] == list(range(100))
    batches = await receive_rows(consumer, 100)
    assert [b.num_rows for b in batches] == [40, 40, 20], "one record batch per entry"
    got = pa.Table.from_batches(batches)
    assert got.column_names == [name for name, _ in SOURCE_COLUMNS], "the Spark source's"
    assert got.schema.field("publish_time").type == TS
    assert got.schema.field("properties").type == PROPS
    assert seen(got) == expected(data)
    assert got["offset"].to_pylist() == list(range(100))
    assert got["topic"].to_pylist() == ["persistent://public/default/arrow-rt"] * 100
    ids = [MessageId.deserialize(m) for m in got["message_id"].to_pylist()]
    assert ids[41] == receipts[1].message_id(1) and ids[-1] == receipts[2].last
    await consumer.close()
    await producer.close()


async def test_split_at_max_bytes_and_sliced_input(client, autojump_clock):
    consumer = await client.subscribe("arrow-bytes", "s")
    producer = await client.create_producer(
        "arrow-bytes", batching_max_messages=1000, batching_max_bytes=1000
    )
    data = pa.table({"value": [bytes([i % 251]) * 100 for i in range(50)]})
    part = data.slice(7, 31)  # offsets of a slice do not start at 0
    receipts = await producer.send_arrow(part)
    # a batch is full with the message that takes it to batching_max_bytes
    assert [r.num_rows for r in receipts] == [10, 10, 10, 1]
    got = pa.Table.from_batches(await receive_rows(consumer, 31))
    assert got["value"].to_pylist() == part["value"].to_pylist()
    assert got["key"].null_count == 31 and got["event_time"].null_count == 31
    assert got["properties"].to_pylist() == [[]] * 31
    await consumer.close()
    await producer.close()


async def test_receive_wraps_the_entry_without_copying(client, autojump_clock):
    consumer = await client.subscribe("arrow-zero", "s")
    core = consumer._handle.core
    received: list[Any] = []
    push = core.push
    core.push = lambda entries: (received.extend(entries), push(entries))[1]
    producer = await client.create_producer("arrow-zero", batching_max_messages=1000)
    data = pa.table({"value": [b"x" * 100] * 64, "key": [f"k{i}" for i in range(64)]})
    await producer.send_arrow(data, key="key")
    rb = await consumer.receive_arrow(1000, timeout=10)
    assert rb.num_rows == 64 and len(received) == 1
    lo, hi = address_range(received[0].data)
    for name in ("value", "key"):
        data_buffer = rb.column(name).buffers()[2]
        assert lo <= data_buffer.address and data_buffer.address + data_buffer.size <= hi, (
            f"the {name} column was copied out of the received entry"
        )
    assert rb.column("value").to_pylist() == data["value"].to_pylist()
    await consumer.close()
    await producer.close()


async def test_mixed_arrow_and_single_messages_keep_order(client, autojump_clock):
    consumer = await client.subscribe("arrow-mixed", "s")
    producer = await client.create_producer("arrow-mixed", batching_max_messages=5)
    other = await client.create_producer("arrow-mixed", batching_max_messages=5)
    await producer.send_async(b"single-0")
    await producer.send_async(b"single-1")  # batched, not sealed yet
    await producer.send_arrow(pa.table({"value": [b"arrow-0", b"arrow-1", b"arrow-2"]}))
    await producer.send(b"single-2")
    await other.send(b"other-0")
    await producer.send_arrow(pa.record_batch({"value": [b"arrow-3"]}))
    got = await drain(consumer)
    assert [m.value for m in got] == [
        b"single-0",
        b"single-1",
        b"arrow-0",
        b"arrow-1",
        b"arrow-2",
        b"single-2",
        b"other-0",
        b"arrow-3",
    ]
    assert [m.offset for m in got] == list(range(8))
    await consumer.close()
    await producer.close()
    await other.close()


async def test_acknowledge_arrow_and_cumulative(client, autojump_clock):
    consumer = await client.subscribe("arrow-ack", "s", subscription_type="failover")
    producer = await client.create_producer("arrow-ack", batching_max_messages=10)
    await producer.send_arrow(pa.table({"value": [f"m{i}".encode() for i in range(30)]}))
    first = await consumer.receive_arrow(4, timeout=10)  # part of an entry
    rest = await consumer.receive_arrow(100, timeout=10)  # the rest of that entry
    assert (first.num_rows, rest.num_rows) == (4, 6)
    await consumer.acknowledge_arrow(first)
    third = await consumer.receive_arrow(100, timeout=10)
    assert third["offset"].to_pylist() == list(range(10, 20))
    last = MessageId.deserialize(third["message_id"][-1].as_py())
    await consumer.acknowledge_cumulative(last)  # everything up to offset 19
    await trio.sleep(1)  # grouped acks go out within 100 ms
    await consumer.close()
    consumer = await client.subscribe("arrow-ack", "s", subscription_type="failover")
    again = pa.Table.from_batches(await receive_rows(consumer, 10))
    assert again["offset"].to_pylist() == list(range(20, 30))
    await consumer.close()
    # rows of a partly acknowledged entry come back without the acknowledged ones
    consumer = await client.subscribe("arrow-ack", "t", initial_position="earliest")
    rb = await consumer.receive_arrow(100, timeout=10)
    await consumer.acknowledge_arrow(rb.slice(2, 3))
    await trio.sleep(1)
    await consumer.close()
    consumer = await client.subscribe("arrow-ack", "t")
    back = await consumer.receive_arrow(100, timeout=10)
    assert back["offset"].to_pylist() == [0, 1, 5, 6, 7, 8, 9]
    await consumer.close()
    await producer.close()


async def test_reader_reads_arrow(client, autojump_clock):
    producer = await client.create_producer("arrow-reader", batching_max_messages=8)
    await producer.send_arrow(pa.table({"value": [f"r{i}".encode() for i in range(20)]}))
    reader = await client.create_reader("arrow-reader", "earliest")
    rows: list[bytes] = []
    with trio.fail_after(30):
        while len(rows) < 20:
            rows.extend((await reader.read_arrow(5, timeout=10))["value"].to_pylist())
    assert rows == [f"r{i}".encode() for i in range(20)]
    with pytest.raises(Timeout):
        await reader.read_arrow(timeout=1)
    await reader.close()
    await producer.close()


async def test_keyed_rows_go_to_the_key_hash_partition(client, autojump_clock):
    await client.create_topic("arrow-parts", partitions=3)
    consumer = await client.subscribe("arrow-parts", "s")
    producer = await client.create_producer("arrow-parts")
    keys = [f"key-{i}" for i in range(30)]
    await producer.send_arrow(
        pa.table({"value": [k.encode() for k in keys], "key": keys}), key="key"
    )
    got = pa.Table.from_batches(await receive_rows(consumer, 30))
    for row in got.to_pylist():
        assert row["partition"] == zlib.crc32(row["key"]) % 3
        assert row["value"] == row["key"]
    for p in range(3):  # order kept within each partition
        mine = [r["value"] for r in got.to_pylist() if r["partition"] == p]
        assert mine == [k.encode() for k in keys if zlib.crc32(k.encode()) % 3 == p]
    await consumer.close()
    await producer.close()


async def test_bad_input_is_refused_before_anything_is_sent(client, autojump_clock):
    producer = await client.create_producer("arrow-bad", max_pending_messages=10)
    with pytest.raises(InvalidArgument, match="no value column"):
        await producer.send_arrow(pa.table({"x": [b"a"]}))
    with pytest.raises(InvalidArgument, match="binary or string"):
        await producer.send_arrow(pa.table({"value": [1, 2]}))
    with pytest.raises(InvalidArgument, match="nulls"):
        await producer.send_arrow(pa.table({"value": [b"a", None]}))
    with pytest.raises(InvalidArgument, match="map<string, string>"):
        await producer.send_arrow(pa.table({"value": [b"a"], "p": [1]}), properties="p")
    with pytest.raises(InvalidArgument, match="Table or RecordBatch"):
        await producer.send_arrow([b"a"])
    with pytest.raises(MessageTooLarge, match="does not chunk"):
        await producer.send_arrow(pa.table({"value": [b"x" * (6 << 20)]}))
    assert await producer.send(b"still fine")
    await producer.close()


# ----------------------------------------------------------------------- sync and asyncio


def test_sync_face_round_trip(admin_standalone):
    with Client(admin_standalone.service_url) as client:
        with (
            client.subscribe("arrow-sync", "s", initial_position="earliest") as consumer,
            client.create_producer("arrow-sync", batching_max_messages=25) as producer,
        ):
            data = table(60)
            futures = producer.send_arrow(data, value="v", key="k", properties="p", event_time="t")
            receipts = [f.result(10) for f in futures]
            assert [r.num_rows for r in receipts] == [25, 25, 10]
            batches = []
            while sum(b.num_rows for b in batches) < 60:
                batches.append(consumer.receive_arrow(timeout=10))
            assert seen(pa.Table.from_batches(batches)) == expected(data)
            for b in batches:
                consumer.acknowledge_arrow(b)
        with client.create_reader("arrow-sync", "earliest") as reader:
            assert reader.read_arrow(7, timeout=10)["offset"].to_pylist() == list(range(7))


def test_asyncio_face_round_trip(admin_standalone):
    async def scenario() -> None:
        async with aio.Client(admin_standalone.service_url) as client:
            consumer = await client.subscribe("arrow-aio", "s", initial_position="earliest")
            producer = await client.create_producer("arrow-aio", batching_max_messages=25)
            data = table(30)
            receipts = await producer.send_arrow(data, value="v", key="k", properties="p")
            assert [r.num_rows for r in receipts] == [25, 5]
            rows = []
            while len(rows) < 30:
                rb = await consumer.receive_arrow(timeout=10)
                await consumer.acknowledge_arrow(rb)
                rows.extend(rb["value"].to_pylist())
            assert rows == data["v"].to_pylist()
            reader = await client.create_reader("arrow-aio", "earliest")
            assert (await reader.read_arrow(3, timeout=10)).num_rows == 3
            await reader.close()
            await producer.close()
            await consumer.close()

    asyncio.run(scenario())


async def test_sequence_ids_continue_across_arrow_and_single_sends(client, autojump_clock):
    producer = await client.create_producer(
        "arrow-seq", producer_name="seq", batching_max_messages=8
    )
    await producer.send(b"first")  # sequence id 0
    await producer.send_arrow(pa.table({"value": [b"r"] * 20}))  # 1 .. 20
    await producer.close()
    again = await client.create_producer("arrow-seq", producer_name="seq")
    assert again._handle.engines[0].last_sequence_id == 20, "the broker stored every row's id"
    await again.send(b"next")
    await again.close()
    consumer = await client.subscribe("arrow-seq", "s", initial_position="earliest")
    got = await drain(consumer)
    assert [m.value for m in got] == [b"first", *[b"r"] * 20, b"next"]
    await consumer.close()


async def test_a_replayed_table_with_its_sequence_id_is_stored_once(client, autojump_clock):
    # what the Spark sink's exactly-once writes rest on: rows numbered from sequence_id
    producer = await client.create_producer(
        "arrow-replay", producer_name="spark-q-0", batching_max_messages=8
    )
    data = pa.table({"value": [b"row-%d" % i for i in range(20)]})
    first = await producer.send_arrow(data, sequence_id=1 << 32)
    assert not any(r.duplicate for r in first)
    again = await producer.send_arrow(data, sequence_id=1 << 32)  # the micro-batch re-run
    assert [r.duplicate for r in again] == [True, True, True]
    with pytest.raises(InvalidArgument, match="sequence_id must be an int"):
        await producer.send_arrow(data, sequence_id=-1)
    await producer.close()
    consumer = await client.subscribe("arrow-replay", "s", initial_position="earliest")
    assert [m.value for m in await drain(consumer)] == data["value"].to_pylist()
    await consumer.close()
    await client.create_topic("arrow-replay-parts", 2)
    parts = await client.create_producer("arrow-replay-parts")
    with pytest.raises(InvalidArgument, match="producer of one partition"):
        await parts.send_arrow(data, sequence_id=0)
    await parts.close()


def test_perf_arrow_produces_and_consumes_tables(admin_standalone):
    from pigeon.client._cli import run_perf_consume, run_perf_produce

    url = admin_standalone.service_url
    run_perf_consume(url, "perf-arrow", duration=0.1, idle_timeout=0.1, progress=False)
    produced = run_perf_produce(
        url, "perf-arrow", size=100, duration=0.3, arrow=True, arrow_rows=500, progress=False
    )
    assert produced["api"] == "send_arrow"
    assert produced["messages"] > 0 and produced["messages"] % 500 == 0
    assert produced["mb_per_s"] > 0 and produced["latency_samples"] > 0
    consumed = run_perf_consume(
        url, "perf-arrow", arrow=True, max_messages=produced["messages"], progress=False
    )
    assert consumed["api"] == "receive_arrow"
    assert consumed["messages"] == produced["messages"]
    assert consumed["bytes"] == 100 * produced["messages"]

"""Compacted topics: the latest message per key, tombstones, the horizon and the live
tail, read_compacted consumers and readers, TableView (trio face; virtual time)."""

from __future__ import annotations

import dataclasses

import pytest
import trio
from standalone_support import PREFIX, drain

from pigeon.broker._ledger_compaction import LatestPerKey, pack_compacted, unpack_compacted
from pigeon.core import TopicName
from pigeon.core.errors import InvalidArgument


async def send_kv(client, topic, pairs, *, batch=1):
    """``pairs`` of (key, value) sent in order (``batch`` messages per entry)."""
    producer = await client.create_producer(
        topic, batching_max_messages=batch, batching_max_delay_ms=1000
    )
    for key, value in pairs:
        await producer.send_async(value, key=key)
    await producer.flush()
    await producer.close()


async def compact(cluster, topic):
    t = await cluster.service.get_topic(TopicName.parse(PREFIX + topic))
    await t.compact()
    assert t.ledger.compaction_status["status"] == "SUCCESS", t.ledger.compaction_status
    return t


def kv(msgs):
    return [(m.key, m.value) for m in msgs]


HISTORY = [
    ("a", b"a1"),
    ("b", b"b1"),
    ("a", b"a2"),
    ("c", b"c1"),
    (None, b"no-key"),
    ("b", b""),  # tombstone: b goes
    ("a", b"a3"),
    ("d", b"d1"),
]
#: what a compacted reader of HISTORY then ("e", b"e1") gets
AFTER_E = [("c", b"c1"), ("a", b"a3"), ("d", b"d1"), ("e", b"e1")]


async def compacted_then_trimmed(cluster, client, topic):
    """``topic`` with HISTORY sent and compacted, then ("e", b"e1") sent and the log
    trimmed below the horizon (retention 0: the compacted messages are only in the
    compacted ledger now); the topic."""
    await send_kv(client, topic, HISTORY)
    t = await compact(cluster, topic)
    await send_kv(client, topic, [("e", b"e1")])
    await t.maintain(cluster.service.policies.cached(t.name.namespace_name))
    return t


def test_latest_per_key_model():
    latest = LatestPerKey()
    latest.add(0, [b"a", b"b", None, b"a"], [1, 1, 1, 1])
    latest.add(4, [b"b", b"c"], [0, 1])
    assert latest.latest == {b"a": 3, b"c": 5}
    assert latest.kept(0, [b"a", b"b", None, b"a"]) == [3]
    assert latest.kept(4, [b"b", b"c"]) == [1]
    record = pack_compacted((7, 9), [1, 3], b"x" * 40)
    assert unpack_compacted(record)[:2] == ((7, 9), [1, 3])
    assert bytes(unpack_compacted(record)[2]) == b"x" * 40


@pytest.mark.parametrize("batch", [1, 4])
async def test_compacted_reader_sees_latest_per_key_then_the_tail(
    pigeon_standalone, client, autojump_clock, batch
):
    topic = f"compact-{batch}"
    await send_kv(client, topic, HISTORY, batch=batch)
    t = await compact(pigeon_standalone, topic)
    horizon = t.ledger.compacted.horizon
    assert horizon == len(HISTORY)
    await send_kv(client, topic, [("c", b"c2"), ("e", b"e1")])
    reader = await client.create_reader(topic, "earliest", read_compacted=True)
    got = await drain(reader)
    # the compacted view (original order and offsets), then the tail as it is
    assert kv(got) == [("c", b"c1"), ("a", b"a3"), ("d", b"d1"), ("c", b"c2"), ("e", b"e1")]
    assert [m.offset for m in got] == [3, 6, 7, 8, 9]
    await reader.close()
    # without read_compacted everything is still there
    plain = await client.create_reader(topic, "earliest")
    assert len(await drain(plain)) == len(HISTORY) + 2
    await plain.close()


async def test_compacting_again_keeps_the_previous_view_and_deletes_the_old_ledger(
    pigeon_standalone, client, autojump_clock
):
    await send_kv(client, "compact-again", [("k", f"v{i}".encode()) for i in range(20)])
    t = await compact(pigeon_standalone, "compact-again")
    first = t.ledger.compacted.id
    await send_kv(client, "compact-again", [("j", b"j1"), ("k", b""), ("m", b"m1")])
    await compact(pigeon_standalone, "compact-again")
    assert t.ledger.compacted.id != first
    assert t.ledger.compacted.horizon == 23
    store = pigeon_standalone.service.store
    assert await store.get(f"/pigeon/segments/{first:016x}") is None
    reader = await client.create_reader("compact-again", "earliest", read_compacted=True)
    assert kv(await drain(reader)) == [("j", b"j1"), ("m", b"m1")]
    await reader.close()
    # the __compaction subscription holds the log at the horizon
    assert t.subscriptions["__compaction"].cursor.mark_delete == 23
    stats = t.internal_stats()
    assert stats["compaction_horizon"] == 23
    assert stats["compacted_ledger"]["id"] == t.ledger.compacted.id


async def test_compacted_view_outlives_the_trimmed_log(
    small_segments, small_segments_client, autojump_clock
):
    client = small_segments_client
    t = await compacted_then_trimmed(small_segments, client, "compact-trim")
    assert t.ledger.first_offset >= len(HISTORY)  # retention 0: compacted messages gone
    reader = await client.create_reader("compact-trim", "earliest", read_compacted=True)
    assert kv(await drain(reader)) == AFTER_E
    await reader.close()
    async with await client.create_table_view("compact-trim") as view:
        assert dict(view.items()) == {"a": b"a3", "c": b"c1", "d": b"d1", "e": b"e1"}


async def test_read_compacted_consumer_acknowledges_and_resumes(
    pigeon_standalone, client, autojump_clock
):
    await send_kv(client, "compact-sub", HISTORY)
    await compact(pigeon_standalone, "compact-sub")
    consumer = await client.subscribe(
        "compact-sub", "s", initial_position="earliest", read_compacted=True
    )
    got = await drain(consumer)
    assert kv(got) == [("c", b"c1"), ("a", b"a3"), ("d", b"d1")]
    for m in got:
        await consumer.acknowledge(m)
    await consumer.close()
    t = await pigeon_standalone.service.get_topic(TopicName.parse(PREFIX + "compact-sub"))
    await t.subscriptions["s"].persist()
    assert t.subscriptions["s"].cursor.mark_delete == len(HISTORY)
    await send_kv(client, "compact-sub", [("z", b"z1")])
    again = await client.subscribe("compact-sub", "s", read_compacted=True)
    assert kv(await drain(again)) == [("z", b"z1")]
    await again.close()


async def test_read_compacted_is_refused_on_shared_subscriptions(client, autojump_clock):
    with pytest.raises(InvalidArgument, match="read_compacted"):
        await client.subscribe(
            "compact-shared", "s", subscription_type="shared", read_compacted=True
        )


async def test_table_view_trio(pigeon_standalone, client, autojump_clock):
    await send_kv(client, "compact-tv", HISTORY)
    await compact(pigeon_standalone, "compact-tv")
    await send_kv(client, "compact-tv", [("c", b"c2")])
    async with await client.create_table_view("compact-tv") as view:
        assert dict(view.items()) == {"a": b"a3", "c": b"c2", "d": b"d1"}
        assert len(view) == 3 and "a" in view and "b" not in view
        assert view.get("a") == b"a3" and view.get("b") is None
        seen = []
        updated = trio.Event()

        def listen(key, value):
            seen.append((key, value))
            if len(seen) >= 5:
                updated.set()

        view.for_each_and_listen(listen)
        assert sorted(seen) == [("a", b"a3"), ("c", b"c2"), ("d", b"d1")]
        await send_kv(client, "compact-tv", [("a", b"a4"), ("d", b"")])
        with trio.fail_after(10):
            await updated.wait()
        assert seen[3:] == [("a", b"a4"), ("d", None)]
        assert dict(view.items()) == {"a": b"a4", "c": b"c2"}


async def test_table_view_when_the_last_message_is_a_tombstone(
    pigeon_standalone, client, autojump_clock
):
    await send_kv(client, "compact-tomb", [("a", b"1"), ("b", b"2"), ("b", b"")])
    await compact(pigeon_standalone, "compact-tomb")
    async with await client.create_table_view("compact-tomb") as view:
        assert dict(view.items()) == {"a": b"1"}


@pytest.mark.parametrize(
    "expiry",
    [
        {"message_ttl_s": 10},
        {"backlog_quota_bytes": 0, "backlog_quota_policy": "consumer_backlog_eviction"},
    ],
)
async def test_expiry_policies_do_not_move_the_compaction_cursor(
    pigeon_standalone, client, autojump_clock, expiry
):
    """TTL and backlog eviction skip ``__compaction``: the log it holds stays until it is
    compacted, so no key's latest value leaves the compacted view unseen."""
    await send_kv(client, "compact-ttl", [("k", b"k1")])
    t = await compact(pigeon_standalone, "compact-ttl")
    await send_kv(client, "compact-ttl", [("k", b"k2"), ("j", b"j1")])
    await trio.sleep(20)  # older than the TTL
    policies = pigeon_standalone.service.policies.cached(t.name.namespace_name)
    await t.maintain(dataclasses.replace(policies, **expiry))
    assert t.subscriptions["__compaction"].cursor.mark_delete == 1
    await compact(pigeon_standalone, "compact-ttl")
    reader = await client.create_reader("compact-ttl", "earliest", read_compacted=True)
    assert kv(await drain(reader)) == [("k", b"k2"), ("j", b"j1")]
    await reader.close()

"""Damaged segment files on a standalone's bookie: the topic opens, intact data stays
readable, the damage is reported (logs, topic stats, metrics) and handled per the
corrupt-entry policy; a subscription never crash-loops (virtual time).

The damage is made as an operator or a failing disk makes it: the standalone is stopped
cleanly, its segment's data file truncated or a bit in it flipped, and it starts again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from pigeon.bookie.testing import RECORD_HEADER_SIZE, record_starts
from pigeon.broker._admin_ops import skip, topic_stats
from pigeon.broker._metrics import BrokerMonitor
from pigeon.client.trio import Client, Consumer
from pigeon.core import TopicName
from pigeon.core.errors import Timeout
from pigeon.core.testing import in_process_standalone

TOPIC = "persistent://public/default/damaged"
NS = "public/default"
PER_ENTRY = 10  # messages per entry (batch)
ENTRIES = 50


@asynccontextmanager
async def standalone(root: Path, **config: Any) -> AsyncIterator[Any]:
    """The broker service of a standalone on ``root`` (``in_process_standalone``)."""
    async with in_process_standalone(root, **config) as cluster:
        yield cluster.service


def value(i: int) -> bytes:
    return b"message-%05d" % i


async def produce(client: Client, values: list[bytes]) -> None:
    """``values`` in entries of ``PER_ENTRY`` messages."""
    producer = await client.create_producer(
        TOPIC, batching_max_messages=PER_ENTRY, batching_max_delay_ms=10_000
    )
    for v in values:
        await producer.send_async(v)
    await producer.flush()
    await producer.close()


async def drain(consumer: Consumer, *, ack: bool = True, idle: float = 5.0) -> list[Any]:
    out: list[Any] = []
    for _ in range(1000):
        try:
            msgs = await consumer.batch_receive(1000, timeout=idle)
        except Timeout:
            return out
        out.extend(msgs)
        if ack:
            for m in msgs:
                await consumer.acknowledge(m)
    raise AssertionError("messages kept arriving")


def records(root: Path) -> tuple[Path, dict[int, int]]:
    """The topic's (only) data file and where each entry's record starts."""
    (path,) = (root / "bookie" / "segments").glob("*.log")
    return path, record_starts(path)


async def stats(service: Any) -> dict[str, Any]:
    return await topic_stats(service, None, TopicName.parse(TOPIC))


def flip_a_bit_of_entry(root: Path, entry_id: int) -> None:
    """One bit of the entry's record flipped on disk, as a failing disk does."""
    path, starts = records(root)
    data = bytearray(path.read_bytes())
    data[starts[entry_id] + RECORD_HEADER_SIZE + 30] ^= 0x04
    path.write_bytes(data)


async def write_and_stop(root: Path) -> None:
    async with standalone(root) as service, Client(service.service_url) as client:
        await produce(client, [value(i) for i in range(ENTRIES * PER_ENTRY)])
        # a subscriber that consumed everything: its cursor is at the end
        consumer = await client.subscribe(TOPIC, "early", initial_position="earliest")
        assert len(await drain(consumer)) == ENTRIES * PER_ENTRY
        await consumer.close()


async def test_truncated_tail_after_a_clean_stop(
    tmp_path: Path, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "pigeon"
    await write_and_stop(root)
    path, starts = records(root)
    with path.open("r+b") as f:  # entry 45 torn, 46..49 gone
        f.truncate(starts[45] + RECORD_HEADER_SIZE + 5)
    caplog.set_level(logging.INFO)
    async with standalone(root) as service, Client(service.service_url) as client:
        # producers attach and write on, after the old offsets
        await produce(client, [b"new-%d" % i for i in range(20)])
        consumer = await client.subscribe(TOPIC, "fresh", initial_position="earliest")
        got = await drain(consumer)
        intact = 45 * PER_ENTRY
        assert [m.value for m in got] == [value(i) for i in range(intact)] + [
            b"new-%d" % i for i in range(20)
        ]
        assert min(m.offset for m in got[intact:]) >= ENTRIES * PER_ENTRY
        # the subscriber that had read everything gets only the new messages
        early = await client.subscribe(TOPIC, "early")
        assert [m.value for m in await drain(early)] == [b"new-%d" % i for i in range(20)]
        s = await stats(service)
        assert s["corrupt_entries"] == ENTRIES - 45
        assert s["subscriptions"]["fresh"]["lost_messages"] == (ENTRIES - 45) * PER_ENTRY
        assert s["subscriptions"]["fresh"]["backlog"] == 0  # nothing waits forever
        assert s["subscriptions"]["early"]["backlog"] == 0
    text = caplog.text
    assert "torn tail truncated segment=" in text and "kept_last_entry=44" in text
    assert "ledger tail damaged" in text and "entries=45..49 (5)" in text


async def test_bit_flip_is_skipped_by_default_and_reported(
    tmp_path: Path, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "pigeon"
    await write_and_stop(root)
    flip_a_bit_of_entry(root, 20)
    caplog.set_level(logging.INFO)
    async with standalone(root) as service, Client(service.service_url) as client:
        consumer = await client.subscribe(TOPIC, "fresh", initial_position="earliest")
        got = await drain(consumer)
        # everything intact, each message once: no crash loop, no re-delivery
        expected = [value(i) for i in range(ENTRIES * PER_ENTRY) if i // PER_ENTRY != 20]
        assert [m.value for m in got] == expected
        s = await stats(service)
        assert s["corrupt_entries"] == 1
        sub = s["subscriptions"]["fresh"]
        assert (sub["lost_messages"], sub["backlog"], sub["read_error"]) == (PER_ENTRY, 0, None)
        metrics = BrokerMonitor(service).render().decode()
        assert f'pigeon_corrupt_entries_total{{topic="{TOPIC}"}} 1.0' in metrics
        assert "pigeon_bookie_damaged_entries" in metrics
        # a producer attaches too
        await produce(client, [b"after"])
    text = caplog.text
    assert "damaged entries found at start segment=" in text  # the bookie, at start
    assert "entries=20..20 (1) are on no replica intact" in text  # the broker, once
    assert text.count("skipping damaged entries") == 1


@pytest.mark.parametrize("go_on", ["policy skip", "admin skip"])
async def test_fail_policy_stops_delivery_at_the_damage_without_a_crash_loop(
    tmp_path: Path, autojump_clock: Any, go_on: str
) -> None:
    root = tmp_path / "pigeon"
    await write_and_stop(root)
    flip_a_bit_of_entry(root, 20)
    async with (
        standalone(root, corrupt_entry_policy="fail") as service,
        Client(service.service_url) as client,
    ):
        consumer = await client.subscribe(TOPIC, "fresh", initial_position="earliest")
        got = await drain(consumer, idle=30)
        assert [m.value for m in got] == [value(i) for i in range(20 * PER_ENTRY)]
        sub = (await stats(service))["subscriptions"]["fresh"]
        assert sub["consumers"] == 1  # still attached: the subscription did not fail
        assert "segment 1 entry 20" in sub["read_error"]
        assert sub["backlog"] == (ENTRIES - 20) * PER_ENTRY
        if go_on == "policy skip":  # the namespace overrides the broker
            await service.policies.set(NS, {"corrupt_entry_policy": "skip"})
        else:  # the operator acknowledges the damaged entry's messages
            await skip(service, TopicName.parse(TOPIC), "fresh", PER_ENTRY)
        rest = await drain(consumer, idle=90)
        assert [m.value for m in rest] == [
            value(i) for i in range(21 * PER_ENTRY, ENTRIES * PER_ENTRY)
        ]
        sub = (await stats(service))["subscriptions"]["fresh"]
        lost = PER_ENTRY if go_on == "policy skip" else 0
        assert (sub["read_error"], sub["backlog"], sub["lost_messages"]) == (None, 0, lost)


async def reopen_last_segment(root: Path) -> None:
    """Mark the topic's last segment open in the metadata, as a crash leaves it."""
    from pigeon.core.metadata import EmbeddedMetadataStore

    store = EmbeddedMetadataStore(root / "metadata")
    path = "/pigeon/ledgers/persistent/public/default/damaged"
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        stat = await store.get(path)
        assert stat is not None
        doc = json.loads(stat.value)
        doc["segments"][-1]["state"] = "open"
        await store.set(path, json.dumps(doc).encode())
        nursery.cancel_scope.cancel()


async def test_a_crash_over_a_cut_tail_never_reuses_offsets(
    tmp_path: Path, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """After a crash the ledger ends the segment at the last entry the bookie kept; a
    subscription that had read further must still get the messages sent afterwards."""
    root = tmp_path / "pigeon"
    await write_and_stop(root)
    await reopen_last_segment(root)
    path, starts = records(root)
    with path.open("r+b") as f:
        f.truncate(starts[45] + RECORD_HEADER_SIZE + 5)
    caplog.set_level(logging.INFO)
    async with standalone(root) as service, Client(service.service_url) as client:
        fresh = await client.subscribe(TOPIC, "fresh", initial_position="earliest")
        await produce(client, [b"new-%d" % i for i in range(20)])
        early = await client.subscribe(TOPIC, "early")
        got = await drain(early)
        assert [m.value for m in got] == [b"new-%d" % i for i in range(20)]
        assert min(m.offset for m in got) >= ENTRIES * PER_ENTRY
        got = await drain(fresh)
        assert [m.value for m in got] == [value(i) for i in range(45 * PER_ENTRY)] + [
            b"new-%d" % i for i in range(20)
        ]
        s = await stats(service)
        assert s["subscriptions"]["fresh"]["backlog"] == 0  # the offsets' gap waits for nothing
        assert s["subscriptions"]["early"]["backlog"] == 0
    assert "cursors ahead of the log" in caplog.text


async def test_offsets_go_on_after_every_segment_was_trimmed(
    tmp_path: Path, autojump_clock: Any
) -> None:
    """Not damage, but the same rule: a ledger left with no segment (all consumed and
    trimmed) never hands out an offset a cursor has passed."""
    root = tmp_path / "pigeon"
    async with (
        standalone(root, segment_max_entries=2) as service,
        Client(service.service_url) as client,
    ):
        consumer = await client.subscribe(TOPIC, "sub", initial_position="earliest")
        producer = await client.create_producer(TOPIC, batching_max_messages=1)
        for i in range(4):
            await producer.send(value(i))
        await producer.close()
        assert [m.value for m in await drain(consumer)] == [value(i) for i in range(4)]
        await consumer.close()
        await trio.sleep(3)  # maintenance trims the consumed segments
    async with standalone(root) as service, Client(service.service_url) as client:
        consumer = await client.subscribe(TOPIC, "sub")
        await produce(client, [b"after"])
        got = await drain(consumer)
        assert [m.value for m in got] == [b"after"]
        assert got[0].offset >= 4

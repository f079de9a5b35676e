"""What the Kafka front door tells consumers about leaders and brokers, so that a
consumer does not stop fetching after a broker's metadata session lapses.

The nemesis (embedded + quorum + journal, seed 777) paused the broker serving all three
partitions of a Kafka consumer's topic past its metadata session; the broker registered
again a fraction of a second later and served them on, yet the consumer (librdkafka,
assigned throughout, heartbeating, committing) fetched nothing more.  Meanwhile Metadata
had named a broker list without the paused broker, which makes librdkafka decommission
its connection, forget the partitions' leader and epoch, and validate each position with
OffsetForLeaderEpoch once the epoch comes back -- an API not served here.  So Metadata
names no leader epochs (KIP-320's "unknown") and lists a broker through such a lapse;
and a fetch that starts answering an error, or nothing although the log holds more,
says so in one log line.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from kio.schema.errors import ErrorCode
from kio.schema.fetch.v12.request import FetchPartition, FetchRequest, FetchTopic
from kio.schema.list_offsets.v7.request import (
    ListOffsetsPartition,
    ListOffsetsRequest,
    ListOffsetsTopic,
)
from kio.schema.metadata.v12.request import MetadataRequest, MetadataRequestTopic

from pigeon.broker._config import KafkaConfig
from pigeon.broker._kafka import KafkaConnection, KafkaFrontDoor
from pigeon.broker._kafka_fetch import _cache, _fetch, list_offsets, partition_ledger
from pigeon.broker._kafka_produce import _produce_partition
from pigeon.broker._kafka_topics import BROKER_LINGER_S, KnownBrokers, metadata, node_id
from pigeon.broker._kafka_wire import API_VERSIONS
from pigeon.core.kafka_records import encode_record_batch
from pigeon.core.paths import BROKERS_PATH
from pigeon.core.testing import InProcessStandalone, in_process_standalone

TOPIC = "orders"
PARTITIONS = 3
#: OffsetForLeaderEpoch, the API a client validates a position with when it knows epochs
OFFSET_FOR_LEADER_EPOCH = 23


@pytest.fixture
async def door(tmp_path: Path) -> AsyncIterator[tuple[InProcessStandalone, KafkaFrontDoor]]:
    async with in_process_standalone(tmp_path / "pigeon") as standalone:
        service = standalone.service
        kafka = KafkaFrontDoor(service, KafkaConfig())
        kafka.address = ("127.0.0.1", 9092)
        await service.create_topic(kafka.topic_name(TOPIC), PARTITIONS)
        yield standalone, kafka


def connection(door: KafkaFrontDoor, nursery: trio.Nursery) -> KafkaConnection:
    """One Kafka connection of the door, driven without a socket."""
    return KafkaConnection(door=door, stream=None, name="test", nursery=nursery)  # type: ignore[arg-type]


async def produce(conn: KafkaConnection, partition: int, count: int) -> None:
    batch = b"".join(
        encode_record_batch(
            [f"m{i}".encode() for i in range(count)],
            [None] * count,
            [int(time.time() * 1000)] * count,
        )
    )
    answered: list[Any] = []
    done = trio.Event()

    def answer(outcome: Any) -> None:
        answered.append(outcome)
        done.set()

    await _produce_partition(conn, (TOPIC, partition), batch, answer)
    with trio.fail_after(30):
        await done.wait()
    assert answered[0][0] is ErrorCode.none


def fetch_request(partition: int, offset: int, max_wait_ms: int = 100) -> FetchRequest:
    """A Fetch of one partition of TOPIC from ``offset`` (min_bytes 1)."""
    return FetchRequest(
        max_wait=datetime.timedelta(milliseconds=max_wait_ms),
        min_bytes=1,
        topics=(
            FetchTopic(
                topic=TOPIC,
                partitions=(
                    FetchPartition(
                        partition=partition, fetch_offset=offset, partition_max_bytes=1 << 20
                    ),
                ),
            ),
        ),
        forgotten_topics_data=(),
    )


async def fetch(conn: KafkaConnection, partition: int, offset: int) -> tuple[int, int, int]:
    """(error code, high watermark, bytes of records) of one partition's fetch."""
    answer = await _fetch(conn, fetch_request(partition, offset))
    (_topic, parts), *_ = answer.topics
    index, code, high_watermark, _lso, _start, records = parts[0]
    assert index == partition
    return code, high_watermark, sum(len(b) for b in records)


async def brokers_listed(conn: KafkaConnection) -> set[int]:
    request = MetadataRequest(
        topics=(MetadataRequestTopic(topic_id=None, name=TOPIC),),  # type: ignore[arg-type]
        allow_auto_topic_creation=False,
        include_topic_authorized_operations=False,
    )
    answer = await metadata(conn, request)
    return {b.node_id for b in answer.brokers}


async def test_metadata_and_list_offsets_name_no_leader_epoch(
    door: tuple[InProcessStandalone, KafkaFrontDoor],
) -> None:
    """A known epoch sends a client validating positions with OffsetForLeaderEpoch,
    which is not served: every epoch is -1, "unknown"."""
    _standalone, kafka = door
    assert OFFSET_FOR_LEADER_EPOCH not in API_VERSIONS
    async with trio.open_nursery() as nursery:
        conn = connection(kafka, nursery)
        await produce(conn, 0, 3)
        request = MetadataRequest(
            topics=(MetadataRequestTopic(topic_id=None, name=TOPIC),),  # type: ignore[arg-type]
            allow_auto_topic_creation=False,
            include_topic_authorized_operations=False,
        )
        answer = await metadata(conn, request)
        (topic,) = answer.topics
        assert topic.error_code is ErrorCode.none
        assert [p.leader_epoch for p in topic.partitions] == [-1] * PARTITIONS
        offsets = await list_offsets(
            conn,
            ListOffsetsRequest(
                replica_id=-1,
                isolation_level=0,
                topics=(
                    ListOffsetsTopic(
                        name=TOPIC,
                        partitions=(ListOffsetsPartition(partition_index=0, timestamp=-1),),
                    ),
                ),
            ),
        )
        (part,) = offsets.topics[0].partitions
        assert (part.offset, part.leader_epoch) == (3, -1)
        nursery.cancel_scope.cancel()


async def test_a_broker_whose_registration_lapses_stays_listed(
    door: tuple[InProcessStandalone, KafkaFrontDoor], autojump_clock: trio.abc.Clock
) -> None:
    """Another broker's session expires and it registers again a moment later: it stays
    in Metadata's broker list (a client given a list without it drops its connection and
    forgets what it led); one gone for good leaves the list after the linger time."""
    standalone, kafka = door
    store = standalone.service.store
    other = "127.0.0.1:19092"
    path = f"{BROKERS_PATH}/127.0.0.1:16650"
    record = b'{"url": "pigeon://127.0.0.1:16650", "kafka": "%s"}' % other.encode()
    async with trio.open_nursery() as nursery:
        conn = connection(kafka, nursery)
        own = node_id(kafka.advertised_address)
        await store.create(path, record)
        assert await brokers_listed(conn) == {own, node_id(other)}
        await store.delete(path)  # its session expired; it registers again soon
        await trio.sleep(1)
        assert await brokers_listed(conn) == {own, node_id(other)}
        await trio.sleep(BROKER_LINGER_S)  # gone for good
        assert await brokers_listed(conn) == {own}
        nursery.cancel_scope.cancel()


def test_known_brokers_by_kafka_address() -> None:
    known = KnownBrokers(linger=10)
    a = {"url": "pigeon://a:1", "kafka": "a:9"}
    b = {"url": "pigeon://b:1", "kafka": "b:9"}
    native_only = {"url": "pigeon://c:1"}
    assert known.update({"a:1": a, "b:1": b, "c:1": native_only}, now=0) == {"a:9": a, "b:9": b}
    assert known.update({"a:1": a}, now=10) == {"a:9": a, "b:9": b}
    assert known.update({"a:1": a}, now=10.5) == {"a:9": a}
    assert known.update({}, now=30) == {}


async def test_a_fetch_that_stalls_says_so_once(
    door: tuple[InProcessStandalone, KafkaFrontDoor],
    autojump_clock: trio.abc.Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A partition whose fetches answer an error, or nothing below the high watermark,
    gets one log line naming it (not one per fetch), and one when it answers again."""
    _standalone, kafka = door
    caplog.set_level(logging.INFO, logger="pigeon.broker._kafka_fetch")
    async with trio.open_nursery() as nursery:
        conn = connection(kafka, nursery)
        await produce(conn, 1, 5)
        # an error: a partition the topic does not have
        for _ in range(3):
            code, _hw, _size = await fetch(conn, PARTITIONS, 0)
            assert code == ErrorCode.unknown_topic_or_partition
        # nothing although the log holds more: a remembered position past the entries
        name = str(kafka.partition_name(TOPIC, 1))
        _cache(kafka).remember(name, 2, (10**6, 0))
        for _ in range(3):
            assert await fetch(conn, 1, 2) == (0, 5, 0)
        _cache(kafka).positions.clear()
        code, _hw, size = await fetch(conn, 1, 2)
        assert code == 0 and size > 0
        nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if r.name == "pigeon.broker._kafka_fetch"]
    assert len(lines) == 3, lines
    assert "answered an error" in lines[0] and f"partition={PARTITIONS}" in lines[0]
    assert "UNKNOWN_TOPIC_OR_PARTITION" in lines[0].upper()
    assert "no records below the high watermark" in lines[1] and "partition=1" in lines[1]
    assert "offset=2 high_watermark=5" in lines[1]
    assert "answers again" in lines[2] and "partition=1" in lines[2] and "after=3" in lines[2]


async def test_a_waiting_fetch_answers_as_soon_as_a_record_is_stored(
    door: tuple[InProcessStandalone, KafkaFrontDoor],
    autojump_clock: trio.abc.Clock,
) -> None:
    """A long-poll fetch (nothing to give, ``max_wait`` not over) is woken by the ledger
    when an entry is stored, not by its deadline, and leaves no watcher behind."""
    _standalone, kafka = door
    ledger = await partition_ledger(kafka, TOPIC, 0)
    answers: list[Any] = []
    answered = trio.Event()
    request = fetch_request(0, 0, max_wait_ms=20_000)

    async def wait_fetch() -> None:
        answers.append(await _fetch(conn, request))
        answered.set()

    async with trio.open_nursery() as nursery:
        conn = connection(kafka, nursery)
        nursery.start_soon(wait_fetch)
        for _ in range(10_000):  # until the fetch waits on the ledger (no clock moves)
            if ledger._entry_watchers:
                break
            await trio.lowlevel.checkpoint()
        assert ledger._entry_watchers and not answers
        started = trio.current_time()
        await produce(conn, 0, 3)
        await answered.wait()  # at the fetch's deadline (20 s on the clock) if not woken
        waited = trio.current_time() - started
        nursery.cancel_scope.cancel()
    (_topic, parts), *_ = answers[0].topics
    assert sum(len(b) for b in parts[0][5]) > 0
    assert waited < 1.0, f"the fetch answered after {waited:.1f}s: at its deadline, not woken"
    assert not ledger._entry_watchers

"""Kafka clients work unchanged against ``pigeon standalone``'s Kafka listener.

Real external clients drive a real server process: confluent-kafka (librdkafka),
kafka-python, aiokafka and kcat.  Each test uses its own topic on one module-wide
server; the restart test has a server of its own.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _kafka import DEADLINE_S, standalone, start_standalone, topic_name
from _kafka import consume as kafka_consume
from _kafka import produce as kafka_produce

from pigeon.core.testing.servers import Standalone

confluent_kafka = pytest.importorskip("confluent_kafka")
from confluent_kafka import Consumer, KafkaError, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    with standalone(tmp_path_factory.mktemp("kafka")) as sa:
        yield sa


def produce(
    bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes]], **conf: Any
) -> list[Any]:
    """Produce ``(key, value)`` pairs with headers and timestamps; the delivery reports."""
    records = [
        {
            "key": key,
            "value": value,
            "headers": [("h", f"{i}".encode()), ("bin", b"\x00\xff")],
            "timestamp": 1_700_000_000_000 + i,
        }
        for i, (key, value) in enumerate(messages)
    ]
    return kafka_produce(bootstrap, topic, records, **conf)


def consume(bootstrap: str, topic: str, count: int, group: str | None = None) -> list[Any]:
    """``count`` records, committed in ``group`` (a new one by default)."""
    return kafka_consume(bootstrap, topic, count, group=group, commit=True)


def test_confluent_produce_and_consume_keys_values_headers_timestamps_offsets(
    server: Standalone,
) -> None:
    topic = topic_name()
    sent = [
        (f"k{i}".encode() if i % 3 else None, f"value-{i}".encode() * (i + 1)) for i in range(200)
    ]
    reports = produce(server.kafka_bootstrap, topic, sent)
    assert sorted(m.offset() for m in reports) == list(range(200))
    got = consume(server.kafka_bootstrap, topic, 200)
    assert [(m.key(), m.value()) for m in got] == sent
    assert [m.offset() for m in got] == list(range(200))
    assert [m.timestamp()[1] for m in got] == [1_700_000_000_000 + i for i in range(200)]
    assert got[7].headers() == [("h", b"7"), ("bin", b"\x00\xff")]


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_every_compression_type_round_trips(server: Standalone, codec: str) -> None:
    topic = topic_name()
    sent = [(b"k", f"{codec}-{i}".encode() * 20) for i in range(100)]
    produce(server.kafka_bootstrap, topic, sent, **{"compression.type": codec})
    got = consume(server.kafka_bootstrap, topic, 100)
    assert [m.value() for m in got] == [v for _, v in sent]
    assert [m.offset() for m in got] == list(range(100))


def test_idempotent_producer_stores_each_message_once(server: Standalone) -> None:
    topic = topic_name()
    sent = [(None, f"m{i}".encode()) for i in range(500)]
    reports = produce(
        server.kafka_bootstrap,
        topic,
        sent,
        **{"enable.idempotence": True, "acks": "all", "max.in.flight.requests.per.connection": 5},
    )
    assert sorted(m.offset() for m in reports) == list(range(500))
    got = consume(server.kafka_bootstrap, topic, 500)
    assert [m.value() for m in got] == [v for _, v in sent]


def test_admin_client_creates_lists_grows_describes_and_deletes_topics(server: Standalone) -> None:
    admin = AdminClient({"bootstrap.servers": server.kafka_bootstrap})
    topic = topic_name()
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])[topic].result(
        DEADLINE_S
    )
    with pytest.raises(confluent_kafka.KafkaException) as exists:
        admin.create_topics([NewTopic(topic, num_partitions=3)])[topic].result(DEADLINE_S)
    assert exists.value.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS
    listed = admin.list_topics(timeout=DEADLINE_S).topics
    assert len(listed[topic].partitions) == 3
    admin.create_partitions([NewPartitions(topic, 5)])[topic].result(DEADLINE_S)
    assert len(admin.list_topics(topic, timeout=DEADLINE_S).topics[topic].partitions) == 5
    resource = confluent_kafka.admin.ConfigResource("topic", topic)
    configs = admin.describe_configs([resource])[resource].result(DEADLINE_S)
    assert configs["cleanup.policy"].value == "delete"
    admin.delete_topics([topic])[topic].result(DEADLINE_S)
    assert topic not in admin.list_topics(timeout=DEADLINE_S).topics


def test_consumer_group_of_three_splits_partitions_and_rebalances(server: Standalone) -> None:
    admin = AdminClient({"bootstrap.servers": server.kafka_bootstrap})
    topic = topic_name()
    admin.create_topics([NewTopic(topic, num_partitions=6)])[topic].result(DEADLINE_S)
    group = f"g-{uuid.uuid4().hex[:8]}"
    conf = {
        "bootstrap.servers": server.kafka_bootstrap,
        "group.id": group,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 500,
    }
    members = [Consumer(conf) for _ in range(3)]
    try:
        for member in members:
            member.subscribe([topic])
        assigned = _wait_assignment(members, 6)
        assert sorted(len(a) for a in assigned) == [2, 2, 2]
        members.pop().close()  # leaves: the other two take its partitions
        assigned = _wait_assignment(members, 6)
        assert sorted(len(a) for a in assigned) == [3, 3]
    finally:
        for member in members:
            member.close()


def _wait_assignment(members: list[Any], partitions: int) -> list[set[int]]:
    """Poll every member until their assignments cover ``partitions`` partitions once."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        for member in members:
            member.poll(0.1)
        assigned = [{tp.partition for tp in m.assignment()} for m in members]
        flat = [p for a in assigned for p in a]
        if sorted(flat) == list(range(partitions)):
            return assigned
    raise AssertionError(f"assignments never covered {partitions} partitions: {assigned}")


def test_committed_offsets_are_the_subscription_cursor_and_survive_a_restart(
    tmp_path: Path,
) -> None:
    sa = start_standalone(tmp_path / "restart")
    try:
        topic = topic_name()
        produce(sa.kafka_bootstrap, topic, [(None, f"m{i}".encode()) for i in range(30)])
        first = consume(sa.kafka_bootstrap, topic, 10, group="keep")
        assert [m.offset() for m in first] == list(range(10))
        stats = _admin_get(
            sa, f"/admin/v2/topics/persistent/public/default/{topic}-partition-0/stats"
        )
        sub = _subscription_stats(stats, "keep")
        assert sub["mark_delete_offset"] == 10
        sa.restart()
        rest = consume(sa.kafka_bootstrap, topic, 20, group="keep")
        assert [m.offset() for m in rest] == list(range(10, 30))
    finally:
        sa.close()


def _admin_get(sa: Standalone, path: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{sa.http_port}{path}", timeout=30) as r:
        return json.loads(r.read())


def _subscription_stats(stats: Any, name: str) -> dict[str, Any]:
    """The subscription's stats in (partitioned) topic stats, wherever they nest."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            subs = node.get("subscriptions")
            if isinstance(subs, dict) and name in subs:
                found.append(subs[name])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(stats)
    assert found, f"no subscription {name!r} in {stats}"
    return found[0]


def test_kafka_python_produces_and_consumes_in_a_group(server: Standalone) -> None:
    kafka = pytest.importorskip("kafka")
    topic = topic_name()
    producer = kafka.KafkaProducer(bootstrap_servers=server.kafka_bootstrap, acks="all")
    for i in range(50):
        producer.send(topic, key=b"k", value=f"kp-{i}".encode(), headers=[("n", str(i).encode())])
    producer.flush(DEADLINE_S)
    producer.close()
    consumer = kafka.KafkaConsumer(
        topic,
        bootstrap_servers=server.kafka_bootstrap,
        group_id="kafka-python",
        auto_offset_reset="earliest",
        consumer_timeout_ms=int(DEADLINE_S * 1000),
    )
    got = []
    for msg in consumer:
        got.append(msg)
        if len(got) == 50:
            break
    consumer.commit()
    consumer.close()
    assert [m.value for m in got] == [f"kp-{i}".encode() for i in range(50)]
    assert [m.offset for m in got] == list(range(50))
    assert got[3].headers == [("n", b"3")]


def test_aiokafka_produces_and_consumes_in_a_group(server: Standalone) -> None:
    aiokafka = pytest.importorskip("aiokafka")
    topic = topic_name()

    async def scenario() -> list[Any]:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=server.kafka_bootstrap)
        await producer.start()
        try:
            for i in range(50):
                await producer.send_and_wait(topic, f"ak-{i}".encode(), key=b"k")
        finally:
            await producer.stop()
        consumer = aiokafka.AIOKafkaConsumer(
            topic,
            bootstrap_servers=server.kafka_bootstrap,
            group_id="aiokafka",
            auto_offset_reset="earliest",
        )
        await consumer.start()
        got: list[Any] = []
        try:
            async with asyncio.timeout(DEADLINE_S):
                async for msg in consumer:
                    got.append(msg)
                    if len(got) == 50:
                        break
            await consumer.commit()
        finally:
            await consumer.stop()
        return got

    got = asyncio.run(scenario())
    assert [m.value for m in got] == [f"ak-{i}".encode() for i in range(50)]
    assert [m.offset for m in got] == list(range(50))


@pytest.mark.skipif(shutil.which("kcat") is None, reason="kcat is not installed")
def test_kcat_lists_produces_and_consumes(server: Standalone) -> None:
    topic = topic_name()
    lines = "\n".join(f"kcat-{i}" for i in range(20)) + "\n"
    run = subprocess.run(
        ["kcat", "-b", server.kafka_bootstrap, "-t", topic, "-P"],
        input=lines.encode(),
        capture_output=True,
        timeout=DEADLINE_S,
        check=True,
    )
    assert run.returncode == 0
    out = subprocess.run(
        ["kcat", "-b", server.kafka_bootstrap, "-t", topic, "-C", "-e", "-f", "%o %s\n"],
        capture_output=True,
        timeout=DEADLINE_S,
        check=True,
    )
    assert out.stdout.decode().splitlines() == [f"{i} kcat-{i}" for i in range(20)]
    listing = subprocess.run(
        ["kcat", "-b", server.kafka_bootstrap, "-L", "-J"],
        capture_output=True,
        timeout=DEADLINE_S,
        check=True,
    )
    meta = json.loads(listing.stdout)
    assert topic in [t["topic"] for t in meta["topics"]]
    assert [b["name"] for b in meta["brokers"]] == [server.kafka_bootstrap]


def test_out_of_range_offset_is_reset_by_the_client(server: Standalone) -> None:
    topic = topic_name()
    produce(server.kafka_bootstrap, topic, [(None, b"only")])
    consumer = Consumer(
        {
            "bootstrap.servers": server.kafka_bootstrap,
            "group.id": "oor",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.assign([TopicPartition(topic, 0, 1000)])
    deadline = time.monotonic() + DEADLINE_S
    got = None
    try:
        while got is None and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                got = msg
    finally:
        consumer.close()
    assert got is not None and (got.offset(), got.value()) == (0, b"only")


def test_a_commit_past_the_end_stops_at_the_end(server: Standalone) -> None:
    """A cursor beyond the log would count messages not yet written as read: a commit
    past the stored end is kept at the end, and later messages are still delivered."""
    topic = topic_name()
    produce(server.kafka_bootstrap, topic, [(None, b"a"), (None, b"b")])
    consumer = Consumer({"bootstrap.servers": server.kafka_bootstrap, "group.id": "far"})
    try:
        consumer.commit(offsets=[TopicPartition(topic, 0, 10**12)], asynchronous=False)
        (committed,) = consumer.committed([TopicPartition(topic, 0)], timeout=DEADLINE_S)
    finally:
        consumer.close()
    assert committed.offset == 2
    produce(server.kafka_bootstrap, topic, [(None, b"c")])
    assert [m.value() for m in consume(server.kafka_bootstrap, topic, 1, group="far")] == [b"c"]

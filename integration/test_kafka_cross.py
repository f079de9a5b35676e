"""Kafka and native PigeonMQ clients see one log: same offsets, keys, values, headers.

A real ``pigeon standalone`` (one per module) is written by confluent-kafka and by the
native client and read by both, by kafka-python, the ``pigeon admin`` CLI and the Spark
``pigeon`` source.  How a record maps (see :mod:`pigeon.core._kafka_records`):

* Kafka offset = PigeonMQ offset; Kafka topic ``t`` = ``persistent://public/default/t``.
* Kafka key bytes -> native ``Message.key`` str, decoded UTF-8 with ``surrogateescape``
  (``key.encode("utf-8", "surrogateescape")`` gives the Kafka bytes back, even when they
  are not UTF-8); a null key is ``None``; a native str key goes to Kafka UTF-8 encoded.
* Kafka headers = native properties (values decoded the same way); native properties go
  to Kafka as UTF-8 headers.
* Kafka timestamp = native ``event_time``; a native message without event time reaches
  Kafka with its publish time.

Every wait is bounded (``DEADLINE_S``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _admin import admin_json, admin_url
from _kafka import DEADLINE_S, standalone, topic_name
from _kafka import consume as kafka_consume
from _kafka import produce as kafka_produce
from _produce import OP_TIMEOUT, receive_n
from _spark import local_spark

from pigeon.client import Client, Message, MessageId
from pigeon.core.testing.servers import Standalone

confluent_kafka = pytest.importorskip("confluent_kafka")
from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402

pytestmark = pytest.mark.integration

TS0 = 1_700_000_000_000
NOT_UTF8 = b"\xff\xfe\x00bin"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    with standalone(tmp_path_factory.mktemp("kafka-cross"), fsync="never") as sa:
        yield sa


@pytest.fixture(scope="module")
def client(server: Standalone) -> Iterator[Client]:
    with Client(server.url, operation_timeout=OP_TIMEOUT) as c:
        yield c


def full(name: str) -> str:
    return f"persistent://public/default/{name}"


# ------------------------------------------------------------------ helpers


def kafka_record(i: int) -> dict[str, Any]:
    """Varied Kafka records: text, null and non-UTF-8 keys; non-UTF-8 and null header
    values."""
    key: bytes | None = [f"k{i}".encode(), None, NOT_UTF8 + bytes([i % 256]), "ключ".encode()][
        i % 4
    ]
    return {
        "key": key,
        "value": f"kafka-{i}|".encode() + bytes(range(i % 17)),
        "headers": [("n", str(i).encode()), ("bin", NOT_UTF8), ("null", None)],
        "timestamp": TS0 + i,
    }


def kafka_python_consume(bootstrap: str, topic: str, count: int) -> list[Any]:
    kafka = pytest.importorskip("kafka")
    consumer = kafka.KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=int(DEADLINE_S * 1000),
    )
    consumer.assign([kafka.TopicPartition(topic, 0)])
    consumer.seek_to_beginning()
    got: list[Any] = []
    try:
        for msg in consumer:
            got.append(msg)
            if len(got) == count:
                break
    finally:
        consumer.close()
    assert len(got) == count, f"kafka-python consumed {len(got)} of {count} within deadline"
    return got


def native_read(client: Client, topic: str, count: int, subscription: str = "") -> list[Message]:
    with client.subscribe(
        topic, subscription or f"n-{uuid.uuid4().hex[:8]}", initial_position="earliest"
    ) as consumer:
        got = receive_n(consumer, count, timeout=DEADLINE_S)
        consumer.acknowledge_cumulative(got[-1])
    return sorted(got, key=lambda m: m.offset)


def raw(text: str | None) -> bytes | None:
    """A native key or property value as the Kafka bytes it stands for."""
    return None if text is None else text.encode("utf-8", "surrogateescape")


# ------------------------------------------------------------------ Kafka -> native


def test_kafka_produced_records_read_natively_with_same_offsets_keys_headers_times(
    server: Standalone, client: Client
) -> None:
    topic = topic_name("x")
    plain = [kafka_record(i) for i in range(120)]
    gzipped = [kafka_record(i) for i in range(120, 200)]
    kafka_produce(server.kafka_bootstrap, topic, plain)
    kafka_produce(server.kafka_bootstrap, topic, gzipped, **{"compression.type": "gzip"})
    sent = plain + gzipped

    for name in (full(topic), full(f"{topic}-partition-0")):
        got = native_read(client, name, len(sent))
        assert [m.offset for m in got] == list(range(len(sent)))
        assert [m.value for m in got] == [r["value"] for r in sent]
        assert [raw(m.key) for m in got] == [r["key"] for r in sent]
        assert got[1].key is None
        assert got[0].key == "k0" and got[3].key == "ключ"
        assert [m.event_time for m in got] == [r["timestamp"] for r in sent]
        for m, r in zip(got, sent, strict=True):
            # a null header value reads as ""
            expected = {k: b"" if v is None else v for k, v in r["headers"]}
            assert {k: raw(v) for k, v in m.properties.items()} == expected
        assert got[0].topic.startswith(full(topic))


# ------------------------------------------------------------------ native -> Kafka


def test_native_produced_messages_read_by_kafka_clients_with_same_offsets_and_fields(
    server: Standalone, client: Client
) -> None:
    topic = topic_name("x")
    client.create_topic(topic, 1)
    n = 150
    before = int(time.time() * 1000)
    with client.create_producer(
        topic, batching_max_messages=32, batching_max_delay_ms=20
    ) as producer:
        futures = [
            producer.send_async(
                f"native-{i}".encode() * (1 + i % 5),
                key=None if i % 6 == 0 else f"key-{i % 9}-ü",
                properties={"n": str(i), "text": "✓" * (i % 3)} if i % 4 else None,
                event_time=TS0 + i if i % 2 else 0,
            )
            for i in range(n)
        ]
        producer.flush()
    ids = [f.result(DEADLINE_S) for f in futures]
    after = int(time.time() * 1000)
    assert [mid.offset for mid in ids] == list(range(n))

    got = kafka_consume(server.kafka_bootstrap, topic, n)
    assert [m.offset() for m in got] == list(range(n))
    for i, m in enumerate(got):
        assert m.value() == f"native-{i}".encode() * (1 + i % 5)
        assert m.key() == (None if i % 6 == 0 else f"key-{i % 9}-ü".encode())
        expected_headers = {"n": str(i).encode(), "text": ("✓" * (i % 3)).encode()}
        assert dict(m.headers() or []) == (expected_headers if i % 4 else {})
        ts_type, ts = m.timestamp()
        assert ts_type == confluent_kafka.TIMESTAMP_CREATE_TIME
        if i % 2:
            assert ts == TS0 + i
        else:  # no event time: the publish time
            assert before - 1000 <= ts <= after + 1000

    kp = kafka_python_consume(server.kafka_bootstrap, topic, n)
    assert [(m.offset, m.key, m.value, m.timestamp) for m in kp] == [
        (m.offset(), m.key(), m.value(), m.timestamp()[1]) for m in got
    ]
    assert [dict(m.headers) for m in kp] == [dict(m.headers() or []) for m in got]


def test_native_compressed_batches_with_bytes_keys_and_empty_values_reach_kafka(
    server: Standalone, client: Client
) -> None:
    topic = topic_name("x")
    client.create_topic(topic, 1)
    n = 64
    with client.create_producer(
        topic, batching_max_messages=64, batching_max_delay_ms=50, compression="zstd"
    ) as producer:
        futures = [
            producer.send_async(
                b"" if i % 8 == 0 else f"z{i}".encode() * 10,
                key=NOT_UTF8 + bytes([i]) if i % 2 else f"t{i}",
            )
            for i in range(n)
        ]
        producer.flush()
    assert [f.result(DEADLINE_S).offset for f in futures] == list(range(n))
    got = kafka_consume(server.kafka_bootstrap, topic, n)
    assert [m.offset() for m in got] == list(range(n))
    assert [m.key() for m in got] == [
        NOT_UTF8 + bytes([i]) if i % 2 else f"t{i}".encode() for i in range(n)
    ]
    # an empty native value is an empty Kafka value, not a null (tombstone)
    assert [m.value() for m in got] == [
        b"" if i % 8 == 0 else f"z{i}".encode() * 10 for i in range(n)
    ]
    # a Kafka consumer starting inside a native batch gets exactly the offsets from there
    mid = kafka_consume(server.kafka_bootstrap, topic, n - 7, start=7)
    assert [m.offset() for m in mid] == list(range(7, n))


def test_kafka_tombstones_read_natively_as_empty_values_and_start_inside_a_batch(
    server: Standalone, client: Client
) -> None:
    topic = topic_name("x")
    sent = [{"key": b"k", "value": None if i % 5 == 0 else b"v%d" % i} for i in range(40)]
    kafka_produce(server.kafka_bootstrap, topic, sent, **{"linger.ms": 50})
    got = native_read(client, topic, 40)
    assert [m.value for m in got] == [r["value"] or b"" for r in sent]
    # a native reader starting inside the (single) Kafka batch
    start = got[12].message_id
    assert start.entry_id == got[0].message_id.entry_id, "expected one Kafka batch"
    with client.create_reader(full(f"{topic}-partition-0"), start) as reader:
        first = reader.read_next(timeout=DEADLINE_S)
    assert first.offset == 13 and isinstance(start, MessageId)


def test_kafka_offsets_for_times_finds_native_event_times(
    server: Standalone, client: Client
) -> None:
    topic = topic_name("x")
    client.create_topic(topic, 1)
    with client.create_producer(topic, batching_max_messages=4) as producer:
        futures = [producer.send_async(b"e%d" % i, event_time=TS0 + 10 * i) for i in range(20)]
        producer.flush()
    assert [f.result(DEADLINE_S).offset for f in futures] == list(range(20))
    consumer = Consumer({"bootstrap.servers": server.kafka_bootstrap, "group.id": "times"})
    try:
        # one partition per request (a client merges repeats of a partition)
        found = [
            consumer.offsets_for_times([TopicPartition(topic, 0, t)], timeout=DEADLINE_S)[0]
            for t in (TS0 + 55, TS0, TS0 + 190, TS0 + 1000)
        ]
    finally:
        consumer.close()
    assert [f.offset for f in found[:3]] == [6, 0, 19]  # the first message at or after
    assert found[3].offset in (-1, 20)  # none: the end


# ------------------------------------------------------------------ mixed


def test_interleaved_kafka_and_native_producers_give_one_sequence_to_both_consumers(
    server: Standalone, client: Client
) -> None:
    topic = topic_name("x")
    client.create_topic(topic, 1)
    expected: list[tuple[bytes, bytes | None]] = []
    with client.create_producer(topic, batching_max_messages=8) as native:
        kafka = Producer({"bootstrap.servers": server.kafka_bootstrap, "linger.ms": 2})
        for round_ in range(6):
            for i in range(7):
                value = f"k{round_}-{i}".encode()
                kafka.produce(topic, value=value, key=b"kafka", timestamp=TS0 + i)
                expected.append((value, b"kafka"))
            assert kafka.flush(DEADLINE_S) == 0
            futures = []
            for i in range(5):
                value = f"n{round_}-{i}".encode()
                futures.append(native.send_async(value, key="native", event_time=TS0 + i))
                expected.append((value, b"native"))
            native.flush()
            for f in futures:
                f.result(DEADLINE_S)
    n = len(expected)

    native_got = native_read(client, topic, n)
    assert [m.offset for m in native_got] == list(range(n))
    assert [(m.value, raw(m.key)) for m in native_got] == expected

    kafka_got = kafka_consume(server.kafka_bootstrap, topic, n)
    assert [m.offset() for m in kafka_got] == list(range(n))
    assert [(m.value(), m.key()) for m in kafka_got] == expected
    assert [m.timestamp()[1] for m in kafka_got] == [m.event_time for m in native_got]


# ------------------------------------------------------------------ groups = subscriptions


def admin_cli(server: Standalone, *args: str) -> Any:
    return admin_json(admin_url(server), *args)


def test_kafka_consumer_group_is_a_subscription_the_cli_and_native_consumers_see(
    server: Standalone, client: Client
) -> None:
    topic = topic_name("x")
    kafka_produce(
        server.kafka_bootstrap,
        topic,
        [{"key": b"k", "value": f"m{i}".encode(), "timestamp": TS0 + i} for i in range(30)],
    )
    group = f"grp-{uuid.uuid4().hex[:6]}"
    first = kafka_consume(server.kafka_bootstrap, topic, 12, group=group, commit=True)
    assert [m.offset() for m in first] == list(range(12))

    partition = full(f"{topic}-partition-0")
    assert group in admin_cli(server, "subscriptions", "list", partition)
    sub = admin_cli(server, "subscriptions", "get", partition, group)
    assert sub["mark_delete_offset"] == 12, sub
    assert sub["backlog"] == 18, sub
    stats = admin_cli(server, "topics", "stats", partition)
    assert stats["subscriptions"][group]["mark_delete_offset"] == 12

    # a native consumer of the same subscription continues after the committed offset
    with client.subscribe(partition, group, initial_position="earliest") as consumer:
        rest = receive_n(consumer, 18, timeout=DEADLINE_S)
        consumer.acknowledge_cumulative(rest[-1])
    assert [m.offset for m in rest] == list(range(12, 30))
    assert [m.value for m in rest] == [f"m{i}".encode() for i in range(12, 30)]
    sub = admin_cli(server, "subscriptions", "get", partition, group)
    assert sub["backlog"] == 0 and sub["mark_delete_offset"] == 30, sub


@pytest.mark.parametrize("group", ["orders app", "team/orders", "..", "ümlaut 100%"])
def test_any_group_id_commits_like_any_other(server: Standalone, group: str) -> None:
    """Any string is a Kafka group id: the subscription holds it percent-encoded where a
    subscription name cannot (all but ASCII letters, digits and ``_ . - = :``)."""
    from confluent_kafka import Consumer, TopicPartition

    topic = topic_name("x")
    kafka_produce(server.kafka_bootstrap, topic, [{"value": b"m%d" % i} for i in range(5)])
    got = kafka_consume(server.kafka_bootstrap, topic, 5, group=group, commit=True, deadline_s=20)
    assert [m.offset() for m in got] == list(range(5))
    consumer = Consumer({"bootstrap.servers": server.kafka_bootstrap, "group.id": group})
    try:
        (committed,) = consumer.committed([TopicPartition(topic, 0)], timeout=DEADLINE_S)
    finally:
        consumer.close()
    assert committed.offset == 5


# ------------------------------------------------------------------ Spark


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    with local_spark("pigeon-kafka-cross") as session:
        yield session


def test_spark_reads_a_kafka_produced_topic_with_same_offsets_keys_values(
    server: Standalone, spark: Any, tmp_path: Path
) -> None:
    from pyspark.sql import functions as F

    topic = topic_name("x")
    sent = [kafka_record(i) for i in range(40)]
    kafka_produce(server.kafka_bootstrap, topic, sent)
    rows = (
        spark.read.format("pigeon")
        .option("service_url", server.url)
        .option("topic", topic)
        .option("includeProperties", "true")
        .load()
        .select(
            "key", "value", "partition", "offset", F.expr("unix_millis(event_time)").alias("ts")
        )
        .collect()
    )
    rows = sorted(rows, key=lambda r: r.offset)
    assert [(r.partition, r.offset) for r in rows] == [(0, i) for i in range(40)]
    assert [r.value for r in rows] == [r["value"] for r in sent]
    assert [r.key for r in rows] == [r["key"] for r in sent]
    assert [r.ts for r in rows] == [r["timestamp"] for r in sent]

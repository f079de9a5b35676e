"""The ``pigeon`` Spark format against a real ``pigeon standalone``, on ``local[2]`` Spark.

One Spark session and one server are shared by the module (a session takes seconds to
start); every test uses its own topics. Waits are bounded: Spark actions finish or fail,
and streaming queries run with ``trigger(availableNow=True)`` so they stop on their own
once the data present at their start is processed.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from _spark import local_spark

from pigeon.client import Client, MessageId
from pigeon.client._range import partition_offsets
from pigeon.core.testing.servers import Standalone

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from pyspark.sql import DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

pytestmark = pytest.mark.integration

QUERY_TIMEOUT = 120.0  # a streaming run that takes longer than this has hung


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    base = tmp_path_factory.mktemp("spark-standalone")
    s = Standalone(base / "data", log_dir=base, fsync="never").start()
    yield s
    s.close()


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    with local_spark("pigeon-spark-tests") as session:
        yield session


@pytest.fixture(scope="module")
def client(server: Standalone) -> Iterator[Client]:
    with Client(server.url, operation_timeout=20) as c:
        yield c


def topic_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def full(name: str) -> str:
    return f"persistent://public/default/{name}"


def reader(spark: SparkSession, url: str, **options: Any) -> DataFrame:
    r = spark.read.format("pigeon").option("service_url", url)
    for k, v in options.items():
        r = r.option(k, v if isinstance(v, str) else json.dumps(v))
    return r.load()


def produce(client: Client, topic: str, rows: list[dict[str, Any]]) -> list[MessageId]:
    with client.create_producer(topic, batching_max_messages=16) as producer:
        futures = [producer.send_async(r.pop("value"), **r) for r in rows]
        producer.flush()
    return [f.result(10) for f in futures]


def run_available_now(query_builder: Any) -> Any:
    query = query_builder.trigger(availableNow=True).start()
    try:
        assert query.awaitTermination(QUERY_TIMEOUT), "streaming query did not finish"
    finally:
        query.stop()
    if query.exception() is not None:
        raise AssertionError(f"streaming query failed: {query.exception()}")
    return query


# ----------------------------------------------------------------------------- batch read


def test_batch_read_returns_exactly_the_produced_rows(
    spark: SparkSession, server: Standalone, client: Client
) -> None:
    topic = topic_name("batch")
    client.create_topic(topic, 3)
    before = int(time.time() * 1000)
    rows = [
        {
            "value": b"value-%d" % i,
            "key": None if i % 7 == 0 else f"user-{i % 5}",
            "properties": {"n": str(i)} if i % 2 else None,
            "event_time": 1_700_000_000_000 + i if i % 3 else 0,
        }
        for i in range(240)
    ]
    expected = [dict(r) for r in rows]
    ids = produce(client, topic, rows)
    after = int(time.time() * 1000)

    df = reader(spark, server.url, topic=topic, includeProperties="true", minPartitions="5")
    assert df.rdd.getNumPartitions() >= 5
    got = df.select(
        "key",
        "value",
        "topic",
        "partition",
        "offset",
        "message_id",
        "properties",
        F.expr("unix_millis(publish_time)").alias("publish_ms"),
        F.expr("unix_millis(event_time)").alias("event_ms"),
    ).collect()

    assert len(got) == len(expected)
    by_value = {r.value: r for r in got}
    assert len(by_value) == len(expected)
    for row, mid in zip(expected, ids, strict=True):
        r = by_value[row["value"]]
        assert r.key == (row["key"].encode() if row["key"] is not None else None)
        assert r.topic == full(topic)
        assert (r.partition, r.offset) == (mid.partition, mid.offset)
        assert MessageId.deserialize(r.message_id) == mid
        assert MessageId.deserialize(r.message_id).offset == mid.offset
        assert len(r.message_id) == 40  # the binary id, built per record batch
        assert r.properties == (row["properties"] or {})
        assert r.event_ms == (row["event_time"] or None)
        assert before <= r.publish_ms <= after
    # offsets of each partition are 0..n-1, each once
    per_partition = Counter(r.partition for r in got)
    for p, n in per_partition.items():
        assert sorted(r.offset for r in got if r.partition == p) == list(range(n))

    # endingOffsets / startingOffsets JSON bound the read per partition
    p0, p1 = full(f"{topic}-partition-0"), full(f"{topic}-partition-1")
    bounded = (
        reader(
            spark,
            server.url,
            topic=topic,
            startingOffsets={p0: 3, p1: 0},
            endingOffsets={p0: 10, p1: 2},
        )
        .select("partition", "offset")
        .collect()
    )
    n2 = per_partition[2]
    assert sorted((r.partition, r.offset) for r in bounded) == sorted(
        [(0, o) for o in range(3, 10)] + [(1, 0), (1, 1)] + [(2, o) for o in range(n2)]
    )


def test_starting_timestamp_and_pattern(
    spark: SparkSession, server: Standalone, client: Client
) -> None:
    prefix = topic_name("ts")
    first, second = f"{prefix}-a", f"{prefix}-b"
    produce(client, first, [{"value": b"old-%d" % i} for i in range(20)])
    produce(client, second, [{"value": b"old-b"}])
    time.sleep(0.05)
    cut = int(time.time() * 1000)
    time.sleep(0.05)
    produce(client, first, [{"value": b"new-%d" % i} for i in range(15)])

    got = reader(spark, server.url, topic=first, startingTimestamp=str(cut)).select(
        "value", "offset"
    )
    assert sorted(r.value for r in got.collect()) == sorted(b"new-%d" % i for i in range(15))

    pattern = f"persistent://public/default/{prefix}-.*"
    both = reader(spark, server.url, topicsPattern=pattern).groupBy("topic").count().collect()
    assert {r.topic: r["count"] for r in both} == {full(first): 35, full(second): 1}


def test_kafka_source_names_and_a_missing_topic(
    spark: SparkSession, server: Standalone, client: Client
) -> None:
    topic, missing = topic_name("kafka-names"), topic_name("missing")
    produce(client, topic, [{"value": b"v-%d" % i, "properties": {"i": str(i)}} for i in range(5)])
    # what a user of Spark's Kafka source writes, with serviceUrl for its bootstrap servers
    rows = (
        spark.read.format("pigeon")
        .option("serviceUrl", server.url)
        .option("subscribe", topic)
        .option("includeHeaders", "true")
        .load()
        .select("value", "properties")
        .collect()
    )
    assert sorted((r.value, r.properties["i"]) for r in rows) == [
        (b"v-%d" % i, str(i)) for i in range(5)
    ]

    # a topic that does not exist fails the read, and is not created by it
    with pytest.raises(Exception, match="TopicNotFound") as info:
        reader(spark, server.url, topic=missing).collect()
    assert full(missing) in str(info.value) and "allowAutoTopicCreation=true" in str(info.value)
    assert full(missing) not in client.list_topics()
    assert reader(spark, server.url, topic=missing, allowAutoTopicCreation="true").count() == 0


# ------------------------------------------------------------------------ streaming read


def test_streaming_read_survives_a_stop_mid_stream(
    spark: SparkSession, server: Standalone, client: Client, tmp_path: Path
) -> None:
    prefix = topic_name("stream")
    topic, later = f"{prefix}-a", f"{prefix}-b"
    client.create_topic(topic, 2)
    produce(client, topic, [{"value": b"m-%d" % i, "key": str(i % 3)} for i in range(120)])
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    def start(trigger: dict[str, Any]) -> Any:
        df = (
            spark.readStream.format("pigeon")
            .option("service_url", server.url)
            .option("topicsPattern", f"persistent://public/default/{prefix}-.*")
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", "25")
            .load()
            .select("value", "topic", "partition", "offset")
        )
        return (
            df.writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(**trigger)
            .start()
        )

    # Run with a fast processing-time trigger and stop it after two micro-batches, while
    # most of the backlog is still unread (and a batch may be in flight).
    query = start({"processingTime": "10 milliseconds"})
    try:
        deadline = time.monotonic() + QUERY_TIMEOUT
        while len([p for p in query.recentProgress if p["numInputRows"] > 0]) < 2:
            assert time.monotonic() < deadline, "no progress"
            assert query.exception() is None, query.exception()
            time.sleep(0.05)
    finally:
        query.stop()
    done_before = spark.read.parquet(str(out)).count()
    assert 0 < done_before < 120

    # More messages, and a new topic matching the pattern: read from its offset 0.
    produce(client, topic, [{"value": b"m-%d" % i, "key": str(i % 3)} for i in range(120, 170)])
    produce(client, later, [{"value": b"m-%d" % i} for i in range(170, 180)])
    query = start({"availableNow": True})
    try:
        assert query.awaitTermination(QUERY_TIMEOUT)
    finally:
        query.stop()
    assert query.exception() is None
    rows = spark.read.parquet(str(out)).collect()
    assert Counter(r.value for r in rows) == Counter(b"m-%d" % i for i in range(180))  # once each
    assert sorted(r.offset for r in rows if r.topic == full(later)) == list(range(10))


def test_max_offsets_per_trigger_is_honoured_exactly(
    spark: SparkSession, server: Standalone, client: Client
) -> None:
    # three equal backlogs share a limit of 10 as 3.33 each: rounding each share down
    # read batches of 9
    topic = topic_name("per-trigger")
    client.create_topic(topic, 3)
    for i in range(3):
        produce(client, f"{topic}-partition-{i}", [{"value": b"x"} for _ in range(10)])
    query = run_available_now(
        spark.readStream.format("pigeon")
        .option("service_url", server.url)
        .option("topic", topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", "10")
        .load()
        .writeStream.format("noop")
    )
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert sizes == [10, 10, 10]


# ------------------------------------------------------------------ schema topics


def _schema_records() -> tuple[type, type, type]:
    from pigeon.client.schema import Array, Double, Integer, Map, Record, String

    class Address(Record):
        city = String()

    class User(Record):
        name = String(required=True)
        age = Integer()
        tags = Array(String())
        scores = Map(Double())
        home = Address()

    class UserV2(Record):  # User + a field with a default: a compatible next version
        name = String(required=True)
        age = Integer()
        tags = Array(String())
        scores = Map(Double())
        home = Address()
        email = String(default="-", required_default=True)

    UserV2.__name__ = "User"
    return Address, User, UserV2


@pytest.mark.parametrize("kind", ["AVRO", "JSON"])
def test_schema_topic_decodes_into_value_columns(
    spark: SparkSession, server: Standalone, client: Client, tmp_path: Path, kind: str
) -> None:
    from pigeon.client.schema import AvroSchema, JsonSchema

    schema_of = AvroSchema if kind == "AVRO" else JsonSchema
    address, user, user_v2 = _schema_records()
    topic = topic_name(f"schema-{kind.lower()}")
    client.create_topic(topic, 2)
    with client.create_producer(topic, schema=schema_of(user)) as p:
        for i in range(3):
            p.send(user(name=f"u{i}", age=i, tags=["a"], scores={"x": 0.5}, home=address(city="c")))
    with client.create_producer(topic) as p:  # no schema: bytes that do not decode
        p.send(b"\x01\x02 not a record")
    with client.create_producer(topic, schema=schema_of(user_v2)) as p:
        for i in range(3, 5):
            p.send(user_v2(name=f"u{i}", age=i, email=f"u{i}@x"))

    df = reader(spark, server.url, topic=topic)
    assert df.schema["value"].dataType.simpleString() == (
        "struct<age:int,email:string,home:struct<city:string>,name:string,"
        "scores:map<string,double>,tags:array<string>>"
    )
    assert df.columns[-1] == "data"
    rows = {r.name: r for r in df.select("value.*", "data").where("value IS NOT NULL").collect()}
    assert sorted(rows) == [f"u{i}" for i in range(5)]
    assert rows["u1"].email == "-"  # written with version 0: the default of the latest
    assert (rows["u1"].age, rows["u1"].tags, rows["u1"].scores) == (1, ["a"], {"x": 0.5})
    assert rows["u1"].home.city == "c"
    assert rows["u4"].email == "u4@x" and rows["u4"].home is None
    bad = df.where("value IS NULL").select("data").collect()
    assert [r.data for r in bad] == [b"\x01\x02 not a record"]  # a null row, not a failure

    raw = reader(spark, server.url, topic=topic, decodeSchema="false")
    assert raw.schema["value"].dataType.simpleString() == "binary"
    assert "data" not in raw.columns

    # written back as it was read: the sink writes the stored bytes (``data``)
    copy = topic_name(f"schema-copy-{kind.lower()}")
    df.drop("topic").write.format("pigeon").mode("append").option("service_url", server.url).option(
        "topic", copy
    ).save()
    copied = reader(spark, server.url, topic=copy, decodeSchema="false")
    assert sorted(r.value for r in copied.collect()) == sorted(r.value for r in raw.collect())

    out = tmp_path / "out"
    stream = (
        spark.readStream.format("pigeon")
        .option("service_url", server.url)
        .option("topic", topic)
        .option("startingOffsets", "earliest")
        .load()
        .select("value.name", "value.email", "offset")
    )
    run_available_now(
        stream.writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
    )
    got = spark.read.parquet(str(out)).collect()
    assert sorted((r.name or "", r.email or "") for r in got) == [
        ("", ""),
        *[(f"u{i}", "-") for i in range(3)],
        *[(f"u{i}", f"u{i}@x") for i in range(3, 5)],
    ]


# --------------------------------------------------------------------- streaming sink


@pytest.mark.parametrize("write_order", ["input", "sorted"])
def test_streaming_sink_is_exactly_once_when_a_batch_is_replayed(
    spark: SparkSession, server: Standalone, client: Client, tmp_path: Path, write_order: str
) -> None:
    source, target = topic_name("sink-in"), topic_name("sink-out")
    client.create_topic(target, 2)
    produce(
        client,
        source,
        [
            {
                "value": b"row-%d" % i,
                "key": None if i % 4 == 0 else f"k{i % 6}",
                "properties": {"i": str(i)},
            }
            for i in range(90)
        ],
    )
    checkpoint = tmp_path / "checkpoint"

    def run() -> Any:
        df = (
            spark.readStream.format("pigeon")
            .option("service_url", server.url)
            .option("topic", source)
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", "40")
            .option("includeProperties", "true")
            .load()
            .select(
                "key", F.concat(F.lit(b"out-"), "value").alias("value"), "properties", "event_time"
            )
        )
        return run_available_now(
            df.writeStream.format("pigeon")
            .option("service_url", server.url)
            .option("topic", target)
            .option("writeOrder", write_order)
            .option("checkpointLocation", str(checkpoint))
        )

    run()
    commits = sorted(
        (p for p in (checkpoint / "commits").iterdir() if p.name.isdigit()),
        key=lambda p: int(p.name),
    )
    assert [c.name for c in commits] == ["0", "1", "2"]
    # Spark lost the commit of the last micro-batch (as if the driver died right after
    # the sink wrote it): the restarted query runs batch 2 again, writing its rows again.
    commits[-1].unlink()
    (checkpoint / "commits" / ".2.crc").unlink(missing_ok=True)
    query = run()
    replayed = [p for p in query.recentProgress if p["batchId"] == 2]
    assert replayed and replayed[0]["numInputRows"] == 10

    stored = reader(spark, server.url, topic=target, includeProperties="true").collect()
    values = Counter(r.value for r in stored)
    assert values == Counter(b"out-row-%d" % i for i in range(90))  # each row once
    assert {r.value: r.properties["i"] for r in stored} == {
        b"out-row-%d" % i: str(i) for i in range(90)
    }
    keys = {r.value: r.key for r in stored}
    assert keys[b"out-row-0"] is None and keys[b"out-row-1"] == b"k1"


def test_batch_sink_writes_rows(spark: SparkSession, server: Standalone, client: Client) -> None:
    first, second = topic_name("batch-out"), topic_name("batch-out")
    df = spark.createDataFrame(
        [(f"k{i}", f"v{i}", i * 1000, [first, second][i % 2]) for i in range(30)],
        "key string, value string, ms long, topic string",
    ).select(
        "key",
        "value",
        "topic",  # a topic per row
        F.col("ms").alias("event_time"),
        F.create_map(F.lit("n"), F.col("ms").cast("string")).alias("properties"),
    )
    df.write.format("pigeon").mode("append").option("service_url", server.url).save()
    got = (
        reader(spark, server.url, topics=f"{first},{second}", includeProperties="true")
        .select(
            "topic", "key", "value", F.expr("unix_millis(event_time)").alias("et"), "properties"
        )
        .collect()
    )
    assert sorted((r.topic, r.key, r.value, r.et, r.properties["n"]) for r in got) == sorted(
        (
            full([first, second][i % 2]),
            f"k{i}".encode(),
            f"v{i}".encode(),
            i * 1000 or None,
            str(i * 1000),
        )
        for i in range(30)
    )


# --------------------------------------------------------------------------- data loss


def test_fail_on_data_loss_both_ways(spark: SparkSession, tmp_path: Path, client: Client) -> None:
    config = tmp_path / "pigeon.toml"
    config.write_text("[broker]\nsegment_max_entries = 2\nmaintenance_interval_s = 0.2\n")
    server = Standalone(
        tmp_path / "data", log_dir=tmp_path, fsync="never", extra_args=("--config", str(config))
    ).start()
    try:
        topic = topic_name("lost")
        with Client(server.url, operation_timeout=20) as c:
            with c.create_producer(topic) as producer:
                for i in range(21):  # one entry each: segments of two entries roll over
                    producer.send(b"x-%d" % i)
            # A durable subscription consumes everything; retention is 0: the maintenance
            # pass deletes the closed segments (offsets 0..19).
            with c.subscribe(topic, "drain", initial_position="earliest") as consumer:
                for _ in range(21):
                    msg = consumer.receive(timeout=10)
                consumer.acknowledge_cumulative(msg)
            deadline = time.monotonic() + 30
            while True:
                earliest, latest = partition_offsets(c, topic)[full(topic)]
                if earliest == 20:  # all but the open segment (offset 20) is gone
                    break
                assert time.monotonic() < deadline, f"retention did not run ({earliest}, {latest})"
                time.sleep(0.1)
        assert latest == 21

        from_zero = {"startingOffsets": {full(topic): 0}}
        with pytest.raises(Exception, match="failOnDataLoss") as info:
            reader(spark, server.url, topic=topic, **from_zero).collect()
        assert f"offsets [0, {earliest}) of {full(topic)} were deleted" in str(info.value)

        skipped = reader(spark, server.url, topic=topic, failOnDataLoss="false", **from_zero)
        assert [(r.offset, r.value) for r in skipped.collect()] == [(20, b"x-20")]
        # "earliest" means the earliest still stored: no loss to report
        assert reader(spark, server.url, topic=topic).count() == 1
    finally:
        server.close()


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"topic": "t", "startingOfsets": "earliest"},
            "unknown option startingofsets (did you mean startingOffsets?)",
        ),
        (
            {"topic": "t", "topics": "a,b"},
            "give exactly one of topic, topics, topicsPattern (got topic, topics)",
        ),
        (
            {"topic": "t", "startingOffsets": "earliest", "startingTimestamp": "1"},
            "startingOffsets and startingTimestamp conflict",
        ),
        ({}, "give exactly one of topic, topics, topicsPattern"),
    ],
)
def test_bad_options_fail_at_load(
    spark: SparkSession, server: Standalone, options: dict[str, str], message: str
) -> None:
    r = spark.read.format("pigeon").option("service_url", server.url)
    for k, v in options.items():
        r = r.option(k, v)
    with pytest.raises(Exception) as info:
        r.load()
    assert message in str(info.value)


def test_bad_sink_input_fails_at_save(spark: SparkSession, server: Standalone) -> None:
    # the streaming sink runs the same checks when its query starts
    df = spark.createDataFrame([(1, "a")], "value int, key string")
    with pytest.raises(Exception) as info:
        df.write.format("pigeon").mode("append").option("service_url", server.url).save()
    assert "column 'value' must be binary or string, not int" in str(info.value)
    assert "set the 'topic' option or give the DataFrame a 'topic' column" in str(info.value)


# ----------------------------------------------------------------------------- example


def test_example_pipeline(
    spark: SparkSession, server: Standalone, client: Client, tmp_path: Path
) -> None:
    examples = str(Path(__file__).resolve().parent.parent / "examples")
    sys.path.insert(0, examples)
    try:
        import click_generator
        import clicks_per_user
    finally:
        sys.path.remove(examples)
    clicks, per_user = topic_name("clicks"), topic_name("clicks-per-user")
    client.create_topic(per_user, 2)
    sent = click_generator.generate(
        server.url, clicks, count=2000, users=20, simulate_seconds=300, seed=1
    )
    args = clicks_per_user.parse_args(
        [
            "--service-url",
            server.url,
            "--input",
            clicks,
            "--output",
            per_user,
            "--output-dir",
            str(tmp_path / "parquet"),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--max-per-trigger",
            "5000",
        ]
    )
    for query in clicks_per_user.start(spark, args, available_now=True):
        try:
            assert query.awaitTermination(QUERY_TIMEOUT)
        finally:
            query.stop()
        assert query.exception() is None, query.exception()

    # What the job should have found: finished one-minute windows of the events.
    events = reader(spark, server.url, topic=clicks).select(
        F.get_json_object(F.col("value").cast("string"), "$.user").alias("user"), "event_time"
    )
    assert events.count() == sent
    horizon = events.agg(F.max("event_time")).first()[0] - timedelta(seconds=10)
    expected = {
        (r.user, r.start): r.n
        for r in events.groupBy(F.window("event_time", "1 minute").start.alias("start"), "user")
        .agg(F.count("*").alias("n"))
        .where(F.col("start") + F.expr("INTERVAL 1 MINUTE") <= F.lit(horizon))
        .collect()
    }
    assert expected  # some windows are finished
    parquet = {
        (r.user, r.window_start): r.clicks for r in spark.read.parquet(args.output_dir).collect()
    }
    assert parquet == expected
    topic_rows = (
        reader(spark, server.url, topic=per_user)
        .select(
            F.col("key").cast("string").alias("key"),
            F.from_json(
                F.col("value").cast("string"), "user string, window_start timestamp, clicks long"
            ).alias("j"),
        )
        .collect()
    )
    assert {(r.j.user, r.j.window_start): r.j.clicks for r in topic_rows} == expected
    assert len(topic_rows) == len(expected)  # each window once
    assert all(r.key == r.j.user for r in topic_rows)

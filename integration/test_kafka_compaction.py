"""Kafka ``cleanup.policy=compact`` against ``pigeon standalone``, with confluent-kafka.

A topic created compacted through the AdminClient is compacted by the broker (its
maintenance pass, made quick here), and a consumer reading it from the beginning gets
the latest value of every key at its original offset (gaps where older values and
deleted keys were), then the log after the horizon, tombstones included.  The policy
is described, altered to ``delete`` and back, and ``pigeon admin topics compact`` does
the same on demand.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from _admin import admin_url, pigeon
from _kafka import DEADLINE_S, consume, produce, standalone, topic_name

from pigeon.core.testing.servers import Standalone

confluent_kafka = pytest.importorskip("confluent_kafka")
from confluent_kafka.admin import (  # noqa: E402
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewTopic,
)

pytestmark = pytest.mark.integration

CONFIG = """
[broker]
maintenance_interval_s = 0.2

[kafka]
group_initial_rebalance_delay_ms = 300
default_partitions = 1
"""

#: (key, value) in offset order; None is a tombstone
HISTORY: list[tuple[bytes, bytes | None]] = [
    (b"a", b"a1"),
    (b"b", b"b1"),
    (b"a", b"a2"),
    (b"c", b"c1"),
    (b"a", b"a3"),
    (b"b", None),
    (b"d", b"d1"),
]
#: what compaction keeps of HISTORY: (offset, key, value)
COMPACTED = [(3, b"c", b"c1"), (4, b"a", b"a3"), (6, b"d", b"d1")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    with standalone(tmp_path_factory.mktemp("kafka-compact"), CONFIG) as sa:
        yield sa


def admin_client(server: Standalone) -> Any:
    return AdminClient({"bootstrap.servers": server.kafka_bootstrap})


def send(
    server: Standalone, topic: str, pairs: list[tuple[bytes, bytes | None]], *, batch: bool = False
) -> None:
    """Produce ``pairs`` in order: one record per RecordBatch (each its own entry), or
    with ``batch`` together in one (compaction then keeps some records of a batch)."""
    records = [{"key": k, "value": v} for k, v in pairs]
    linger = 200 if batch else 0
    produce(server.kafka_bootstrap, topic, records, **{"linger.ms": linger, "max.in.flight": 1})


def read_all(server: Standalone, topic: str, count: int) -> list[tuple[int, bytes, Any]]:
    got = consume(server.kafka_bootstrap, topic, count, start=-2)  # OFFSET_BEGINNING
    return [(m.offset(), m.key(), m.value()) for m in got]


def compaction(server: Standalone, topic: str) -> dict[str, Any]:
    path = f"/admin/v2/topics/persistent/public/default/{topic}-partition-0/compaction"
    with urllib.request.urlopen(admin_url(server) + path, timeout=10) as r:
        return dict(json.loads(r.read()))


def wait_horizon(server: Standalone, topic: str, horizon: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        status = compaction(server, topic)
        if status["status"] == "SUCCESS" and status["horizon"] == horizon:
            return
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


def describe(admin: Any, topic: str) -> dict[str, Any]:
    resource = ConfigResource("topic", topic)
    return dict(admin.describe_configs([resource])[resource].result(DEADLINE_S))


def test_compact_topic_keeps_the_latest_value_per_key(server: Standalone) -> None:
    admin = admin_client(server)
    topic = topic_name("compact")
    config = {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0"}
    admin.create_topics([NewTopic(topic, 1, config=config)])[topic].result(DEADLINE_S)
    configs = describe(admin, topic)
    assert configs["cleanup.policy"].value == "compact"
    assert configs["cleanup.policy"].source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value
    assert not configs["cleanup.policy"].is_read_only
    assert configs["min.cleanable.dirty.ratio"].value == "0.0"
    assert configs["delete.retention.ms"].value == "0"

    send(server, topic, HISTORY, batch=True)
    wait_horizon(server, topic, len(HISTORY))
    # the compacted view: latest value per key at its own offset, b deleted
    assert read_all(server, topic, len(COMPACTED)) == COMPACTED

    # new records, a tombstone among them: compacted in turn (c goes)
    send(server, topic, [(b"c", None), (b"e", b"e1")])
    wait_horizon(server, topic, len(HISTORY) + 2)
    assert read_all(server, topic, 3) == [(4, b"a", b"a3"), (6, b"d", b"d1"), (8, b"e", b"e1")]


def test_policy_is_altered_to_delete_and_back(server: Standalone) -> None:
    admin = admin_client(server)
    topic = topic_name("policy")
    admin.create_topics([NewTopic(topic, 1)])[topic].result(DEADLINE_S)
    configs = describe(admin, topic)
    assert configs["cleanup.policy"].value == "delete"
    assert configs["cleanup.policy"].source == ConfigSource.DEFAULT_CONFIG.value
    send(server, topic, HISTORY)
    time.sleep(0.5)  # maintenance passes: a delete topic is never compacted
    assert compaction(server, topic)["status"] == "NOT_RUN"
    everything = read_all(server, topic, len(HISTORY))
    assert [(k, v) for _o, k, v in everything] == HISTORY  # the tombstone: a null value

    resource = ConfigResource(
        "topic",
        topic,
        incremental_configs=[
            ConfigEntry("cleanup.policy", "compact", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    admin.incremental_alter_configs([resource])[resource].result(DEADLINE_S)
    assert describe(admin, topic)["cleanup.policy"].value == "compact"
    wait_horizon(server, topic, len(HISTORY))  # compacted: dirty ratio 1 >= 0.5
    assert read_all(server, topic, len(COMPACTED)) == COMPACTED

    # the legacy AlterConfigs replaces the set: cleanup.policy back to delete
    legacy = ConfigResource("topic", topic, set_config={"cleanup.policy": "delete"})
    with pytest.warns(DeprecationWarning):  # confluent-kafka prefers the incremental one
        futures = admin.alter_configs([legacy])
    futures[legacy].result(DEADLINE_S)
    assert describe(admin, topic)["cleanup.policy"].value == "delete"
    assert len(read_all(server, topic, len(HISTORY))) == len(HISTORY)  # the log again

    bad = ConfigResource(
        "topic",
        topic,
        incremental_configs=[
            ConfigEntry("cleanup.policy", "shred", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    with pytest.raises(confluent_kafka.KafkaException) as refused:
        admin.incremental_alter_configs([bad])[bad].result(DEADLINE_S)
    assert refused.value.args[0].code() == confluent_kafka.KafkaError.INVALID_CONFIG
    assert "cleanup.policy" in refused.value.args[0].str()


def compact_with_cli(server: Standalone, topic: str, horizon: int) -> None:
    """``pigeon admin topics compact`` on partition 0 until its horizon is ``horizon``
    (a run the maintenance pass started before the last records came is not doubled:
    the command is given again)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        done = pigeon(
            "admin", "--url", admin_url(server), "topics", "compact", f"{topic}-partition-0"
        )
        assert done.returncode == 0, done.stderr
        for _ in range(40):
            status = compaction(server, topic)
            if status["status"] == "SUCCESS" and status["horizon"] == horizon:
                return
            if status["status"] != "RUNNING":
                break
            time.sleep(0.05)
        assert time.monotonic() < deadline, status


def test_admin_cli_compacts_on_demand_and_kcat_reads_the_view(server: Standalone) -> None:
    admin = admin_client(server)
    topic = topic_name("cli")
    # ratio 1: the maintenance pass compacts only a topic never compacted; the command
    # compacts what came after
    config = {"cleanup.policy": "delete,compact", "min.cleanable.dirty.ratio": "1"}
    admin.create_topics([NewTopic(topic, 1, config=config)])[topic].result(DEADLINE_S)
    assert describe(admin, topic)["cleanup.policy"].value == "compact,delete"
    send(server, topic, HISTORY)
    compact_with_cli(server, topic, len(HISTORY))
    send(server, topic, [(b"a", b"a4"), (b"d", None)])
    compact_with_cli(server, topic, len(HISTORY) + 2)
    assert read_all(server, topic, 2) == [(3, b"c", b"c1"), (7, b"a", b"a4")]
    kcat = subprocess.run(
        [
            "kcat",
            "-C",
            "-b",
            server.kafka_bootstrap,
            "-t",
            topic,
            "-o",
            "beginning",
            "-e",
            "-f",
            "%o %k %s\\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert kcat.stdout.splitlines() == ["3 c c1", "7 a a4"], kcat.stderr

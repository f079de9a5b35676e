"""Kafka clients through a broker failure: kill -9 of the broker that owns a partition.

Two brokers with Kafka listeners share one embedded metadata store and two bookies
(E=2, Qw=2, Qa=2).  An idempotent confluent-kafka producer (acks=all) sends to a
3-partition topic while the broker leading partition 0 is killed with SIGKILL; the
client finds the new owner through Metadata and goes on.  Afterwards a consumer reads
every partition: every acknowledged message is there, exactly once, in each
partition's send order.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from _cluster import Cluster, Node

from pigeon.core.testing.servers import free_ports

confluent_kafka = pytest.importorskip("confluent_kafka")
from confluent_kafka import Consumer, Producer  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

pytestmark = pytest.mark.integration

SESSION_TIMEOUT = 2.0
DEADLINE_S = 90.0
PARTITIONS = 3


def start_cluster(tmp_path: Path) -> tuple[Cluster, dict[Node, int]]:
    metadata = f"embedded://{tmp_path / 'metadata'}?session_timeout={SESSION_TIMEOUT}"
    config = tmp_path / "broker.toml"
    config.write_text(
        "[broker]\nensemble_size = 2\nwrite_quorum = 2\nack_quorum = 2\n"
        "[kafka]\ngroup_initial_rebalance_delay_ms = 0\ndefault_partitions = 3\n"
    )
    cluster = Cluster(tmp_path, metadata)
    kafka_ports: dict[Node, int] = {}
    for _ in range(2):
        cluster.add_bookie()
    for _ in range(2):
        (port,) = free_ports(1)
        node = cluster.add_broker("--config", str(config), "--kafka-port", str(port))
        kafka_ports[node] = port
    return cluster, kafka_ports


def leader_port(admin: AdminClient, topic: str, partition: int) -> int:
    meta = admin.list_topics(topic, timeout=DEADLINE_S)
    leader = meta.topics[topic].partitions[partition].leader
    return int(meta.brokers[leader].port)


def test_acknowledged_messages_survive_kill_9_of_the_partition_owner(tmp_path: Path) -> None:
    cluster, kafka_ports = start_cluster(tmp_path)
    try:
        bootstrap = ",".join(f"127.0.0.1:{p}" for p in kafka_ports.values())
        topic = f"fo-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS)])[topic].result(30)
        producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 2,
                "message.timeout.ms": int(DEADLINE_S * 1000),
                "topic.metadata.refresh.interval.ms": 1000,
            }
        )
        acked: dict[int, list[bytes]] = {p: [] for p in range(PARTITIONS)}
        failed: list[Any] = []

        def report(err: Any, msg: Any) -> None:
            if err is None:
                acked[msg.partition()].append(msg.value())
            else:
                failed.append(err)

        def send(count: int, start: int) -> None:
            for i in range(start, start + count):
                producer.produce(
                    topic, value=f"m{i}".encode(), partition=i % PARTITIONS, on_delivery=report
                )
                producer.poll(0)
                if i % 100 == 0:
                    time.sleep(0.01)

        send(600, 0)
        producer.flush(30)
        victim_port = leader_port(admin, topic, 0)
        victim = next(n for n, p in kafka_ports.items() if p == victim_port)
        send(300, 600)  # in flight while the owner dies
        victim.kill9()
        send(600, 900)
        assert producer.flush(DEADLINE_S) == 0, "deliveries still pending after the failover"
        assert not failed, failed[:5]
        assert sum(len(v) for v in acked.values()) == 1500

        survivor = next(p for n, p in kafka_ports.items() if n is not victim)
        got = read_all(f"127.0.0.1:{survivor}", topic, 1500)
        for partition in range(PARTITIONS):
            assert got[partition] == acked[partition], f"partition {partition} differs"
    finally:
        cluster.kill_all()


def read_all(bootstrap: str, topic: str, count: int) -> dict[int, list[bytes]]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    got: dict[int, list[bytes]] = {p: [] for p in range(PARTITIONS)}
    total = 0
    deadline = time.monotonic() + DEADLINE_S
    try:
        while total < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            got[msg.partition()].append(msg.value())
            total += 1
    finally:
        consumer.close()
    return got

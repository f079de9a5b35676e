"""kafka-python and aiokafka in the scenarios confluent-kafka runs in test_kafka_clients:
every compression type, idempotent producers, a consumer group of three that rebalances
on join and leave, and committed offsets that survive a restart of the server.

Each scenario is one function per client library, run against one module-wide
``pigeon standalone`` (the restart test starts its own).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _kafka import DEADLINE_S, standalone, topic_name

from pigeon.core.testing.servers import Standalone

kafka = pytest.importorskip("kafka")
aiokafka = pytest.importorskip("aiokafka")

pytestmark = pytest.mark.integration

#: no default_partitions: every topic here is created with its partitions
CONFIG = "[kafka]\ngroup_initial_rebalance_delay_ms = 300\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    with standalone(tmp_path_factory.mktemp("kafka-py"), CONFIG) as sa:
        yield sa


#: a consumer that reads from the start and commits only when told
FROM_START: dict[str, Any] = {"auto_offset_reset": "earliest", "enable_auto_commit": False}
#: a group member whose death is noticed within seconds
QUICK: dict[str, Any] = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 500}


def group_conf(bootstrap: str, group: str, **extra: Any) -> dict[str, Any]:
    """Keyword arguments of a kafka-python or aiokafka group consumer (the two take the
    same names)."""
    return {"bootstrap_servers": bootstrap, "group_id": group, **extra}


def new_topic(bootstrap: str, partitions: int = 1) -> str:
    topic = topic_name("py")
    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([kafka.admin.NewTopic(topic, partitions, 1)])
    finally:
        admin.close()
    return topic


# ---------------------------------------------------------------------- kafka-python


def kp_produce(bootstrap: str, topic: str, values: list[bytes], **conf: Any) -> list[int]:
    producer = kafka.KafkaProducer(bootstrap_servers=bootstrap, acks="all", **conf)
    try:
        futures = [producer.send(topic, value=v, key=b"k") for v in values]
        producer.flush(DEADLINE_S)
        return [f.get(DEADLINE_S).offset for f in futures]
    finally:
        producer.close()


def kp_consume(bootstrap: str, topic: str, count: int, group: str) -> list[Any]:
    consumer = kafka.KafkaConsumer(topic, **group_conf(bootstrap, group, **FROM_START))
    got: list[Any] = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        while len(got) < count and time.monotonic() < deadline:
            # no more than asked for, so that the commit is of what was taken
            for records in consumer.poll(timeout_ms=500, max_records=count - len(got)).values():
                got.extend(records)
        consumer.commit()
    finally:
        consumer.close()
    return sorted(got, key=lambda m: (m.partition, m.offset))[:count]


# ---------------------------------------------------------------------- aiokafka


def ak_produce(bootstrap: str, topic: str, values: list[bytes], **conf: Any) -> list[int]:
    async def run() -> list[int]:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", **conf)
        await producer.start()
        try:
            futures = [await producer.send(topic, v, key=b"k") for v in values]
            return [(await f).offset for f in futures]
        finally:
            await producer.stop()

    return asyncio.run(run())


def ak_consume(bootstrap: str, topic: str, count: int, group: str) -> list[Any]:
    async def run() -> list[Any]:
        consumer = aiokafka.AIOKafkaConsumer(topic, **group_conf(bootstrap, group, **FROM_START))
        await consumer.start()
        got: list[Any] = []
        try:
            async with asyncio.timeout(DEADLINE_S):
                while len(got) < count:
                    batch = await consumer.getmany(timeout_ms=500, max_records=count - len(got))
                    for records in batch.values():
                        got.extend(records)
            await consumer.commit()
        finally:
            await consumer.stop()
        return sorted(got, key=lambda m: (m.partition, m.offset))[:count]

    return asyncio.run(run())


CLIENTS = {"kafka-python": (kp_produce, kp_consume), "aiokafka": (ak_produce, ak_consume)}


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("codec", [None, "gzip", "snappy", "lz4", "zstd"])
def test_every_compression_type(server: Standalone, client: str, codec: str | None) -> None:
    if client == "kafka-python" and codec == "snappy" and not kafka.codec.has_snappy():
        pytest.skip("kafka-python needs python-snappy for snappy, which is not installed")
    produce, consume = CLIENTS[client]
    topic = new_topic(server.kafka_bootstrap)
    values = [f"{codec}-{i}".encode() * 30 for i in range(60)]
    offsets = produce(server.kafka_bootstrap, topic, values, compression_type=codec)
    assert offsets == list(range(60))
    got = consume(server.kafka_bootstrap, topic, 60, f"g-{uuid.uuid4().hex[:6]}")
    assert [m.value for m in got] == values
    assert [m.offset for m in got] == list(range(60))


@pytest.mark.parametrize("client", CLIENTS)
def test_idempotent_producer(server: Standalone, client: str) -> None:
    produce, consume = CLIENTS[client]
    topic = new_topic(server.kafka_bootstrap)
    values = [f"idem-{i}".encode() for i in range(200)]
    offsets = produce(server.kafka_bootstrap, topic, values, enable_idempotence=True)
    assert offsets == list(range(200))
    got = consume(server.kafka_bootstrap, topic, 200, f"g-{uuid.uuid4().hex[:6]}")
    assert [m.value for m in got] == values


def test_kafka_python_group_of_three_rebalances_on_join_and_leave(server: Standalone) -> None:
    """Each member polls on a thread of its own, as an application does (one thread
    polling three consumers in turn lets each take part in a rebalance only a slice of
    the time, and kafka-python then keeps starting new ones)."""
    topic = new_topic(server.kafka_bootstrap, partitions=6)
    group = f"g-{uuid.uuid4().hex[:6]}"
    members: list[Member] = []
    try:
        members += [Member(server.kafka_bootstrap, topic, group) for _ in range(2)]
        assert sorted(len(a) for a in wait_assignment(members, 6)) == [3, 3]
        members.append(Member(server.kafka_bootstrap, topic, group))  # joins
        assert sorted(len(a) for a in wait_assignment(members, 6)) == [2, 2, 2]
        members.pop(0).close()  # leaves
        assert sorted(len(a) for a in wait_assignment(members, 6)) == [3, 3]
    finally:
        for m in members:
            m.close()


class Member:
    """A kafka-python group member polling on its own thread."""

    def __init__(self, bootstrap: str, topic: str, group: str) -> None:
        self.consumer = kafka.KafkaConsumer(topic, **group_conf(bootstrap, group, **QUICK))
        self.assigned: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.consumer.poll(timeout_ms=200)
            self.assigned = {tp.partition for tp in self.consumer.assignment()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)
        self.consumer.close()


def wait_assignment(members: list[Member], partitions: int) -> list[set[int]]:
    deadline = time.monotonic() + DEADLINE_S
    assigned: list[set[int]] = []
    while time.monotonic() < deadline:
        assigned = [set(m.assigned) for m in members]
        if sorted(p for a in assigned for p in a) == list(range(partitions)) and all(assigned):
            return assigned
        time.sleep(0.05)
    raise AssertionError(f"assignments never covered {partitions} partitions: {assigned}")


def test_aiokafka_group_of_three_rebalances_on_join_and_leave(server: Standalone) -> None:
    topic = new_topic(server.kafka_bootstrap, partitions=6)
    group = f"g-{uuid.uuid4().hex[:6]}"

    async def scenario() -> list[list[int]]:
        def member() -> Any:
            return aiokafka.AIOKafkaConsumer(
                topic, **group_conf(server.kafka_bootstrap, group, **QUICK)
            )

        async def settled(members: list[Any]) -> list[int]:
            async with asyncio.timeout(DEADLINE_S):
                while True:
                    for m in members:
                        await m.getmany(timeout_ms=100)
                    assigned = [{tp.partition for tp in m.assignment()} for m in members]
                    flat = sorted(p for a in assigned for p in a)
                    if flat == list(range(6)) and all(assigned):
                        return sorted(len(a) for a in assigned)

        members = [member(), member()]
        shares = []
        try:
            for m in members:
                await m.start()
            shares.append(await settled(members))
            third = member()
            await third.start()
            members.append(third)
            shares.append(await settled(members))
            await members.pop(0).stop()
            shares.append(await settled(members))
        finally:
            for m in members:
                await m.stop()
        return shares

    assert asyncio.run(scenario()) == [[3, 3], [2, 2, 2], [3, 3]]


@pytest.mark.parametrize("client", CLIENTS)
def test_commits_survive_a_restart(tmp_path: Path, client: str) -> None:
    produce, consume = CLIENTS[client]
    with standalone(tmp_path / client, CONFIG) as sa:
        topic = new_topic(sa.kafka_bootstrap)
        produce(sa.kafka_bootstrap, topic, [f"r{i}".encode() for i in range(20)])
        first = consume(sa.kafka_bootstrap, topic, 8, "keep")
        assert [m.offset for m in first] == list(range(8))
        sa.restart()
        rest = consume(sa.kafka_bootstrap, topic, 12, "keep")
        assert [m.offset for m in rest] == list(range(8, 20))

"""Features that must survive a real broker crash: delayed delivery and de-duplication.

Each test runs its own ``pigeon standalone`` process, kills it with SIGKILL and starts it
again on the same data directory and ports, talking to it with the sync client (and raw
frames).  Waits are bounded; timing checks only use generous wall-clock bounds.
"""

from __future__ import annotations

import time

import pytest
from _standalone import Standalone
from _wire import RawConnection, frame_bytes

from pigeon.client import Client, Consumer, Timeout
from pigeon.core import PluginManager
from pigeon.core._batch import BatchBuilder
from pigeon.core._codecs import CodecSet

pytestmark = pytest.mark.integration

OP_TIMEOUT = 10.0


def drain(consumer: Consumer, idle: float = 1.0, limit: int = 100_000) -> list:
    out: list = []
    while len(out) < limit:
        try:
            out.extend(consumer.batch_receive(1000, timeout=idle))
        except Timeout:
            return out
    raise AssertionError(f"more than {limit} messages kept arriving")


def read_all(client: Client, topic: str) -> list:
    reader = client.create_reader(topic, "earliest")
    try:
        return drain(reader)
    finally:
        reader.close()


def test_delayed_delivery_survives_a_broker_kill9(standalone: Standalone) -> None:
    delay = 3.0
    with Client(standalone.url, operation_timeout=OP_TIMEOUT) as client:
        client.subscribe("reminders", "s", subscription_type="shared").close()
        with client.create_producer("reminders") as producer:
            sent_at = time.time()
            producer.send(b"later", deliver_after=delay)
            producer.send(b"now")
    standalone.kill9()
    standalone.restart()
    with Client(standalone.url, operation_timeout=OP_TIMEOUT) as client:
        consumer = client.subscribe("reminders", "s", subscription_type="shared")
        first = consumer.receive(timeout=OP_TIMEOUT)
        assert first.value == b"now"
        assert time.time() < sent_at + delay, "the restart took longer than the delay: no check"
        later = consumer.receive(timeout=delay + OP_TIMEOUT)
        arrived = time.time()
        assert later.value == b"later"
        assert arrived >= sent_at + delay - 0.01, (
            f"delivered {sent_at + delay - arrived:.2f}s early"
        )
        assert arrived <= sent_at + delay + OP_TIMEOUT
        consumer.acknowledge(first)
        consumer.acknowledge(later)
        consumer.close()


def _batch(value: bytes, producer_name: str, sequence_id: int) -> bytes:
    builder = BatchBuilder(
        producer_name=producer_name,
        codec=CodecSet.from_registry(PluginManager().codecs).by_name("none"),
        max_messages=1,
        max_bytes=1 << 30,
    )
    builder.add(value)
    return builder.build(sequence_id=sequence_id, publish_time=int(time.time() * 1000))


def test_named_producer_resumes_after_its_last_stored_sequence_across_kill9(
    standalone: Standalone,
) -> None:
    values = [f"m{i}".encode() for i in range(5)]
    with (
        Client(standalone.url, operation_timeout=OP_TIMEOUT) as client,
        client.create_producer("ingest", producer_name="ingest-1", batching_max_messages=1) as p,
    ):
        for v in values:
            p.send(v)
    standalone.kill9()
    standalone.restart()
    with Client(standalone.url, operation_timeout=OP_TIMEOUT) as client:
        with client.create_producer(
            "ingest", producer_name="ingest-1", batching_max_messages=1
        ) as p:
            assert p.last_sequence_id == 4, "the broker forgot the producer's last sequence id"
            p.send(b"m5")
        # raw duplicates of old sequence ids: answered as duplicates, nothing stored
        with RawConnection(standalone.port) as raw:
            raw.handshake()
            created = raw.request(
                "createProducer",
                {"producerId": 1, "topic": "ingest", "producerName": "ingest-1"},
                request_id=2,
            )
            assert created.kind == "producerCreated", created
            assert created.body["lastSequenceId"] == 5
            for request_id, seq in ((3, 2), (4, 5)):
                receipt = raw.request(
                    "send",
                    {"producerId": 1, "sequenceId": seq, "numMessages": 1},
                    request_id=request_id,
                    payload=_batch(b"duplicate", "ingest-1", seq),
                )
                assert receipt.kind == "sendReceipt", receipt
                assert receipt.body["duplicate"] is True, receipt
                assert receipt.body["sequenceId"] == seq
            raw.send(frame_bytes("closeProducer", {"producerId": 1}, request_id=9))
        assert [m.value for m in read_all(client, "ingest")] == [*values, b"m5"]


def test_sends_in_flight_at_a_kill9_are_stored_exactly_once(standalone: Standalone) -> None:
    n = 3000
    with Client(standalone.url, operation_timeout=OP_TIMEOUT) as client:
        producer = client.create_producer(
            "bulk", producer_name="bulk-1", batching_max_messages=10, send_timeout=60
        )
        futures = [producer.send_async(f"{i:05d}".encode()) for i in range(n)]
        futures[0].result(timeout=OP_TIMEOUT)  # some are stored; many are in flight
        standalone.kill9()
        in_flight = sum(not f.done() for f in futures)
        assert in_flight, "every send completed before the kill: nothing was resent"
        standalone.restart()
        producer.flush()
        ids = [f.result(timeout=60) for f in futures]
        producer.close()
        assert len(ids) == n
        got = [m.value for m in read_all(client, "bulk")]
    assert len(got) == len(set(got)), f"{len(got) - len(set(got))} messages stored twice"
    assert got == [f"{i:05d}".encode() for i in range(n)]

"""An idempotent Kafka producer is never told "not stored" about a batch that may be.

librdkafka (and the Java client) trust the broker's codes: OUT_OF_ORDER_SEQUENCE_NUMBER
and NOT_LEADER_OR_FOLLOWER say the batch was not stored, and after an epoch bump the
client renumbers every batch it believes unstored -- a batch that was stored after all
is then stored twice.  So a batch that may be in the log is answered REQUEST_TIMED_OUT
(possibly persisted: resent as it was, caught by de-duplication), a duplicate whose
original is not remembered DUPLICATE_SEQUENCE_NUMBER at once (a success to Kafka clients),
and a topic that is closing makes no sequence decision at all.  (The nemesis found the
double store: embedded+quorum seed 777, docs/reliability.md.)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from kio.schema.errors import ErrorCode

from pigeon.broker._config import KafkaConfig
from pigeon.broker._kafka import KafkaConnection, KafkaFrontDoor
from pigeon.broker._kafka_produce import _produce_partition
from pigeon.broker._kafka_wire import error_code
from pigeon.core._quorum_writer import QuorumWriter
from pigeon.core.errors import NotEnoughBookies, ServiceUnavailable
from pigeon.core.kafka_records import encode_record_batch
from pigeon.core.testing import InProcessStandalone, in_process_standalone

TOPIC = "orders"
PRODUCER_ID, EPOCH = 4242, 0


def batch(sequence: int, epoch: int = EPOCH) -> bytes:
    parts = encode_record_batch(
        [f"m{sequence}".encode()],
        [None],
        [int(time.time() * 1000)],
        producer_id=PRODUCER_ID,
        producer_epoch=epoch,
        base_sequence=sequence,
    )
    return b"".join(parts)


class Client:
    """One Kafka connection of the door, driven without a socket."""

    def __init__(self, door: KafkaFrontDoor, nursery: trio.Nursery) -> None:
        self.conn = KafkaConnection(door=door, stream=None, name="test", nursery=nursery)  # type: ignore[arg-type]

    async def produce(self, sequence: int, epoch: int = EPOCH) -> tuple[ErrorCode, int]:
        answered: list[Any] = []
        done = trio.Event()

        def answer(outcome: Any) -> None:
            answered.append(outcome)
            done.set()

        try:
            await _produce_partition(self.conn, (TOPIC, 0), batch(sequence, epoch), answer)
        except Exception as exc:  # what produce() turns into the partition's error code
            return error_code(exc), -1
        with trio.fail_after(30):
            await done.wait()
        code, offset, _message = answered[0]
        return code, offset

    def send_nowait(self, sequence: int, answered: list[Any]) -> trio.Event:
        """Start a produce; the returned event is set once it was handed to the log."""
        handed = trio.Event()

        async def run() -> None:
            await _produce_partition(self.conn, (TOPIC, 0), batch(sequence), answered.append)
            handed.set()

        self.conn.nursery.start_soon(run)
        return handed


@pytest.fixture
async def door(tmp_path: Path) -> AsyncIterator[tuple[InProcessStandalone, KafkaFrontDoor]]:
    async with in_process_standalone(tmp_path / "pigeon") as standalone:
        service = standalone.service
        door = KafkaFrontDoor(service, KafkaConfig())
        await service.create_topic(door.topic_name(TOPIC), 1)
        yield standalone, door


def partition(standalone: InProcessStandalone, door: KafkaFrontDoor) -> Any:
    return standalone.service.topics[door.partition_name(TOPIC, 0).full]


async def test_a_duplicate_of_a_forgotten_original_is_answered_at_once(
    door: tuple[InProcessStandalone, KafkaFrontDoor], autojump_clock: trio.testing.MockClock
) -> None:
    standalone, kafka = door
    async with trio.open_nursery() as nursery:
        client = Client(kafka, nursery)
        assert (await client.produce(0))[0] is ErrorCode.none
        # the partition reloads (a move, a session expiry): its de-duplication state is
        # the snapshot, which knows sequence 0 was stored but not where
        from pigeon.broker._lifecycle import unload_topic

        await unload_topic(standalone.service, kafka.partition_name(TOPIC, 0))
        client = Client(kafka, nursery)
        never = trio.Event()

        async def slow_search(*_: Any) -> Any:
            await never.wait()  # the log is slow to read right after the reload

        started = trio.current_time()
        code, _ = await _with_search(standalone, kafka, slow_search, client.produce(0))
        # a success to the client (DUPLICATE_SEQUENCE_NUMBER), not a refusal after a
        # search: a refusal says "not stored" and an epoch bump would store it again
        assert code is ErrorCode.duplicate_sequence_number
        assert trio.current_time() - started < 1.0
        assert (await client.produce(1))[0] is ErrorCode.none
        nursery.cancel_scope.cancel()
    topic = await standalone.service.get_topic(kafka.partition_name(TOPIC, 0))
    assert topic.next_offset == 2  # m0 and m1, each stored once


async def _with_search(
    standalone: InProcessStandalone, kafka: KafkaFrontDoor, search: Any, call: Any
) -> Any:
    from pigeon.broker import _topic

    original = _topic.Topic.original_receipt
    _topic.Topic.original_receipt = search  # type: ignore[method-assign]
    try:
        return await call
    finally:
        _topic.Topic.original_receipt = original  # type: ignore[method-assign]


async def test_a_batch_lost_with_a_closing_ledger_is_possibly_stored_not_out_of_order(
    door: tuple[InProcessStandalone, KafkaFrontDoor],
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    standalone, kafka = door
    async with trio.open_nursery() as nursery:
        client = Client(kafka, nursery)
        assert (await client.produce(0))[0] is ErrorCode.none
        topic = partition(standalone, kafka)
        answered: list[Any] = []
        # batch 1 stays on its way to the bookie: its answer is not taken (the
        # in-process bookie may otherwise store and answer it in the same task step)
        monkeypatch.setattr(QuorumWriter, "_on_add", lambda *_: None)
        handed = client.send_nowait(1, answered)
        await handed.wait()
        # the ledger gives up while batch 1 is on its way to the bookies: it may yet be
        # in the log the next owner recovers
        topic.ledger._fenced(ServiceUnavailable("topic is closing"), notify=False)
        monkeypatch.undo()
        assert answered and answered[0][0] is ErrorCode.request_timed_out
        # the client's next batch reaches the closing partition: no "out of order"
        # (that would make it bump its epoch and renumber batch 1), a refusal before
        # anything is stored, after which it looks the partition up again
        code, _ = await client.produce(2)
        assert code is ErrorCode.not_leader_or_follower
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("case", ["new epoch", "new producer", "new epoch, partition moved"])
async def test_a_batch_after_a_lost_first_batch_is_out_of_order(
    door: tuple[InProcessStandalone, KafkaFrontDoor],
    autojump_clock: trio.testing.MockClock,
    case: str,
) -> None:
    """A producer (epoch) whose first batch was not stored is not "new" to the partition:
    its next batch skips that one.  Stored and acknowledged, it would tell the client the
    skipped batch is stored too (librdkafka acknowledges every message before a stored
    batch -- "implicit ack" -- as the broker keeps a producer's batches in order), and it
    would be lost.  (The nemesis lost two so: etcd + leader-follower, seed 777, after an
    epoch bump while the partition could not write.)"""
    standalone, kafka = door
    epoch = 0 if case == "new producer" else 1
    async with trio.open_nursery() as nursery:
        client = Client(kafka, nursery)
        stored = 0
        if epoch:
            assert (await client.produce(0, epoch=0))[0] is ErrorCode.none
            stored += 1
        ledger = (await standalone.service.get_topic(kafka.partition_name(TOPIC, 0))).ledger
        # the partition cannot write for a while (a rollover short of bookies): the
        # epoch's first batch is refused, nothing stored
        ledger.unavailable = NotEnoughBookies("needs 2 writable bookies, 1 available")
        assert (await client.produce(0, epoch))[0] is ErrorCode.request_timed_out
        ledger.unavailable = None
        if case.endswith("moved"):
            from pigeon.broker._lifecycle import unload_topic

            await unload_topic(standalone.service, kafka.partition_name(TOPIC, 0))
            client = Client(kafka, nursery)
        # the client's next batch (sent before the answer to the first came back)
        code, _ = await client.produce(1, epoch)
        assert code is ErrorCode.out_of_order_sequence_number
        # the client bumps its epoch (or resends in order): everything is stored
        assert (await client.produce(0, epoch))[0] is ErrorCode.none
        assert (await client.produce(1, epoch))[0] is ErrorCode.none
        nursery.cancel_scope.cancel()
    topic = await standalone.service.get_topic(kafka.partition_name(TOPIC, 0))
    assert topic.next_offset == stored + 2

"""Kafka Produce and InitProducerId over the broker core's publish path.

Each RecordBatch is stored as it came, one entry per batch, wrapped in our batch header
(format 2, see :mod:`pigeon.core.kafka_records`): no record is decoded on the way in.
``acks=1`` and ``acks=all`` are both answered once the entry is on the ack quorum (Qa
bookies): PigeonMQ has no weaker acknowledgement to offer; ``acks=0`` gets no answer.

Idempotent producers: a producer id from InitProducerId (random 63-bit, unique with
overwhelming probability across the cluster without coordination) and epoch name the
PigeonMQ producer ``kafka-<id>-<epoch>``, whose de-duplication is on whatever the
namespace says; a batch's base sequence is its sequence id, so a resent batch is
answered with the original's offset, never stored twice.  A batch whose base sequence
skips past the last one sent (or past 0: the first of a producer whose sends all failed,
or of a new epoch) is refused with OUT_OF_ORDER_SEQUENCE_NUMBER (the client resends in
order), and one from an epoch below the highest seen for its producer id with
INVALID_PRODUCER_EPOCH.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode

from pigeon.broker._kafka import KafkaConnection
from pigeon.broker._kafka_wire import ZERO, Later, ProduceAnswer, build, error_code, response_type
from pigeon.core.errors import (
    AuthorizationError,
    NotOwner,
    PigeonError,
    ProducerBusy,
    TopicNotFound,
)
from pigeon.core.kafka_records import (
    FORMAT_KAFKA,
    count_records,
    read_batch_info,
    split_record_batches,
    wrap_record_batch,
)

if TYPE_CHECKING:
    from pigeon.broker._topic import Producer

__all__ = ["HANDLERS"]

log = logging.getLogger(__name__)

#: (error code, base offset, message) of one partition's produce
Outcome = tuple[ErrorCode, int, str | None]


async def produce(conn: KafkaConnection, request: Any) -> Any:
    version = type(request).__version__
    #: by slot: the request's partition entries in order (a partition may repeat)
    results: dict[int, Outcome] = {}
    order: list[tuple[str, int]] = []
    answer: Later[Any] = Later()
    waiting = 0
    sealed = False

    def finish(slot: int, outcome: Outcome) -> None:
        nonlocal waiting
        if slot in results:
            return  # answered already (a later batch of the partition failed too)
        results[slot] = outcome
        waiting -= 1
        if sealed and waiting == 0:
            answer.set(_response(version, order, results))

    refused: list[tuple[tuple[str, int], PigeonError]] = []
    for topic_data in request.topic_data:
        for data in topic_data.partition_data:
            key = (topic_data.name, data.index)
            slot = len(order)
            order.append(key)
            waiting += 1
            try:
                await _produce_partition(conn, key, data.records, functools.partial(finish, slot))
            except PigeonError as exc:
                if not exc.retriable and not isinstance(exc, AuthorizationError):
                    refused.append((key, exc))  # a denial is logged once per connection
                finish(slot, (error_code(exc), -1, str(exc)))
    if refused:  # one line per request, however many partitions it refused
        (topic, index), first = refused[0]
        log.warning(
            "kafka produce refused conn=%s topic=%s partition=%d%s: %s",
            conn.name,
            topic,
            index,
            f" (and {len(refused) - 1} more partitions)" if len(refused) > 1 else "",
            first,
        )
    sealed = True
    if request.acks == 0:
        return None
    if waiting == 0:
        return _response(version, order, results)
    return answer


def _response(
    version: int, order: list[tuple[str, int]], results: dict[int, Outcome]
) -> ProduceAnswer:
    topics: dict[str, list[tuple[int, int, int, str | None]]] = {}
    for slot, (name, index) in enumerate(order):
        code, offset, message = results[slot]
        topics.setdefault(name, []).append((index, int(code), offset, message))
    return ProduceAnswer(version, list(topics.items()))


async def _produce_partition(
    conn: KafkaConnection,
    key: tuple[str, int],
    records: bytes | None,
    done: Callable[[Outcome], None],
) -> None:
    """Send the partition's batches; ``done`` once, when all are stored or one failed."""
    door = conn.door
    core = door.core
    kafka_topic, index = key
    await conn.authorize("produce", kafka_topic)  # kept per connection: no per-request work
    name = door.partition_name(kafka_topic, index)
    if index < 0 or index >= await core.partitions_of(door.topic_name(kafka_topic)):
        raise TopicNotFound(f"topic {kafka_topic!r} has no partition {index}")
    batches = split_record_batches(memoryview(records or b""))
    remaining = len(batches)
    first_offset: int | None = None
    answered = False

    def one_done(outcome: Outcome) -> None:
        nonlocal remaining, first_offset, answered
        if answered:
            return
        if outcome[0] != ErrorCode.none:
            answered = True
            done(outcome)
            return
        if first_offset is None:
            first_offset = outcome[1]  # answers come in append order
        remaining -= 1
        if remaining == 0:
            answered = True
            done((ErrorCode.none, first_offset, None))

    if not batches:
        done((ErrorCode.none, -1, None))
        return
    # every batch is checked before any is sent: a corrupt one refuses the whole
    # partition's records, never after the batches before it were stored
    limit = core.max_message_size(name) * 64  # decompressed records of one batch, at most
    infos = [read_batch_info(batch) for batch in batches]
    for batch, info in zip(batches, infos, strict=True):
        count_records(batch, info, limit)
    for batch, info in zip(batches, infos, strict=True):
        await _send_batch(conn, name, batch, info, one_done)


async def _send_batch(
    conn: KafkaConnection, name: Any, batch: memoryview, info: Any, done: Callable[[Outcome], None]
) -> None:
    door = conn.door
    core = door.core
    idempotent = info.producer_id >= 0
    producer_name = f"kafka-{info.producer_id}-{info.producer_epoch}" if idempotent else ""
    slot = (name.full, producer_name)
    producer = conn.producers.get(slot)
    if producer is None or producer.fenced or producer.topic.unloaded:
        producer = await _attach(conn, name, producer_name, idempotent)
        conn.producers[slot] = producer
    if producer.topic.unloaded or producer.topic.ledger.closed:
        # closing here (its ledger gave up): batches handed to it may still turn up in
        # the log the next owner recovers, so its de-duplication state can be behind
        # the log's -- no sequence decision from it, nothing appended
        raise NotOwner(f"{name.full} is closing here; look it up again")
    if idempotent:
        epochs = _epochs(door)
        highest = epochs.highest(info.producer_id, producer.topic.dedup)
        if info.producer_epoch < highest:
            done(
                (
                    ErrorCode.invalid_producer_epoch,
                    -1,
                    f"producer {info.producer_id} epoch {info.producer_epoch} is fenced by"
                    f" epoch {highest}",
                )
            )
            return
        epochs.saw(info.producer_id, info.producer_epoch)
        sequence = info.base_sequence
        dedup = producer.topic.dedup
        expected = dedup.next_sequence(producer.name)
        if (
            expected is None
            and sequence > 0
            and any(e < info.producer_epoch for e in _stored_epochs(dedup, info.producer_id))
        ):
            expected = 0  # Kafka's rule: a new epoch of a known producer starts at 0
        # A batch past the expected one is refused even when nothing of the producer
        # (epoch) is stored here yet -- its first batch failed: a Kafka client takes a
        # stored batch as proof that every batch before it is stored too (librdkafka's
        # "implicit ack"), so storing this one would lose the batches it skips.  Only a
        # producer the partition knows nothing of (its state trimmed away) starts anywhere.
        if expected is not None and sequence > expected:
            log.info(
                "kafka produce out of order topic=%s producer=%s sequence=%d expected=%d",
                name.full,
                producer.name,
                sequence,
                expected,
            )
            done(
                (
                    ErrorCode.out_of_order_sequence_number,
                    -1,
                    f"sequence {sequence} skips from {expected}: send the batches in between first",
                )
            )
            return
    else:
        sequence = conn.sequence
        conn.sequence += info.record_count
    payload = b"".join(
        wrap_record_batch(
            batch,
            info,
            producer_name=producer.name,
            sequence_id=sequence,
            publish_time=int(time.time() * 1000),
        )
    )

    def reply(receipt: Any, error: BaseException | None, duplicate: bool) -> None:
        if error is not None:
            done((_after_append_code(error), -1, str(error)))
        elif receipt is None:  # a duplicate whose original is no longer remembered
            done((ErrorCode.duplicate_sequence_number, -1, None))
        else:
            done((ErrorCode.none, receipt[2], None))

    try:
        core.send(
            producer,
            payload,
            num_messages=info.record_count,
            sequence_id=sequence,
            reply=reply,
            fence=functools.partial(_fence, core, producer),
            spawn=lambda fn: conn.nursery.start_soon(fn),
        )
    except PigeonError as exc:
        core.fence_producer(producer, exc)
        done((error_code(exc), -1, str(exc)))


def _after_append_code(error: BaseException) -> ErrorCode:
    """The code of a batch that failed once handed to the log (or whose in-flight
    original failed): a retriable failure there may still have stored it (a write that
    reached the bookies before the ledger gave up is kept by the next owner's recovery),
    so the client is told REQUEST_TIMED_OUT -- "possibly persisted, resend it as it was"
    -- never a code that says it was not stored (NOT_LEADER_OR_FOLLOWER): a client that
    believes that may renumber the batch under a new epoch and store it twice."""
    if isinstance(error, PigeonError) and error.retriable:
        return ErrorCode.request_timed_out
    return error_code(error)


class ProducerEpochs:
    """The highest epoch seen of each idempotent producer id (the most recent
    :data:`MAX_PRODUCERS` ids).  An id this broker has not seen is looked up in the
    partition's de-duplication state, which the log rebuilds after a failover: its
    producers are named ``kafka-<id>-<epoch>``, so a fenced epoch stays fenced on the
    broker that takes the partition over."""

    def __init__(self) -> None:
        self._epochs: OrderedDict[int, int] = OrderedDict()

    def highest(self, producer_id: int, dedup: Any = None) -> int:
        epoch = self._epochs.get(producer_id)
        if epoch is None:
            epoch = -1 if dedup is None else max(_stored_epochs(dedup, producer_id), default=-1)
            self.saw(producer_id, epoch)
        else:
            self._epochs.move_to_end(producer_id)
        return epoch

    def saw(self, producer_id: int, epoch: int) -> None:
        if epoch >= self._epochs.get(producer_id, -1):
            self._epochs[producer_id] = epoch
        self._epochs.move_to_end(producer_id)
        while len(self._epochs) > MAX_PRODUCERS:
            self._epochs.popitem(last=False)


def _stored_epochs(dedup: Any, producer_id: int) -> list[int]:
    """The epochs of ``producer_id`` with batches stored in the partition (its producers
    are named ``kafka-<id>-<epoch>``)."""
    prefix = f"kafka-{producer_id}-"
    return [
        int(name[len(prefix) :])
        for name in dedup.persisted_map()
        if name.startswith(prefix) and name[len(prefix) :].isdigit()
    ]


#: producer ids whose epochs a broker remembers (older ones are looked up again)
MAX_PRODUCERS = 100_000


def _epochs(door: Any) -> ProducerEpochs:
    epochs: ProducerEpochs | None = door.state.get("epochs")
    if epochs is None:
        epochs = door.state["epochs"] = ProducerEpochs()
    return epochs


def _fence(core: Any, producer: Producer, error: BaseException) -> None:
    """A send was not stored: the producer attaches again for its next batch (and an
    idempotent one resends from the lost batch on, in order)."""
    core.fence_producer(producer, error)


async def _attach(
    conn: KafkaConnection, name: Any, producer_name: str, idempotent: bool
) -> Producer:
    core = conn.door.core

    def still_wanted() -> None:
        if conn.closed:
            raise TopicNotFound("the Kafka connection closed while attaching")  # never seen

    producer_name = producer_name or f"kafka-{secrets.token_hex(6)}"
    try:
        producer = await core.create_producer(
            name, producer_name, client=conn, producer_id=conn.ident, still_wanted=still_wanted
        )
    except ProducerBusy:
        # An idempotent producer's id and epoch are its own: the same producer on a new
        # connection (the old one is gone without the server knowing yet) takes over.
        old = core.topics[name.full].producers.get(producer_name)
        if old is None or not isinstance(old.conn, KafkaConnection):
            raise
        old.conn.producers.pop((name.full, producer_name), None)
        core.close_producer(old)
        log.info("kafka producer re-attached on a new connection producer=%s", producer_name)
        producer = await core.create_producer(
            name, producer_name, client=conn, producer_id=conn.ident, still_wanted=still_wanted
        )
    producer.deduplicate = idempotent
    producer.record_format = FORMAT_KAFKA
    producer.find_duplicate_positions = False  # DUPLICATE_SEQUENCE_NUMBER is a success
    return producer


async def init_producer_id(conn: KafkaConnection, request: Any) -> Any:
    cls = response_type(request)

    def answer(error: ErrorCode, producer_id: int = -1, epoch: int = -1) -> Any:
        return build(
            cls, throttle_time=ZERO, error_code=error, producer_id=producer_id, producer_epoch=epoch
        )

    if request.transactional_id is not None:
        return answer(ErrorCode.transactional_id_authorization_failed)
    try:  # Kafka's IDEMPOTENT_WRITE: a role that may produce somewhere
        await conn.authorize("idempotent", "")
    except AuthorizationError:
        return answer(ErrorCode.cluster_authorization_failed)
    producer_id = getattr(request, "producer_id", -1)
    epoch = getattr(request, "producer_epoch", -1)
    if producer_id >= 0 and epoch >= 0:
        # KIP-360: an idempotent producer bumps its epoch after a sequence error
        epochs = _epochs(conn.door)
        if epoch < epochs.highest(producer_id):
            return answer(ErrorCode.invalid_producer_epoch)
        new_epoch = epoch + 1
        if new_epoch > 32767:
            producer_id, new_epoch = secrets.randbits(62), 0
        epochs.saw(producer_id, new_epoch)  # the old epoch is fenced from now on
        return answer(ErrorCode.none, producer_id, new_epoch)
    return answer(ErrorCode.none, secrets.randbits(62), 0)


HANDLERS = {0: produce, 22: init_producer_id}

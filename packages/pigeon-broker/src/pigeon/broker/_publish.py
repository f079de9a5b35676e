"""Publishing: a producer's batch through de-duplication and the backlog quota into the
topic's log.  Broker core, without a wire protocol: the front door passes in how to
answer, how to tell the producer it was fenced, and where a request's tasks run.

Produce requests never wait in a task: :func:`publish` appends to the managed ledger at
once, so the order of a connection's sends is the order in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from pigeon.broker._dedup import Decision
from pigeon.core.batch import read_header
from pigeon.core.errors import (
    InvalidArgument,
    MessageTooLarge,
    PigeonError,
    ProducerBlocked,
    ServiceUnavailable,
)

if TYPE_CHECKING:
    from pigeon.broker._service import BrokerService
    from pigeon.broker._topic import Producer

__all__ = ["DEDUP_LOOKUP_WAIT_S", "Reply", "fence_producer", "publish"]

log = logging.getLogger(__name__)

#: how long a duplicate's answer waits for its original to be named before it is
#: refused (retriable): the client completes its sends in order, so every later send of
#: the producer waits too
DEDUP_LOOKUP_WAIT_S = 2.0

#: ``reply(receipt, error, duplicate)``: a receipt is (segment id, entry id, first offset)
Reply = Callable[[Any, "BaseException | None", bool], None]


def publish(
    service: BrokerService,
    producer: Producer,
    payload: bytes | memoryview,
    *,
    num_messages: int,
    sequence_id: int,
    reply: Reply,
    fence: Callable[[BaseException], None],
    spawn: Callable[[Callable[[], Awaitable[None]]], None],
) -> None:
    """Store a batch of ``producer``'s, or answer it as a duplicate of a stored one.

    ``reply(receipt, error, duplicate)`` is called exactly once, maybe later (when the
    entry is stored); ``fence(error)`` when a send of the producer was not stored (its
    later sends are refused until it re-attaches); ``spawn(fn)`` runs a task that
    belongs to the request (looking up a duplicate's original).  A send refused at once
    raises (the caller answers it and fences the producer).  ``payload`` is kept by
    reference until it is appended (a held send): the caller must not reuse its buffer.
    """
    policies = service.policies.cached(producer.topic.name.namespace_name)
    limit = service.max_message_size(producer.topic.name)
    if len(payload) > limit:
        raise MessageTooLarge(
            f"batch of {len(payload):,} bytes (header and messages) is over"
            f" max_message_size {limit:,} of {producer.topic.name.full}"
        )
    header = read_header(payload)
    if header.format_version != producer.record_format:
        raise InvalidArgument(
            f"batch format {header.format_version} is not this producer's"
            f" (format {producer.record_format})"
        )
    n = num_messages
    if header.num_messages != n or n == 0:
        raise InvalidArgument(f"send says {n} messages but its batch holds {header.num_messages}")
    topic = producer.topic
    if producer.fenced:
        raise producer.fenced_error or ServiceUnavailable(
            f"producer {producer.name} lost a send and must re-attach before sending on"
        )
    dedup = topic.dedup
    name = producer.name

    def answer(receipt: Any, error: BaseException | None, duplicate: bool, why: str = "") -> None:
        if duplicate and error is None and receipt is None:
            log.info(
                "duplicate answered without its position topic=%s producer=%s"
                " sequence=%d count=%d why=%s",
                topic.name,
                name,
                sequence_id,
                n,
                why or "original not remembered",
            )
        reply(receipt, error, duplicate)

    decision = (
        dedup.check(name, sequence_id, n)
        if policies.deduplication or producer.deduplicate
        else Decision.NEW
    )
    if decision is Decision.DUPLICATE:
        receipt = dedup.receipt(name, sequence_id, n)
        if (
            receipt is None
            and producer.find_duplicate_positions
            and topic.may_find_original(name, sequence_id)
        ):
            # stored before the state this broker recovered from: look it up (the
            # client completes its sends in order whatever order answers come in)
            async def look_up() -> None:
                found = None
                with trio.move_on_after(DEDUP_LOOKUP_WAIT_S) as scope:
                    found = await topic.original_receipt(name, sequence_id, n)
                if scope.cancelled_caught:
                    # not named yet (the log reads slowly): a retriable refusal, so the
                    # client sends it again after re-attaching, while the search goes
                    # on; never a receipt without the position it has
                    log.info(
                        "duplicate refused until its original is found topic=%s"
                        " producer=%s sequence=%d",
                        topic.name,
                        name,
                        sequence_id,
                    )
                    answer(
                        None,
                        ServiceUnavailable(
                            f"the original of sequence {sequence_id} is still being"
                            " looked for in the log; send it again"
                        ),
                        True,
                    )
                    return
                answer(found, None, True, "original not found in the log")

            spawn(look_up)
            return
        answer(receipt, None, True, "original not remembered, log not searched")
        return
    if decision is Decision.IN_FLIGHT:

        def resent(receipt: Any, error: BaseException | None) -> None:
            answer(receipt, error, True, "in-flight original batched differently")
            if error is not None:
                # the original (sent on an earlier attachment) was not stored: this
                # attachment's later sends must not be stored before its resend
                fence(error)

        dedup.wait(name, sequence_id, n, resent)
        return
    if (
        policies.backlog_quota_bytes >= 0
        and policies.backlog_quota_policy == "producer_exception"
        and topic.backlog_bytes() > policies.backlog_quota_bytes
    ):
        raise ProducerBlocked(
            f"backlog of {topic.name} exceeds its quota of {policies.backlog_quota_bytes} bytes"
        )

    def done(result: Any, error: BaseException | None) -> None:
        if error is not None:
            dedup.failed(name, sequence_id, n, error, flight)
            answer(None, error, False)
            fence(error)
            return
        dedup.persisted(name, sequence_id, n, result)
        topic.confirm_sequence(result[0], result[1])
        answer(result, None, False)

    flight = dedup.pushed(name, sequence_id, n)
    deliver_at = header.deliver_at
    if (
        topic.holding  # sends held earlier go first (a producer's order is the log's)
        or (
            policies.backlog_quota_bytes >= 0
            and policies.backlog_quota_policy == "producer_request_hold"
            and topic.backlog_bytes() > policies.backlog_quota_bytes
        )
    ):

        def release() -> None:
            if producer.fenced:
                # an earlier send of this producer failed meanwhile: storing this one
                # would make that one's resend look like a duplicate
                done(
                    None,
                    producer.fenced_error
                    or ServiceUnavailable(f"producer {name} must resend from a lost send"),
                )
                return
            # the payload is the received frame's (a buffer nothing reuses): kept, not copied
            _append(topic, payload, n, done, deliver_at)

        topic.hold(release)
        return
    _append(topic, payload, n, done, deliver_at)


def _append(topic: Any, payload: Any, n: int, done: Any, deliver_at: int) -> None:
    """Append, turning a refusal (closed or unwritable ledger) into ``done``'s error."""
    try:
        topic.append(payload, n, done, deliver_at=deliver_at)
    except PigeonError as exc:
        done(None, exc)


def fence_producer(producer: Producer, error: BaseException) -> bool:
    """A send of ``producer`` was not stored: refuse its later sends until it
    re-attaches, so that it resends from the lost one on, in order.  False if it was
    fenced already (its client was told)."""
    if producer.fenced:
        return False
    producer.fenced = True
    log.info(
        "producer must re-attach topic=%s producer=%s error=%s",
        producer.topic.name,
        producer.name,
        error,
    )
    return True

"""Admin operations on subscriptions: create, delete, reset the cursor, skip, peek.

Part of the admin API's operations (see :mod:`pigeon.broker._admin_ops`).
"""

from __future__ import annotations

import base64
import functools
import logging
from typing import TYPE_CHECKING, Any

from pigeon.broker._admin_topics import check_subscription_name, parse_message_id, topic_stats
from pigeon.broker._lifecycle import (
    disconnect,
    open_existing_topic,
    subscription_names,
    topic_targets,
)
from pigeon.broker._service import BrokerService
from pigeon.broker._topic import Topic
from pigeon.core import TopicName
from pigeon.core import check_subscription_name as check_new_subscription_name
from pigeon.core.batch import ENTRY_HEADER_SIZE, decode_batch
from pigeon.core.errors import (
    EntryNotFound,
    InvalidArgument,
    NodeExists,
    SubscriptionBusy,
    SubscriptionNotFound,
)

if TYPE_CHECKING:
    from pigeon.broker._metrics import BrokerMonitor

__all__ = [
    "MAX_PEEK",
    "POSITIONS",
    "clear_backlog",
    "create_subscription",
    "delete_subscription",
    "list_subscriptions",
    "peek",
    "reset_cursor",
    "skip",
    "subscription_stats",
]

log = logging.getLogger(__name__)

MAX_PEEK = 1000
POSITIONS = ("earliest", "latest")


# ---------------------------------------------------------------------- subscriptions


async def _persistent_topic(service: BrokerService, name: TopicName) -> Topic:
    topic: Topic = (await open_existing_topic(service, name)).as_persistent()
    return topic


async def _subscription(topic: Any, sub_name: str) -> Any:
    check_subscription_name(sub_name)
    return await topic.find_subscription(sub_name)


async def list_subscriptions(service: BrokerService, name: TopicName) -> list[str]:
    found: set[str] = set()
    for t in await topic_targets(service, name):
        found.update(await subscription_names(service, t))
    return sorted(found)


async def subscription_stats(
    service: BrokerService, monitor: BrokerMonitor | None, name: TopicName, sub_name: str
) -> dict[str, Any]:
    stats = await topic_stats(service, monitor, name)
    check_subscription_name(sub_name)
    sub = stats["subscriptions"].get(sub_name)
    if sub is None:
        raise SubscriptionNotFound(f"subscription {sub_name!r} does not exist on {name}")
    return {"topic": name.full, **sub}


async def _start_offset(topic: Topic, position: str) -> tuple[str, int]:
    """(initial position, start offset) for a new subscription."""
    if position in POSITIONS:
        return position, -1
    ledger = topic.ledger
    if ":" in position:
        seg, entry, index = parse_message_id(position)
        if ledger.index_of_segment(seg) is None:
            raise EntryNotFound(f"no message {position} in {topic.name}")
        try:
            found = await ledger.read_one((seg, entry))
        except EntryNotFound:
            raise EntryNotFound(f"no message {position} in {topic.name}") from None
        return "latest", min(
            found.first_offset + min(index, found.num_messages - 1), ledger.next_offset
        )
    try:
        offset = int(position)
    except ValueError:
        raise InvalidArgument(
            f"position must be earliest, latest, an offset or a message id, got {position!r}"
        ) from None
    if offset < 0:
        raise InvalidArgument(f"offset must not be negative, got {offset}")
    return "latest", min(max(offset, ledger.first_offset), ledger.next_offset)


async def create_subscription(
    service: BrokerService, name: TopicName, sub_name: str, position: str
) -> dict[str, Any]:
    """A durable subscription at ``position``: earliest, latest, an offset or a message id
    (a new name follows the rule of :func:`pigeon.core.check_subscription_name`)."""
    check_new_subscription_name(sub_name)
    targets = await topic_targets(service, name)
    if len(targets) > 1 and position not in POSITIONS:
        raise InvalidArgument(
            "a partitioned topic's subscription starts at earliest or latest; "
            "reset each partition afterwards for offsets or message ids"
        )
    topics = [await _persistent_topic(service, t) for t in targets]
    for topic in topics:
        if await topic.has_subscription(sub_name):
            raise NodeExists(f"subscription {sub_name!r} already exists on {topic.name}")
    for topic in topics:
        initial, start = await _start_offset(topic, position)
        await topic.subscription(sub_name, "exclusive", initial, durable=True, start_offset=start)
    log.info("subscription created topic=%s sub=%s position=%s", name, sub_name, position)
    return await subscription_stats(service, None, name, sub_name)


async def delete_subscription(
    service: BrokerService, name: TopicName, sub_name: str, *, force: bool
) -> None:
    check_subscription_name(sub_name)
    found = []
    for t in await topic_targets(service, name):
        topic = await service.get_topic(t)
        try:
            found.append((topic, await _subscription(topic, sub_name)))
        except SubscriptionNotFound:
            continue
    if not found:
        raise SubscriptionNotFound(f"subscription {sub_name!r} does not exist on {name}")
    if not force and any(sub.consumers for _t, sub in found):
        raise SubscriptionBusy(f"subscription {sub_name!r} has connected consumers; use force")
    for topic, sub in found:
        detach = functools.partial(
            disconnect, service, topic, "subscription deleted", subscription=sub
        )
        await topic.delete_subscription(sub, detach)
    log.info("subscription deleted topic=%s sub=%s", name, sub_name)


async def _cursor_state(topic: Topic, sub: Any) -> dict[str, Any]:
    return {
        "topic": topic.name.full,
        "subscription": sub.name,
        "mark_delete_offset": sub.cursor.mark_delete,
        "backlog": sub.backlog(),
    }


async def reset_cursor(
    service: BrokerService,
    name: TopicName,
    sub_name: str,
    *,
    offset: int | None = None,
    message_id: str | None = None,
    timestamp: int | None = None,
) -> list[dict[str, Any]]:
    """Move the cursor; its consumers are detached so they drop what they prefetched."""
    given = [v for v in (offset, message_id, timestamp) if v is not None]
    if len(given) != 1:
        raise InvalidArgument("give exactly one of offset, message_id, timestamp")
    targets = await topic_targets(service, name)
    if len(targets) > 1 and timestamp is None:
        raise InvalidArgument(
            "reset a partitioned topic by timestamp, or reset one partition by offset or message id"
        )
    subs = []
    for t in targets:
        topic = await _persistent_topic(service, t)
        subs.append((topic, await _subscription(topic, sub_name)))
    position = None
    if message_id is not None:
        seg, entry, index = parse_message_id(message_id)
        ledger = subs[0][0].ledger
        if ledger.index_of_segment(seg) is None:
            raise EntryNotFound(f"no message {message_id} in {name}: no such segment (any more)")
        try:
            await ledger.read_one((seg, entry))
        except EntryNotFound:
            raise EntryNotFound(f"no message {message_id} in {name}") from None
        position = ((seg, entry), index)
    out = []
    for topic, sub in subs:
        if offset is not None:
            ledger = topic.ledger
            await sub.seek_offset(min(max(offset, ledger.first_offset), ledger.next_offset))
        elif position is not None:
            await sub.seek_position(*position)
        else:
            assert timestamp is not None
            await sub.seek_time(timestamp)
        # Right after the seek (no checkpoint in between): the consumers drop what they
        # prefetched from the old position when they re-attach.
        disconnect(service, topic, "cursor reset", subscription=sub)
        await sub.flush()
        out.append(await _cursor_state(topic, sub))
    log.info(
        "cursor reset topic=%s sub=%s offset=%s message_id=%s timestamp=%s",
        name,
        sub_name,
        offset,
        message_id,
        timestamp,
    )
    return out


def _skip_target(sub: Any, count: int) -> int:
    """The offset below which exactly ``count`` more unacknowledged messages lie."""
    cursor = sub.cursor
    end: int = sub.ledger.next_offset
    o: int = cursor.mark_delete
    remaining = count
    for start, stop in cursor.acked:
        gap = max(0, min(start, end) - o)
        if gap >= remaining:
            return o + remaining
        remaining -= gap
        o = max(o, stop)
    return min(o + remaining, end)


async def skip(
    service: BrokerService, name: TopicName, sub_name: str, count: int | None
) -> dict[str, Any]:
    """Acknowledge the next ``count`` unacknowledged messages (all with None)."""
    if count is not None and count < 0:
        raise InvalidArgument("count must not be negative")
    skipped = 0
    for t in await topic_targets(service, name):
        topic = await _persistent_topic(service, t)
        sub = await _subscription(topic, sub_name)
        before = sub.backlog()
        target = topic.ledger.next_offset if count is None else _skip_target(sub, count)
        if target > sub.cursor.mark_delete:
            sub.expire_before(target)
            await sub.flush()
        skipped += before - sub.backlog()
    log.info("messages skipped topic=%s sub=%s count=%s skipped=%s", name, sub_name, count, skipped)
    return {"topic": name.full, "subscription": sub_name, "skipped": skipped}


async def clear_backlog(service: BrokerService, name: TopicName, sub_name: str) -> dict[str, Any]:
    return await skip(service, name, sub_name, None)


def _text_or_base64(data: bytes | None) -> tuple[str | None, str]:
    if data is None:
        return None, "utf-8"
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"


async def peek(
    service: BrokerService, name: TopicName, sub_name: str, count: int
) -> list[dict[str, Any]]:
    """The next ``count`` unacknowledged messages of a subscription, without consuming."""
    if not 1 <= count <= MAX_PEEK:
        raise InvalidArgument(f"count must be between 1 and {MAX_PEEK}")
    out: list[dict[str, Any]] = []
    for t in await topic_targets(service, name):
        topic = await _persistent_topic(service, t)
        sub = await _subscription(topic, sub_name)
        await _peek_one(service, topic, sub, count - len(out), out)
        if len(out) >= count:
            break
    return out


async def _peek_one(
    service: BrokerService, topic: Topic, sub: Any, count: int, out: list[dict[str, Any]]
) -> None:
    ledger = topic.ledger
    cursor = sub.cursor
    pos: tuple[int, int] | None = await ledger.position_for_offset(cursor.mark_delete)
    taken = 0
    while pos is not None and taken < count:
        entries = await ledger.read(pos, max_entries=64)
        if not entries:
            return
        for entry in entries:
            first, n = entry.first_offset, entry.num_messages
            if cursor.all_acked(first, n):
                continue
            batch = decode_batch(memoryview(entry.data)[ENTRY_HEADER_SIZE:], service.codecs)
            header = batch.header
            for i in range(n):
                offset = first + i
                if cursor.is_acked(offset):
                    continue
                raw = batch.value(i)
                value, value_encoding = _text_or_base64(raw)
                key, key_encoding = _text_or_base64(batch.key(i))
                out.append(
                    {
                        "topic": topic.name.full,
                        "message_id": f"{entry.segment_id}:{entry.entry_id}:{i}",
                        "offset": offset,
                        "publish_time": entry.publish_time,
                        "event_time": batch.event_time(i) or None,
                        "producer_name": header.producer_name,
                        "sequence_id": batch.sequence_id(i),
                        "key": key,
                        "key_encoding": key_encoding,
                        "properties": batch.properties(i),
                        "value": value,
                        "value_encoding": value_encoding,
                        "size": len(raw),
                        "redelivery_count": sub.redeliveries.get(entry.position, 0),
                    }
                )
                taken += 1
                if taken >= count:
                    return
        pos = ledger.next_position(entries[-1].position)

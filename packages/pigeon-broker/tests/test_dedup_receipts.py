"""A duplicate's receipt names the stored original, even when the original was stored
before the de-duplication snapshot the broker recovered from (issue #12: such resends
were answered with position (-1, -1))."""

from __future__ import annotations

import trio
from standalone_support import batch_of, raw_sends

from pigeon.broker._admin_ops import unload_topic
from pigeon.core import TopicName

TOPIC = "persistent://public/default/dedup-receipts"
PRODUCER = "receipts-producer"


def _batch(sequence_id: int, n: int) -> bytes:
    return batch_of([f"m{sequence_id + i}".encode() for i in range(n)], PRODUCER, sequence_id)


async def _sends(url: str, batches: list[tuple[int, int]]) -> list[dict]:
    """Send (first sequence id, count) batches as producer PRODUCER; their receipts."""
    return await raw_sends(url, TOPIC, PRODUCER, [(seq, n, _batch(seq, n)) for seq, n in batches])


def _where(receipt: dict) -> tuple[int, int, int]:
    return (receipt["segmentId"], receipt["entryId"], receipt["firstOffset"])


async def test_a_duplicate_of_a_batch_stored_before_the_snapshot_names_its_position(
    pigeon_standalone, autojump_clock
):
    service = pigeon_standalone.service
    name = TopicName.parse(TOPIC)
    url = pigeon_standalone.url
    await _sends(url, [])  # the topic exists: make it roll over every 8 entries
    topic = service.topics[name.full]
    topic.ledger.config.max_entries_per_segment = 8
    early = await _sends(url, [(i * 3, 3) for i in range(40)])  # sequence ids 0..119
    assert len({r["segmentId"] for r in early}) >= 5
    await topic.snapshot_dedup()  # covers every batch so far
    late = await _sends(url, [(120 + i * 3, 3) for i in range(5)])  # replayed on reload
    assert await unload_topic(service, name) == [name.full]
    again = await _sends(url, [(0, 3), (57, 3), (117, 3), (123, 3)])
    assert all(r["duplicate"] for r in again)
    assert [_where(r) for r in again] == [
        _where(early[0]),
        _where(early[19]),
        _where(early[39]),
        _where(late[1]),
    ]
    # a resend that starts inside a stored batch is named at its own first message
    (inside,) = await _sends(url, [(58, 2)])
    seg, entry, offset = _where(early[19])
    assert _where(inside) == (seg, entry, offset + 1)


async def test_a_duplicate_whose_original_is_slow_to_find_is_refused_then_named(
    pigeon_standalone, autojump_clock
):
    """Naming the original reads the log; when that is slow (bookies paused), the
    duplicate is refused with a retriable error after DEDUP_LOOKUP_WAIT_S rather than
    holding back every later send of the producer (the client completes in order), and
    rather than answered without the position it has (the 10-minute runs answered about
    a thousand so).  The search goes on, and the resend is named."""
    from pigeon.broker._publish import DEDUP_LOOKUP_WAIT_S
    from pigeon.core.errors import ServiceUnavailable

    service = pigeon_standalone.service
    name = TopicName.parse(TOPIC)
    url = pigeon_standalone.url
    first = await _sends(url, [(i * 3, 3) for i in range(10)])
    assert await unload_topic(service, name) == [name.full]
    await _sends(url, [(30, 3)])  # the topic is loaded again
    ledger = service.topics[name.full].ledger
    real_read = ledger.read

    async def slow_read(*args, **kw):  # type: ignore[no-untyped-def]
        await trio.sleep(60)
        return await real_read(*args, **kw)

    ledger.read = slow_read
    started = trio.current_time()
    refused: list[BaseException] = []
    try:
        await _sends(url, [(3, 3)])
    except* ServiceUnavailable as group:
        refused = list(group.exceptions)
    assert len(refused) == 1 and "still being looked for" in str(refused[0])
    assert isinstance(refused[0], ServiceUnavailable) and refused[0].retriable
    assert trio.current_time() - started <= DEDUP_LOOKUP_WAIT_S + 1
    await trio.sleep(61)  # the search read its chunk meanwhile
    ledger.read = real_read
    (again,) = await _sends(url, [(3, 3)])
    assert again["duplicate"] and _where(again) == _where(first[1])

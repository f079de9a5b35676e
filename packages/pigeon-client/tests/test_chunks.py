"""Chunk reassembly and the chunking options, without I/O (pigeon.client._chunks)."""

from __future__ import annotations

import pickle

import pytest

from pigeon.client import ChunkMessageId, MessageId
from pigeon.client._chunks import ChunkAssembler, ChunkReceipts
from pigeon.client._message import Message
from pigeon.client._options import ConsumerOptions, ProducerOptions, ReaderOptions
from pigeon.core.batch import BatchHeader
from pigeon.core.errors import InvalidArgument

SOURCE = object()


def chunk(
    uuid: str, i: int, n: int, offset: int, value: bytes = b""
) -> tuple[Message, BatchHeader]:
    data = value or bytes([65 + i]) * 3
    msg = Message(data, "k", {}, 0, 0, 1, offset, 0, -1, offset, 0, "t", data)
    header = BatchHeader(*([0] * 19), chunk_uuid=uuid, chunk_id=i, num_chunks=n)  # type: ignore[arg-type]
    return msg, header


def feed(a: ChunkAssembler, *chunks: tuple[Message, BatchHeader]) -> list[Message]:
    out = []
    for msg, header in chunks:
        whole = a.add(msg, header, SOURCE)
        if whole is not None:
            out.append(whole)
    return out


def test_chunks_in_order_make_one_message_whose_id_names_every_chunk():
    a = ChunkAssembler()
    (whole,) = feed(a, chunk("u", 0, 3, 10), chunk("u", 1, 3, 11), chunk("u", 2, 3, 12))
    assert whole.value == b"AAABBBCCC" and whole.offset == 12
    mid = whole.message_id
    assert isinstance(mid, ChunkMessageId)
    assert [c.offset for c in mid.chunk_ids] == [10, 11, 12]
    assert mid.first_chunk_message_id == MessageId(1, 10, 0, -1)
    assert not a.pending


def test_interleaved_messages_and_a_restart_from_the_first_chunk():
    a = ChunkAssembler()
    got = feed(
        a,
        chunk("x", 0, 2, 1),
        chunk("y", 0, 2, 2),
        chunk("x", 0, 2, 3),  # x redelivered from its start
        chunk("y", 1, 2, 4),
        chunk("x", 1, 2, 5),
    )
    assert [[c.offset for c in m.message_id.chunk_ids] for m in got] == [[2, 4], [3, 5]]


def test_a_chunk_without_its_start_never_completes_and_expires_acked():
    a = ChunkAssembler(expire_time=60)
    a.now = 100.0
    assert feed(a, chunk("u", 1, 3, 11), chunk("u", 2, 3, 12)) == []
    a.expire(159.0)
    assert a.pending
    a.expire(160.0)
    assert not a.pending
    ((chunks, ack),) = a.take_dropped()
    assert ack and [c.offset for c in chunks] == [11, 12]
    assert all(c.value == b"" for c in chunks), "dropped chunks keep no bytes"


def test_too_many_incomplete_messages_drop_the_oldest():
    for auto_ack in (True, False):
        a = ChunkAssembler(max_pending=2, auto_ack_oldest=auto_ack)
        feed(a, chunk("a", 0, 2, 1), chunk("b", 0, 2, 2), chunk("c", 0, 2, 3))
        assert list(a.pending) == [("t", "b"), ("t", "c")]
        ((chunks, ack),) = a.take_dropped()
        assert ack is auto_ack and [c.offset for c in chunks] == [1]


def test_reset_forgets_a_source_and_says_where_its_chunks_began():
    a = ChunkAssembler()
    feed(a, chunk("a", 0, 3, 7), chunk("a", 1, 3, 8))
    assert a.reset(SOURCE) == 7 and not a.pending
    assert a.reset(SOURCE) is None


def test_receipts_of_the_chunks_give_a_chunk_message_id():
    seen = []
    r = ChunkReceipts()
    last = r.last(lambda receipt, error: seen.append((receipt, error)))
    r.part(0)((1, 5, 50, False), None)
    r.part(1)((1, 6, 51, False), None)
    last((1, 7, 52, False), None)
    assert seen == [((1, 7, 52, False, (1, 5, 50, False)), None)]
    failed = ChunkReceipts()
    boom = InvalidArgument("boom")
    failed.part(0)(None, boom)
    failed.last(lambda receipt, error: seen.append((receipt, error)))((1, 8, 53, False), None)
    assert seen[-1] == (None, boom), "a message with a failed chunk fails"


def test_chunk_message_id_serializes_and_pickles():
    mid = ChunkMessageId(MessageId(1, 2, 0, 3, 20), MessageId(1, 9, 0, 3, 27))
    back = MessageId.deserialize(mid.serialize())
    assert isinstance(back, ChunkMessageId) and back == mid
    assert back.first_chunk_message_id.offset == 20 and back.offset == 27
    assert pickle.loads(pickle.dumps(mid)).first_chunk_message_id == mid.first_chunk_message_id
    assert MessageId.deserialize(MessageId(1, 2, 0, 3, 4).serialize()) == MessageId(1, 2, 0, 3)


def test_options_are_checked_when_built():
    with pytest.raises(InvalidArgument, match="batching_enabled=False"):
        ProducerOptions("t", chunking_enabled=True)
    with pytest.raises(InvalidArgument, match="chunk_max_message_size"):
        ProducerOptions("t", chunk_max_message_size=-1)
    with pytest.raises(InvalidArgument, match="max_pending_chunked_message"):
        ConsumerOptions("t", "s", max_pending_chunked_message=0)
    with pytest.raises(InvalidArgument, match="expire_time_of_incomplete_chunked_message"):
        ReaderOptions("t", expire_time_of_incomplete_chunked_message=-1)
    first, last = MessageId(1, 2, 0, -1, 20), MessageId(1, 9, 0, -1, 27)
    start = ChunkMessageId(first, last)
    assert ReaderOptions("t", start, start_message_id_inclusive=True).start_position() == (
        "earliest",
        20,
    )
    assert ReaderOptions("t", start).start_position() == ("earliest", 28)


def test_a_duplicate_chunk_is_acknowledged_and_the_message_still_completes():
    """A resend stored twice (a namespace without de-duplication): chunks 0, 1, 1, 2."""
    a = ChunkAssembler()
    got = feed(
        a, chunk("u", 0, 3, 10), chunk("u", 1, 3, 11), chunk("u", 1, 3, 12), chunk("u", 2, 3, 13)
    )
    assert [[c.offset for c in m.message_id.chunk_ids] for m in got] == [[10, 11, 13]]
    ((chunks, ack),) = a.take_dropped()
    assert ack and [c.offset for c in chunks] == [12]
    feed(a, chunk("v", 0, 2, 20), chunk("v", 0, 2, 20))  # the same one again: kept
    assert a.take_dropped() == [] and len(a.pending[("t", "v")].chunks) == 1


def test_the_rest_of_a_dropped_message_comes_again_after_its_start():
    """The oldest incomplete message was dropped (nacked) while later chunks of it kept
    coming: when its first chunk comes again, the chunks held without their start are
    nacked too (they come again after it), so the message completes."""
    a = ChunkAssembler(max_pending=1)
    feed(a, chunk("x", 0, 3, 1), chunk("y", 0, 2, 2))  # y drops x (nacked: 1 comes again)
    ((dropped, ack),) = a.take_dropped()
    assert not ack and [c.offset for c in dropped] == [1]
    assert feed(a, chunk("y", 1, 2, 3))[0].value == b"AAABBB"
    feed(a, chunk("x", 1, 3, 4), chunk("x", 2, 3, 5))  # held: their start was dropped
    assert feed(a, chunk("x", 0, 3, 1)) == []  # redelivered
    ((dropped, ack),) = a.take_dropped()
    assert not ack and [c.offset for c in dropped] == [4, 5]
    got = feed(a, chunk("x", 1, 3, 4), chunk("x", 2, 3, 5))  # redelivered too
    assert [[c.offset for c in m.message_id.chunk_ids] for m in got] == [[1, 4, 5]]


def test_a_redelivery_from_the_first_chunk_forgets_what_comes_again():
    a = ChunkAssembler()
    feed(a, chunk("u", 0, 3, 10), chunk("u", 1, 3, 11))
    got = feed(a, chunk("u", 0, 3, 10), chunk("u", 1, 3, 11), chunk("u", 2, 3, 12))
    assert [[c.offset for c in m.message_id.chunk_ids] for m in got] == [[10, 11, 12]]
    assert a.take_dropped() == []


def test_hold_starts_the_clocks_of_incomplete_messages_again():
    a = ChunkAssembler(expire_time=60)
    a.now = 100.0
    feed(a, chunk("u", 0, 3, 10))
    a.hold(150.0)
    a.expire(200.0)
    assert a.pending and not a.dropped
    a.expire(210.0)
    assert not a.pending and a.take_dropped()[0][1]

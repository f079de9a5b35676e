"""Framing without I/O: FrameDecoder, encode_frame, build_message, capnp_message_size."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pigeon.core._framing import (
    DEFAULT_MAX_FRAME_SIZE,
    FrameDecoder,
    build_message,
    capnp_message_size,
    consume_buffers,
    encode_frame,
)
from pigeon.core._schema import BookieFrame, BrokerFrame
from pigeon.core.errors import CorruptFrame, FrameTooLarge


def _frame_bytes(message: bytes, payload: bytes | None = None) -> bytes:
    return b"".join(bytes(part) for part in encode_frame(message, payload))


def _split(frame: bytes) -> tuple[bytes, bytes]:
    size = capnp_message_size(frame)
    return frame[:size], frame[size:]


def _lookup(request_id: int, topic: str) -> bytes:
    return build_message(BrokerFrame, request_id, "lookup", {"topic": topic})


# ------------------------------------------------------------------ build_message


def test_build_message_round_trips_through_capnp() -> None:
    data = build_message(
        BrokerFrame,
        42,
        "ack",
        {
            "consumerId": 7,
            "ackType": "cumulative",
            "positions": [
                {"segmentId": 1, "entryId": 2, "batchIndex": -1},
                {"segmentId": 3, "entryId": 4, "batchIndex": 5},
            ],
        },
    )
    with BrokerFrame.from_bytes(data) as msg:
        assert msg.requestId == 42
        assert msg.which() == "ack"
        assert msg.ack.consumerId == 7
        assert msg.ack.ackType == "cumulative"
        assert [(p.segmentId, p.entryId, p.batchIndex) for p in msg.ack.positions] == [
            (1, 2, -1),
            (3, 4, 5),
        ]


@pytest.mark.parametrize(
    ("kind", "fields"),
    [("ok", None), ("ping", None), ("subscribed", {}), ("connect", {"protocolVersion": 1})],
)
def test_build_message_void_empty_and_plain_members(kind: str, fields: dict | None) -> None:
    data = build_message(BrokerFrame, 1, kind, fields)
    assert capnp_message_size(data) == len(data)
    with BrokerFrame.from_bytes(data) as msg:
        assert msg.which() == kind


def test_capnp_message_size_is_the_whole_message() -> None:
    data = _lookup(1, "persistent://public/default/" + "x" * 300)
    assert capnp_message_size(data) == len(data)
    # trailing payload bytes are not part of the message
    assert capnp_message_size(data + b"\x01" * 37) == len(data)


def test_capnp_message_size_multi_segment_table() -> None:
    # two segments: table is u32 count-1, two u32 sizes, 4 bytes of padding
    seg0, seg1 = b"\x00" * 16, b"\x00" * 8
    message = struct.pack("<III", 1, 2, 1) + b"\x00" * 4 + seg0 + seg1
    assert capnp_message_size(message + b"payload") == len(message)


# ------------------------------------------------------------------ encode_frame


def test_encode_frame_without_payload_is_one_buffer() -> None:
    msg = _lookup(1, "t")
    parts = encode_frame(msg)
    assert len(parts) == 1
    assert parts[0] == struct.pack("<I", len(msg)) + msg
    assert encode_frame(msg, b"") == parts


def test_encode_frame_payload_is_not_copied() -> None:
    msg = _lookup(1, "t")
    payload = memoryview(b"p" * 1000)
    parts = encode_frame(msg, payload)
    assert parts[0] == struct.pack("<I", len(msg) + 1000) + msg
    assert parts[1] is payload


# ------------------------------------------------------------------ FrameDecoder

messages = st.builds(
    _lookup,
    st.integers(min_value=0, max_value=2**64 - 1),
    st.text(max_size=200),
)
payloads = st.one_of(st.just(b""), st.binary(max_size=3000))


@settings(max_examples=150, deadline=None)
@given(
    frames=st.lists(st.tuples(messages, payloads), min_size=1, max_size=12),
    data=st.data(),
)
def test_arbitrary_chunking_yields_identical_frames(
    frames: list[tuple[bytes, bytes]], data: st.DataObject
) -> None:
    stream = b"".join(_frame_bytes(m, p) for m, p in frames)
    cuts = sorted(data.draw(st.lists(st.integers(min_value=0, max_value=len(stream)), max_size=40)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    decoder = FrameDecoder()
    got: list[bytes] = []
    for chunk in chunks:
        decoder.feed(chunk)
        got.extend(decoder.frames())
    assert [_split(f) for f in got] == [(m, p) for m, p in frames]
    assert decoder.at_frame_boundary()
    assert decoder.buffered == 0


def test_one_byte_at_a_time() -> None:
    frames = [(_lookup(i, f"topic-{i}"), bytes([i]) * i) for i in range(20)]
    stream = b"".join(_frame_bytes(m, p) for m, p in frames)
    decoder = FrameDecoder()
    got = []
    for i in range(len(stream)):
        decoder.feed(stream[i : i + 1])
        got.extend(decoder.frames())
        # a frame only comes out once its last byte arrived
        assert len(b"".join(_frame_bytes(*f) for f in frames[: len(got)])) <= i + 1
    assert [_split(f) for f in got] == frames


def test_payload_after_the_message_is_recovered_exactly() -> None:
    msg = build_message(BookieFrame, 9, "addEntry", {"segmentId": 1, "entryId": 2, "lac": 1})
    payload = bytes(range(256)) * 300  # binary, larger than one receive, not 8-aligned + 3
    payload += b"end"
    decoder = FrameDecoder()
    decoder.feed(_frame_bytes(msg, payload))
    (frame,) = decoder.frames()
    size = capnp_message_size(frame)
    assert frame[:size] == msg
    assert frame[size:] == payload
    with BookieFrame.from_bytes(frame[:size]) as m:
        assert (m.requestId, m.addEntry.entryId) == (9, 2)


def test_incomplete_frame_waits_for_more() -> None:
    stream = _frame_bytes(_lookup(1, "t"), b"payload")
    decoder = FrameDecoder()
    decoder.feed(stream[:3])  # not even the length prefix
    assert list(decoder.frames()) == []
    decoder.feed(stream[3:-1])
    assert list(decoder.frames()) == []
    assert not decoder.at_frame_boundary()
    assert decoder.buffered == len(stream) - 1
    decoder.feed(stream[-1:])
    assert len(list(decoder.frames())) == 1
    assert decoder.at_frame_boundary()


def test_frame_too_large_raised_on_the_prefix_before_the_body() -> None:
    decoder = FrameDecoder(max_frame_size=1000)
    decoder.feed(struct.pack("<I", 1001))  # only the prefix: no body bytes at all
    with pytest.raises(FrameTooLarge, match="1001"):
        list(decoder.frames())
    # nothing of the announced body was needed (or buffered) to decide
    assert decoder.buffered == 4


def test_frame_at_max_size_is_accepted() -> None:
    msg = _lookup(1, "t")
    payload = b"x" * (1000 - len(msg))
    decoder = FrameDecoder(max_frame_size=1000)
    decoder.feed(_frame_bytes(msg, payload))
    (frame,) = decoder.frames()
    assert len(frame) == 1000


def test_default_max_frame_size_fits_a_max_message() -> None:
    decoder = FrameDecoder()
    assert decoder.max_frame_size == DEFAULT_MAX_FRAME_SIZE
    decoder.feed(struct.pack("<I", 5 * 1024 * 1024 + 1024))
    assert list(decoder.frames()) == []  # waits for the body: not too large
    decoder2 = FrameDecoder()
    decoder2.feed(struct.pack("<I", 0xFFFFFFFF))
    with pytest.raises(FrameTooLarge):
        list(decoder2.frames())


def test_oversize_frame_after_good_frames() -> None:
    decoder = FrameDecoder(max_frame_size=500)
    good = _frame_bytes(_lookup(1, "t"))
    decoder.feed(good + good + struct.pack("<I", 10_000))
    it = decoder.frames()
    assert next(it) == good[4:]
    assert next(it) == good[4:]
    with pytest.raises(FrameTooLarge):
        next(it)


@pytest.mark.parametrize("length", [0, 1, 7])
def test_too_short_frame_is_corrupt(length: int) -> None:
    decoder = FrameDecoder()
    decoder.feed(struct.pack("<I", length) + b"\x00" * length)
    with pytest.raises(CorruptFrame, match="too short"):
        list(decoder.frames())


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"\x00" * 7, "too short"),
        (struct.pack("<II", 0xFFFFFFFF, 0), "segment count"),
        (struct.pack("<II", 511, 0), "truncated"),  # 512 segments announced, 4 bytes of table
        (struct.pack("<II", 0, 1000), "longer than its frame"),  # 1000 words, 0 present
        (struct.pack("<II", 0, 2) + b"\x00" * 8, "longer than its frame"),
    ],
)
def test_garbage_segment_table_is_corrupt(body: bytes, match: str) -> None:
    with pytest.raises(CorruptFrame, match=match):
        capnp_message_size(body)


@given(st.binary(max_size=64))
def test_capnp_message_size_never_raises_anything_but_corrupt_frame(body: bytes) -> None:
    try:
        size = capnp_message_size(body)
    except CorruptFrame:
        return
    assert 8 <= size <= len(body)
    assert size % 8 == 0


def test_many_frames_do_not_corrupt_decoder_state() -> None:
    """Thousands of frames through one decoder, in uneven chunks: the buffer is
    compacted along the way and every frame comes out intact and in order."""
    decoder = FrameDecoder()
    sent: list[tuple[bytes, bytes]] = []
    got: list[bytes] = []
    pending = b""
    chunk_sizes = [1, 7, 100, 4096, 13, 65536, 3]
    n = 0
    for i in range(5000):
        m, p = _lookup(i + 1, f"t{i}"), (i % 251).to_bytes(1, "little") * (i % 97)
        sent.append((m, p))
        pending += _frame_bytes(m, p)
        size = chunk_sizes[n % len(chunk_sizes)]
        while len(pending) >= size:
            decoder.feed(pending[:size])
            pending = pending[size:]
            got.extend(decoder.frames())
            n += 1
            size = chunk_sizes[n % len(chunk_sizes)]
    decoder.feed(pending)
    got.extend(decoder.frames())
    assert len(got) == len(sent)
    assert [_split(f) for f in got] == sent
    assert decoder.at_frame_boundary()
    # compaction keeps the buffer small: it does not hold every byte ever received
    assert len(decoder._buf) < 200_000


def test_feed_between_partial_iterations() -> None:
    """Feeding while a frames() iterator is suspended must not lose or repeat frames."""
    frames = [_frame_bytes(_lookup(i, "t" * i)) for i in range(1, 50)]
    decoder = FrameDecoder()
    decoder.feed(b"".join(frames[:25]))
    got = []
    it = decoder.frames()
    for _ in range(20):
        got.append(next(it))
    decoder.feed(b"".join(frames[25:]))  # may compact the buffer
    got.extend(it)
    got.extend(decoder.frames())
    assert got == [f[4:] for f in frames]


def test_large_frame_is_assembled_once_in_a_buffer_of_its_own() -> None:
    """A 4 MiB frame arriving in 64 KiB chunks costs the frame's bytes once: chunks are
    copied straight into a buffer of its exact size, not appended to a growing buffer
    and then sliced out (and copied again) when complete."""
    msg = build_message(BookieFrame, 9, "addEntry", {"segmentId": 1, "entryId": 2, "lac": 1})
    payload = bytes(range(256)) * (16 * 1024)
    stream = _frame_bytes(msg, payload)
    chunks = [stream[i : i + 65536] for i in range(0, len(stream), 65536)]
    decoder = FrameDecoder()
    got = []
    tracemalloc.start()
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            got.extend(decoder.frames())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    (frame,) = got
    assert _split(frame) == (msg, payload)
    assert peak < len(stream) + 512 * 1024, peak  # the frame, plus small change


def test_frames_are_independent_of_later_input() -> None:
    """A frame (and a view of it) is never reused by the decoder: later input, small or
    large, whole or cut, leaves the frames already yielded as they were."""
    big = _frame_bytes(_lookup(1, "t"), b"b" * 100_000)
    small = _frame_bytes(_lookup(2, "t"), b"s" * 10)
    stream = big + small + big + small
    decoder = FrameDecoder()
    views = []
    for i in range(0, len(stream), 30_000):
        decoder.feed(stream[i : i + 30_000])
        views.extend(memoryview(f) for f in decoder.frames())
    assert [bytes(v) for v in views] == [big[4:], small[4:], big[4:], small[4:]]


@given(
    sizes=st.lists(st.integers(min_value=0, max_value=50), max_size=8),
    data=st.data(),
)
def test_consume_buffers_leaves_exactly_the_unsent_bytes(
    sizes: list[int], data: st.DataObject
) -> None:
    buffers = [bytes([i]) * size for i, size in enumerate(sizes)]
    whole = b"".join(buffers)
    sent = data.draw(st.integers(min_value=0, max_value=len(whole)))
    rest = consume_buffers(list(buffers), sent)
    assert b"".join(bytes(b) for b in rest) == whole[sent:]
    # untouched buffers are the same objects (no copy); at most the first is a view
    assert all(
        a is b for a, b in zip(rest[1:], buffers[len(buffers) - len(rest) + 1 :], strict=True)
    )


def test_a_large_frame_can_be_received_straight_into_its_buffer() -> None:
    """A reader fills the rest of a large frame through ``assembly_space`` instead of
    feeding chunks: the same frame comes out, and the input after it frames as usual."""
    msg = build_message(BookieFrame, 9, "addEntry", {"segmentId": 1, "entryId": 2, "lac": 1})
    payload = bytes(range(256)) * 1024
    big = _frame_bytes(msg, payload)
    small = _frame_bytes(_lookup(3, "t"), b"s")
    decoder = FrameDecoder()
    assert decoder.assembly_space() is None
    decoder.feed(big[:1000])
    assert list(decoder.frames()) == []
    pos = 1000
    while (space := decoder.assembly_space()) is not None and len(space):
        with space:
            n = min(len(space), 50_000)
            space[:n] = big[pos : pos + n]
        decoder.assembled(n)
        pos += n
    assert pos == len(big)
    decoder.feed(small)
    frames = list(decoder.frames())
    assert [_split(f) for f in frames[:1]] == [(msg, payload)]
    assert frames[1] == small[4:]
    assert decoder.assembly_space() is None

"""The fixed-layout Cap'n Proto codec (:mod:`pigeon.core._capnp_fast`) against pycapnp.

Round trips both ways for every struct the codec has a layout for (the frames of both
protocols and the entry's ``BatchHeader``): fast-built bytes decode in pycapnp to what
the fields say (and equal pycapnp's own bytes), pycapnp-built bytes decode fast to what
pycapnp reads.  Hostile bytes (bit flips, truncation, words overwritten, shrunk structs)
are either decoded exactly as pycapnp decodes them or left to pycapnp (``Unhandled``):
the fast path never accepts a body pycapnp refuses, so errors keep their texts.
"""

from __future__ import annotations

import logging
import struct
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from pigeon.core import _batch
from pigeon.core._batch import read_header
from pigeon.core._batch_encode import encode_batch
from pigeon.core._capnp_fast import DECODE_ERRORS, FrameCodec, StructCodec, struct_codec
from pigeon.core._codecs import NONE
from pigeon.core._framing import build_message, build_message_pycapnp, encode_frame
from pigeon.core._rpc import Connection, Request
from pigeon.core._schema import (
    FAST_KINDS,
    BookieFrame,
    BrokerFrame,
    body_checker,
    frame_codec,
)
from pigeon.core.errors import CorruptFrame, MalformedRequest

FRAMES = {"BrokerFrame": BrokerFrame, "BookieFrame": BookieFrame}
#: every union member of both frames, with the codec that covers all of them it can
ALL = {
    name: FrameCodec(frame, frame.schema.union_fields)  # not only FAST_KINDS: every layout
    for name, frame in FRAMES.items()
}
MEMBERS = sorted((name, kind) for name, codec in ALL.items() for kind in codec.kinds)

_INTS = {
    "int8": (-(2**7), 2**7 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint8": (0, 2**8 - 1),
    "uint16": (0, 2**16 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
}


def _value(slot_type: Any, field_schema: Any) -> st.SearchStrategy[Any]:
    kind = slot_type.which()
    if kind in _INTS:
        lo, hi = _INTS[kind]
        return st.one_of(st.sampled_from([lo, hi, 0, -1 if lo else 1]), st.integers(lo, hi))
    if kind == "bool":
        return st.booleans()
    if kind == "enum":
        return st.sampled_from(sorted(field_schema.enumerants))
    if kind == "text":
        return st.text(max_size=20)
    if kind == "data":
        return st.binary(max_size=20)
    if kind == "struct":
        return _fields(field_schema)
    if kind == "list":
        element = slot_type.list.elementType
        kinds = ("enum", "struct", "list")
        item = _value(element, field_schema.elementType if element.which() in kinds else None)
        return st.lists(item, max_size=4)
    raise AssertionError(f"no strategy for {kind}")


def _fields(schema: Any) -> st.SearchStrategy[dict[str, Any]]:
    """Some of the fields of a struct, in any order (the order pointers are allocated)."""
    values = {
        f.name: _value(f.slot.type, schema.fields[f.name].schema if _has_schema(f) else None)
        for f in schema.node.struct.fields
    }

    @st.composite
    def some(draw: Any) -> dict[str, Any]:
        names = draw(st.permutations(sorted(values)))
        keep = draw(st.integers(0, len(names)))
        return {name: draw(values[name]) for name in names[:keep]}

    return some()


def _has_schema(field: Any) -> bool:
    return field.slot.type.which() in ("enum", "struct", "list")


def _member_fields(frame: str, kind: str) -> st.SearchStrategy[dict[str, Any] | None]:
    field = FRAMES[frame].schema.fields[kind]
    if field.proto.slot.type.which() == "void":
        return st.none()
    return _fields(field.schema)


def _pycapnp_body(frame: str, message: bytes) -> tuple[int, str, Any]:
    """(requestId, kind, body as pycapnp's verbose to_dict) of a message."""
    with FRAMES[frame].from_bytes(message) as msg:
        kind = msg.which()
        body = getattr(msg, kind)
        return msg.requestId, kind, None if body is None else body.to_dict(verbose=True)


def _fast_body(frame: str, message: bytes, codec: FrameCodec | None = None) -> Any:
    decoded = (codec or ALL[frame]).decode(message)
    assert decoded is not None
    request_id, kind, body = decoded
    return request_id, kind, None if body is None else body.to_dict()


def _pycapnp_build(frame: str, request_id: int, kind: str, fields: Any) -> bytes:
    return build_message_pycapnp(FRAMES[frame], request_id, kind, fields)


@st.composite
def frames(draw: Any) -> tuple[str, int, str, Any]:
    frame, kind = draw(st.sampled_from(MEMBERS))
    return frame, draw(st.integers(0, 2**64 - 1)), kind, draw(_member_fields(frame, kind))


# ------------------------------------------------------------------ round trips


def test_every_per_entry_kind_is_covered() -> None:
    for frame, kinds in FAST_KINDS.items():
        assert frame_codec(FRAMES[frame]).kinds == frozenset(kinds)
    assert {"send", "sendReceipt", "message", "flow", "ack"} <= set(FAST_KINDS["BrokerFrame"])
    assert {"addEntry", "addResponse"} <= set(FAST_KINDS["BookieFrame"])
    # every member of both protocols but Seek (a union) has a layout
    assert [
        m for m in FRAMES["BrokerFrame"].schema.union_fields if m not in ALL["BrokerFrame"].kinds
    ] == ["seek"]
    assert set(FRAMES["BookieFrame"].schema.union_fields) == ALL["BookieFrame"].kinds


@settings(max_examples=400, deadline=None)
@given(frames())
def test_fast_encode_is_pycapnp_bytes(case: tuple[str, int, str, Any]) -> None:
    frame, request_id, kind, fields = case
    fast = ALL[frame].encode(request_id, kind, fields)
    slow = _pycapnp_build(frame, request_id, kind, fields)
    assert _pycapnp_body(frame, fast) == _pycapnp_body(frame, slow)
    if struct.unpack_from("<I", slow)[0] == 0:  # pycapnp used one segment: same bytes
        assert fast == slow


@settings(max_examples=400, deadline=None)
@given(frames())
def test_fast_decode_reads_what_pycapnp_reads(case: tuple[str, int, str, Any]) -> None:
    frame, request_id, kind, fields = case
    message = _pycapnp_build(frame, request_id, kind, fields)
    assert _fast_body(frame, message) == _pycapnp_body(frame, message)


@settings(max_examples=400, deadline=None)
@given(frames())
def test_direct_is_the_decode_of_the_encode(case: tuple[str, int, str, Any]) -> None:
    """An in-process link hands over FrameCodec.direct instead of encoding and decoding:
    the receiver must get exactly what it would have decoded, and the size counted must
    be the message's."""
    frame, request_id, kind, fields = case
    codec = ALL[frame]
    direct = codec.direct(request_id, kind, fields)
    assert direct is not None
    message = codec.encode(request_id, kind, fields)
    decoded = codec.decode(message)
    assert direct.fast == decoded
    assert len(direct) == len(message)
    body, read = direct.fast[2], decoded[2]  # the same types too (not True for 1)
    assert type(body) is type(read)
    if body is not None:
        assert [type(v) for v in body] == [type(v) for v in read]


def test_direct_refuses_what_the_encoder_refuses() -> None:
    codec = ALL["BookieFrame"]
    assert codec.direct(1, "addEntry", {"segmentId": 2**63}) is None  # not an Int64
    assert codec.direct(1, "addEntry", {"segmentId": "1"}) is None  # not an int
    assert codec.direct(1, "addEntry", {"noSuchField": 1}) is None
    assert codec.direct(1, "addEntry", {"recovery": "yes"}) is None  # not a bool
    assert codec.direct(1, "ok", {"x": 1}) is None  # fields for a Void member
    assert codec.direct(1, "seek", {}) is None  # a kind it does not take


@pytest.mark.parametrize(("frame", "kind"), MEMBERS)
def test_defaults_of_an_empty_body(frame: str, kind: str) -> None:
    void = FRAMES[frame].schema.fields[kind].proto.slot.type.which() == "void"
    message = ALL[frame].encode(1, kind, None if void else {})
    assert message == _pycapnp_build(frame, 1, kind, None if void else {})
    assert _fast_body(frame, message) == _pycapnp_body(frame, message)


def test_non_zero_defaults_are_stored_xored() -> None:
    codec = ALL["BrokerFrame"]
    unset = codec.encode(1, "createProducer", {"producerId": 1})
    assert codec.decode(unset)[2].topicEpoch == -1  # type: ignore[index]
    for epoch in (-1, 0, 5):
        message = codec.encode(1, "createProducer", {"topicEpoch": epoch})
        assert _pycapnp_body("BrokerFrame", message)[2]["topicEpoch"] == epoch
        assert message == _pycapnp_build("BrokerFrame", 1, "createProducer", {"topicEpoch": epoch})


def test_empty_and_absent_texts_and_lists() -> None:
    codec = frame_codec(BookieFrame)
    absent = codec.encode(0, "addEntry", {"segmentId": 1})
    empty = codec.encode(0, "addEntry", {"segmentId": 1, "forwardTo": []})
    with_empty_text = codec.encode(0, "addEntry", {"forwardTo": [""]})
    assert absent != empty
    for message in (absent, empty, with_empty_text):
        assert _fast_body("BookieFrame", message, codec) == _pycapnp_body("BookieFrame", message)
    error = frame_codec(BrokerFrame).encode(3, "error", {"code": 1})
    assert frame_codec(BrokerFrame).decode(error)[2].message == ""  # type: ignore[index]


def test_a_decoded_body_reads_like_pycapnps() -> None:
    message = build_message(
        BrokerFrame,
        0,
        "ack",
        {"consumerId": 9, "ackType": "cumulative", "positions": [{"segmentId": 1, "count": 3}]},
    )
    _, kind, body = frame_codec(BrokerFrame).decode(message)  # type: ignore[misc]
    assert kind == "ack"
    assert str(body.ackType) == "cumulative" and body.ackType.raw == 1
    (p,) = body.positions
    assert (p.segmentId, p.entryId, p.batchIndex, p.offset, p.count) == (1, 0, 0, 0, 3)


# ------------------------------------------------------------------ old and short layouts


def _body(message: bytes | bytearray) -> tuple[int, int, int]:
    """(start, data words, pointer words) of the body of a frame built here (its root
    struct at word 1: requestId and the discriminant, then the body pointer)."""
    (w,) = struct.unpack_from("<Q", message, 32)
    return 40 + ((w & 0xFFFFFFFF) >> 2) * 8, (w >> 32) & 0xFFFF, w >> 48


def _shrink(message: bytes, dw: int, pc: int) -> bytes:
    """The frame with its body's struct pointer claiming ``dw`` data and ``pc`` pointer
    words (an older, smaller layout: what is beyond reads as its default)."""
    out = bytearray(message)
    (w,) = struct.unpack_from("<Q", out, 32)
    struct.pack_into("<Q", out, 32, (w & 0xFFFFFFFF) | dw << 32 | pc << 48)
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(frames(), st.integers(0, 8), st.integers(0, 4))
def test_a_smaller_struct_reads_its_missing_fields_as_defaults(
    case: tuple[str, int, str, Any], dw: int, pc: int
) -> None:
    frame, request_id, kind, fields = case
    if fields is None:
        return
    message = _pycapnp_build(frame, request_id, kind, fields)
    if struct.unpack_from("<I", message)[0] or struct.unpack_from("<Q", message, 32)[0] & 3:
        return  # several segments, or an empty struct
    (w,) = struct.unpack_from("<Q", message, 32)
    dw = min(dw, (w >> 32) & 0xFFFF)
    pc = min(pc, w >> 48) if dw == (w >> 32) & 0xFFFF else 0
    _agree(frame, _shrink(message, dw, pc))


def test_an_older_send_without_num_messages() -> None:
    message = _shrink(
        build_message(BrokerFrame, 4, "send", {"producerId": 7, "numMessages": 5}), 1, 0
    )
    _, _, body = frame_codec(BrokerFrame).decode(message)  # type: ignore[misc]
    assert (body.producerId, body.sequenceId, body.numMessages) == (7, 0, 0)


# ------------------------------------------------------------------ hostile bytes


def _agree(frame: str, message: bytes) -> None:
    """The fast decode of ``message`` is pycapnp's, or it leaves the bytes to pycapnp."""
    try:
        fast = _fast_body(frame, message)
    except (AssertionError, *DECODE_ERRORS):
        return  # pycapnp decides (and its error is the one the peer sees)
    try:
        slow = _pycapnp_body(frame, message)
    except Exception as exc:
        pytest.fail(f"the fast path accepted bytes pycapnp refuses ({exc}): {fast}")
    assert fast == slow


@settings(max_examples=400, deadline=None)
@given(frames(), st.data())
def test_mutated_frames_decode_as_pycapnp_decodes_them(
    case: tuple[str, int, str, Any], data: Any
) -> None:
    frame, request_id, kind, fields = case
    message = bytearray(_pycapnp_build(frame, request_id, kind, fields))
    how = data.draw(st.sampled_from(["flip", "word", "truncate", "table"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 3))):
            bit = data.draw(st.integers(0, len(message) * 8 - 1))
            message[bit // 8] ^= 1 << bit % 8
    elif how == "word":
        at = data.draw(st.integers(0, len(message) // 8 - 1)) * 8
        message[at : at + 8] = data.draw(st.binary(min_size=8, max_size=8))
    elif how == "truncate":
        del message[data.draw(st.integers(0, len(message) - 1)) :]
    else:
        message[4:8] = struct.pack("<I", data.draw(st.integers(0, 2**32 - 1)))
    _agree(frame, bytes(message))


def test_amplification_is_left_to_pycapnp() -> None:
    """A list of many text pointers to one text: the fast path reads at most as many words
    as the message holds, then leaves it to pycapnp (and its traversal limit)."""
    codec = frame_codec(BookieFrame)
    message = bytearray(codec.encode(0, "addEntry", {"forwardTo": ["x" * 200] + [""] * 50}))
    start, dw, _ = _body(message)
    at = start + dw * 8  # forwardTo: the first pointer
    (w,) = struct.unpack_from("<Q", message, at)
    items = at + 8 + ((w & 0xFFFFFFFF) >> 2) * 8
    (first,) = struct.unpack_from("<Q", message, items)
    target = items + 8 + ((first & 0xFFFFFFFF) >> 2) * 8
    for i in range(1, 51):  # every item points to the first one's text
        item = items + 8 * i
        offset = ((target - item - 8) // 8) << 2
        struct.pack_into("<Q", message, item, (first & ~0xFFFFFFFF) | offset | 1)
    assert len(_pycapnp_body("BookieFrame", bytes(message))[2]["forwardTo"]) == 51
    with pytest.raises(DECODE_ERRORS):
        codec.decode(bytes(message))


def _set_word(at_word: int, value: int) -> Any:
    """A corruption: the body's word ``at_word`` (data, then pointers) set to ``value``."""

    def corrupt(message: bytes) -> bytes:
        out = bytearray(message)
        struct.pack_into("<Q", out, _body(out)[0] + at_word * 8, value)
        return bytes(out)

    return corrupt


def _text_bytes(raw: bytes) -> Any:
    def corrupt(message: bytes) -> bytes:
        return message[: -len(raw)] + raw

    return corrupt


@pytest.mark.parametrize(
    ("kind", "fields", "corrupt"),
    [
        ("error", {"code": 3, "message": "abcdefg"}, _text_bytes(b"abcdefgh")),  # no NUL
        ("error", {"code": 3, "message": "abcdefg"}, _text_bytes(b"\xff\xfeabcd\0")),
        ("ack", {"consumerId": 1}, _set_word(1, 9)),  # ackType 9: unknown
        # positions: a list pointer far beyond the message
        (
            "ack",
            {"consumerId": 1, "positions": [{}]},
            _set_word(2, 1 | 999 << 2 | 7 << 32 | 5 << 35),
        ),
        # positions: a far pointer
        ("ack", {"consumerId": 1, "positions": [{}]}, _set_word(2, 2)),
        ("addEntry", {"forwardTo": ["a"]}, _set_word(5, 1 | 2 << 32 | 1 << 35)),  # not texts
    ],
)
def test_a_malformed_fast_kind_is_refused_with_pycapnps_error(
    kind: str, fields: dict[str, Any], corrupt: Any, caplog: pytest.LogCaptureFixture
) -> None:
    frame = BookieFrame if kind == "addEntry" else BrokerFrame
    message = corrupt(build_message(frame, 5, kind, fields))
    with pytest.raises(DECODE_ERRORS):
        frame_codec(frame).decode(message)
    with frame.from_bytes(message) as msg:
        expected = body_checker(frame).check(msg, kind)
    assert isinstance(expected, MalformedRequest)
    handled: list[Request] = []

    class Handler:
        def on_ack(self, conn: Connection, req: Request) -> None:
            handled.append(req)

        on_error = on_addEntry = on_ack

    a, _ = trio.testing.memory_stream_pair()
    server = Connection(a, frame, handler=Handler(), serving=True)
    with caplog.at_level(logging.WARNING):
        server._dispatch_message(message, memoryview(b""))
    assert not handled  # a malformed request has no effect
    answer = b"".join(bytes(p) for p in server._out)[4:]
    name = "BookieFrame" if frame is BookieFrame else "BrokerFrame"
    assert _pycapnp_body(name, answer)[:2] == (5, "error")
    assert _pycapnp_body(name, answer)[2]["message"] == expected.message
    assert "malformed request" in caplog.text


# ------------------------------------------------------------------ read_header


@st.composite
def headers(draw: Any) -> bytes:
    n = draw(st.integers(1, 5))
    chunk = None
    if draw(st.booleans()):
        chunk = (draw(st.text(min_size=1, max_size=30)), 0, draw(st.integers(1, 9)), 1000)
    entry: bytes = encode_batch(
        [draw(st.binary(max_size=30)) for _ in range(n)],
        keys=draw(st.none() | st.just([b"k"] * n)),
        producer_name=draw(st.text(max_size=40)),
        sequence_id=draw(st.integers(0, 2**63 - 1)),
        publish_time=draw(st.integers(0, 2**62)),
        deliver_at=draw(st.integers(0, 2**62)),
        schema_version=draw(st.integers(0, 2**32 - 1)),
        codec=NONE,
        chunk=chunk if n == 1 else None,
    )
    return entry


def _slow_header(entry: bytes, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        m.setattr(_batch, "_fast_header", None)
        try:
            return read_header(entry)
        except CorruptFrame as exc:
            return ("CorruptFrame", str(exc))


def _fast_header(entry: bytes) -> Any:
    try:
        return read_header(entry)
    except CorruptFrame as exc:
        return ("CorruptFrame", str(exc))


def test_read_header_uses_the_fast_path() -> None:
    assert isinstance(_batch._fast_header, StructCodec)
    assert _batch._fast_header is struct_codec(_batch._BatchHeaderSchema.schema)


@settings(max_examples=200, deadline=None)
@given(headers())
def test_read_header_equals_pycapnps(entry: bytes) -> None:
    with pytest.MonkeyPatch.context() as mp:
        assert _fast_header(entry) == _slow_header(entry, mp)


@settings(max_examples=400, deadline=None)
@given(headers(), st.data())
def test_corrupt_headers_give_pycapnps_error(entry: bytes, data: Any) -> None:
    raw = bytearray(entry)
    header_len = struct.unpack_from("<I", raw)[0]
    how = data.draw(st.sampled_from(["flip", "word", "truncate"]))
    if how == "flip":
        bit = data.draw(st.integers(32, (4 + header_len) * 8 - 1))
        raw[bit // 8] ^= 1 << bit % 8
    elif how == "word":
        at = 4 + data.draw(st.integers(0, header_len // 8 - 1)) * 8
        raw[at : at + 8] = data.draw(st.binary(min_size=8, max_size=8))
    else:
        del raw[data.draw(st.integers(0, len(raw) - 1)) :]
    with pytest.MonkeyPatch.context() as mp:
        assert _fast_header(bytes(raw)) == _slow_header(bytes(raw), mp)


def test_frames_on_the_wire_are_unchanged() -> None:
    """A frame built fast goes out as before: length prefix, message, payload."""
    fields = {"producerId": 1, "sequenceId": 2, "numMessages": 3}
    message = build_message(BrokerFrame, 7, "send", fields)
    assert message == _pycapnp_build("BrokerFrame", 7, "send", fields)
    (frame,) = encode_frame(message)
    assert frame[4:] == message


def test_a_message_above_one_pycapnp_segment() -> None:
    """pycapnp starts a second segment above 8 KiB; the fast message stays one segment
    (decoding the same), and a message of several segments is left to pycapnp."""
    entry = {"segmentId": 1, "size": 3, "redeliveryCount": 0, "ackedIndexes": [1]}
    fields = {"consumerId": 1, "entries": [dict(entry, entryId=i) for i in range(400)]}
    slow = _pycapnp_build("BrokerFrame", 0, "message", fields)
    fast = frame_codec(BrokerFrame).encode(0, "message", fields)
    assert struct.unpack_from("<I", slow)[0] > 0  # several segments
    assert struct.unpack_from("<I", fast)[0] == 0
    assert _pycapnp_body("BrokerFrame", fast) == _pycapnp_body("BrokerFrame", slow)
    assert _fast_body("BrokerFrame", fast) == _pycapnp_body("BrokerFrame", slow)
    with pytest.raises(DECODE_ERRORS):
        frame_codec(BrokerFrame).decode(slow)

"""Fuzzing the RPC layer with hostile bytes: random bytes, truncated frames, bit-flipped
valid frames of every kind of both protocols, sent to a serving :class:`Connection`.

Every answer must be a typed error (never an internal one) or a valid answer; malformed
input never logs an ERROR or a traceback; a connection that is kept still answers a valid
request; a connection that is closed was told why first.  The service reads every field
of every body it is handed (``to_dict``), so a body the :class:`BodyChecker` let through
that does not decode would show up as an internal error here.

Examples are bounded so the module runs in a few seconds; each example is its own
``trio.run`` with a MockClock, so waiting for bytes that never come is instant.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from pigeon.core._framing import (
    FrameDecoder,
    build_message,
    capnp_message_size,
    encode_frame,
    sniff_foreign_protocol,
)
from pigeon.core._rpc import Connection, Request
from pigeon.core._schema import PROTOCOL_VERSION, BookieFrame, BrokerFrame
from pigeon.core.errors import InternalError, PigeonError
from pigeon.core.testing.fuzz import fuzz_settings

#: PIGEON_FUZZ_EXAMPLES=2000 for a longer, randomized run (default: 150, derandomized)
FUZZ = fuzz_settings("PIGEON_FUZZ_EXAMPLES", 150)

POSITION = {"segmentId": 3, "entryId": 7, "batchIndex": 2, "batchSize": 5, "offset": 40}

#: one fully populated frame of every kind (requests, answers and pushes), per protocol
BROKER_KINDS: dict[str, dict[str, Any] | None] = {
    "connect": {"protocolVersion": PROTOCOL_VERSION, "clientName": "fz", "features": ["a"]},
    "connected": {"protocolVersion": 1, "serverName": "s", "features": ["x"], "maxFrameSize": 9},
    "error": {"code": 300, "message": "no such topic"},
    "ok": None,
    "ping": None,
    "lookup": {"topic": "persistent://public/default/t"},
    "lookupResult": {"brokerUrl": "pigeon://h:1", "partitions": 2, "topic": "t"},
    "createProducer": {
        "producerId": 4,
        "topic": "t",
        "producerName": "p",
        "accessMode": "exclusiveWithFencing",
        "schemaInfo": {"type": "JSON", "definition": "{}"},
        "topicEpoch": 3,
    },
    "producerCreated": {
        "producerName": "p",
        "lastSequenceId": 9,
        "topic": "t",
        "schemaVersion": 1,
        "topicEpoch": 3,
    },
    "send": {"producerId": 4, "sequenceId": 10, "numMessages": 2},
    "sendReceipt": {"producerId": 4, "sequenceId": 10, "segmentId": 1, "entryId": 2},
    "closeProducer": {"producerId": 4},
    "subscribe": {
        "consumerId": 5,
        "topic": "t",
        "subscription": "s",
        "subType": "keyShared",
        "initialPosition": "earliest",
        "consumerName": "c",
        "priority": 1,
        "durable": True,
        "startOffset": -1,
        "schemaInfo": {"type": "STRING", "definition": ""},
        "readCompacted": True,
    },
    "subscribed": {"topic": "t"},
    "flow": {"consumerId": 5, "permits": 100},
    "message": {
        "consumerId": 5,
        "entries": [{"segmentId": 1, "entryId": 2, "size": 3, "ackedIndexes": [0, 2]}],
    },
    "ack": {"consumerId": 5, "ackType": "cumulative", "positions": [POSITION, POSITION]},
    "redeliverUnacked": {"consumerId": 5, "positions": [POSITION]},
    "closeConsumer": {"consumerId": 5},
    "unsubscribe": {"consumerId": 5},
    "seek": {"consumerId": 5, "position": POSITION},
    "getLastMessageId": {"consumerId": 5},
    "lastMessageId": {"position": POSITION, "offset": 4, "markDeleteOffset": 2},
    "closedByBroker": {"producerId": 1, "consumerId": 2, "isProducer": True, "reason": "r"},
    "createTopic": {"topic": "t", "partitions": 3},
    "listTopics": {"namespace": "public/default"},
    "topicList": {"topics": ["a", "b"]},
    "getSchema": {"topic": "t", "version": 2},
    "schemaResponse": {"version": 2, "schemaInfo": {"type": "AVRO", "definition": "{}"}},
}
BOOKIE_KINDS: dict[str, dict[str, Any] | None] = {
    "connect": {"protocolVersion": PROTOCOL_VERSION, "clientName": "fz"},
    "connected": {"protocolVersion": 1, "serverName": "s", "maxMessageSize": 9},
    "error": {"code": 401, "message": "segment=1 not found"},
    "ok": None,
    "ping": None,
    "addEntry": {
        "segmentId": 1,
        "entryId": 2,
        "lac": 1,
        "recovery": True,
        "forwardTo": ["127.0.0.1:3181", "127.0.0.1:3182"],
        "forwardAcks": 1,
        "syncFrom": 0,
    },
    "addResponse": {"segmentId": 1, "entryId": 2, "copies": 2, "lostReplicas": ["h:1"]},
    "readEntries": {"segmentId": 1, "firstEntryId": 0, "lastEntryId": 9, "maxBytes": 100},
    "readResponse": {"segmentId": 1, "entries": [{"entryId": 0, "size": 3}]},
    "readLac": {"segmentId": 1},
    "fence": {"segmentId": 1},
    "segmentInfo": {"segmentId": 1},
    "segmentState": {"segmentId": 1, "lastEntryId": 3, "lac": 2, "fenced": True},
    "deleteSegment": {"segmentId": 1},
}
PROTOCOLS = {"broker": (BrokerFrame, BROKER_KINDS), "bookie": (BookieFrame, BOOKIE_KINDS)}
#: request ids of fuzzed frames are in [2**16, 2**20]: a few bit flips never make this one
PING_ID = 2**62 + 0x5A5A5A5A5A


def test_every_kind_of_both_protocols_is_fuzzed() -> None:
    for frame_type, kinds in PROTOCOLS.values():
        assert set(kinds) == set(frame_type.schema.union_fields)


class ReadEverything:
    """Serves every kind: reads the whole body (as a handler might), then answers ok."""

    def __init__(self) -> None:
        self.handled: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("on_"):
            raise AttributeError(name)
        return self._serve

    def _serve(self, conn: Connection, req: Request) -> None:
        if req.body is not None:
            req.body.to_dict()
        self.handled.append(req.kind)
        conn.respond(req.request_id, "ok")


@dataclass
class Outcome:
    sent: bytes  # everything sent: the fuzzed bytes and the ping
    answers: list[tuple[int, str, int | None]]  # (requestId, kind, error code)
    closed: bool  # the server closed the connection
    ping_answered: bool
    foreign_answer: bytes = b""  # not frames: the server answered in another protocol


def _frame(frame_type: Any, kind: str, fields: dict[str, Any] | None, request_id: int) -> bytes:
    payload = b"payload!" if kind in ("send", "addEntry", "message", "readResponse") else None
    message = build_message(frame_type, request_id, kind, fields)
    return b"".join(bytes(p) for p in encode_frame(message, payload))


async def _exchange(frame_type: Any, data: bytes, serving: bool) -> Outcome:
    """Send ``data`` then a ping to a Connection (serving, or the client side of one,
    which checks bodies only when its handler fails); what came back."""
    client, server_stream = trio.testing.memory_stream_pair()
    server = Connection(
        server_stream, frame_type, handler=ReadEverything(), name="server", serving=serving
    )
    answers: list[tuple[int, str, int | None]] = []
    ping_answered = False
    closed = False
    foreign = b""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        ping = _frame(frame_type, "ping", None, PING_ID)
        await client.send_all(data)
        await client.send_all(ping)
        decoder = FrameDecoder()
        with trio.move_on_after(30):  # virtual time: the server waits for bytes never sent
            while not ping_answered:
                try:
                    chunk = await client.receive_some(65536)
                except trio.BrokenResourceError:
                    chunk = b""
                if not chunk:
                    closed = True
                    break
                if foreign or (not answers and chunk.startswith(b"HTTP/")):
                    foreign += chunk
                    continue
                decoder.feed(chunk)
                for frame in decoder.frames():
                    size = capnp_message_size(frame)
                    with frame_type.from_bytes(frame[:size]) as msg:
                        kind = msg.which()
                        code = msg.error.code if kind == "error" else None
                        answers.append((msg.requestId, kind, code))
                        ping_answered |= msg.requestId == PING_ID and kind == "ok"
        await client.aclose()
        with trio.fail_after(5):
            await server.closed_event.wait()
        nursery.cancel_scope.cancel()
    return Outcome(data + ping, answers, closed, ping_answered, foreign)


def run_exchange(
    frame_type: Any, data: bytes, caplog: pytest.LogCaptureFixture, *, serving: bool = True
) -> Outcome:
    caplog.clear()  # one example's records only (hypothesis reuses the fixture)
    outcome: Outcome = trio.run(
        _exchange, frame_type, data, serving, clock=trio.testing.MockClock(autojump_threshold=0)
    )
    return outcome


@pytest.fixture
def server_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.INFO)
    yield caplog


def check(outcome: Outcome, caplog: pytest.LogCaptureFixture) -> None:
    for request_id, kind, code in outcome.answers:
        if kind == "error":
            assert code is not None
            assert code in PigeonError._by_code, f"untyped error code {code}"
            assert code != InternalError.code, f"internal error for request {request_id}"
        else:
            assert kind == "ok", f"unexpected answer {kind}"
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]
    if outcome.closed:
        # a closed connection said why before closing: a typed error frame, or (for a
        # client of another protocol) one WARNING line naming it, and an HTTP 400 to HTTP
        foreign = sniff_foreign_protocol(outcome.sent)
        if foreign is None:
            assert any(kind == "error" for _rid, kind, _code in outcome.answers)
        else:
            assert any(foreign in r.getMessage() for r in caplog.records)
            if foreign == "an HTTP request":
                assert outcome.foreign_answer.startswith(b"HTTP/1.1 400 ")
    # at most one log line per bad frame
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 2


@st.composite
def valid_frames(draw: st.DrawFn) -> tuple[Any, str, bytes]:
    name = draw(st.sampled_from(sorted(PROTOCOLS)))
    frame_type, kinds = PROTOCOLS[name]
    kind = draw(st.sampled_from(sorted(kinds)))
    request_id = draw(st.integers(2**16, 2**20))
    return frame_type, kind, _frame(frame_type, kind, kinds[kind], request_id)


@st.composite
def bit_flipped(draw: st.DrawFn, *, keep_prefix: bool) -> tuple[Any, str, bytes]:
    frame_type, kind, data = draw(valid_frames())
    start = 4 if keep_prefix else 0
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(start, len(buf) - 1))
        buf[at] ^= 1 << draw(st.integers(0, 7))
    return frame_type, kind, bytes(buf)


@pytest.mark.parametrize("serving", [True, False], ids=["server", "client"])
@FUZZ
@given(case=bit_flipped(keep_prefix=True))
def test_bit_flipped_frames_get_typed_answers(server_log: Any, serving: bool, case: Any) -> None:
    frame_type, _kind, data = case
    outcome = run_exchange(frame_type, data, server_log, serving=serving)
    check(outcome, server_log)
    if not outcome.closed:
        assert outcome.ping_answered  # the length prefix is intact: never out of step


@FUZZ
@given(case=bit_flipped(keep_prefix=False))
def test_bit_flips_anywhere_never_crash(server_log: Any, case: Any) -> None:
    frame_type, _kind, data = case
    check(run_exchange(frame_type, data, server_log), server_log)


@FUZZ
@given(case=valid_frames(), data=st.data())
def test_truncated_frames(server_log: Any, case: Any, data: st.DataObject) -> None:
    frame_type, _kind, frame = case
    cut = data.draw(st.integers(5, len(frame) - 1))
    if data.draw(st.booleans()):  # the prefix says what was cut: a short Cap'n Proto message
        truncated = struct.pack("<I", cut - 4) + frame[4:cut]
    else:  # the stream just stops: the server waits, then sees the end of the stream
        truncated = frame[:cut]
    check(run_exchange(frame_type, truncated, server_log), server_log)


@FUZZ
@given(
    frame_type=st.sampled_from([BrokerFrame, BookieFrame]),
    junk=st.binary(min_size=1, max_size=300),
    framed=st.booleans(),
)
def test_random_bytes(server_log: Any, frame_type: Any, junk: bytes, framed: bool) -> None:
    data = struct.pack("<I", len(junk)) + junk if framed else junk
    check(run_exchange(frame_type, data, server_log), server_log)


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_valid_frames_of_every_kind_are_served(server_log: Any, protocol: str) -> None:
    """The fuzz's baseline: unmutated, every kind reaches the service and is answered."""
    frame_type, kinds = PROTOCOLS[protocol]
    for i, (kind, fields) in enumerate(sorted(kinds.items()), start=1):
        outcome = run_exchange(frame_type, _frame(frame_type, kind, fields, i), server_log)
        check(outcome, server_log)
        assert outcome.ping_answered and not outcome.closed
        assert outcome.answers[0] == (i, "ok", None), kind

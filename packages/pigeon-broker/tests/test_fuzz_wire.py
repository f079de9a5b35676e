"""Fuzzing a real broker (an in-process standalone over loopback) with bit-flipped valid
requests of every kind the broker serves, random bytes and truncated frames.

Each example opens a connection, attaches a producer and a consumer (so that requests
naming them reach deep into the handlers), sends one mutated frame, then a valid
``lookup``.  Every answer must be a valid answer or a typed error, never an internal
one; no ERROR line is logged; the ``lookup`` is answered unless the connection was
closed with an error first (or the mutated length prefix left the broker waiting for
bytes).  Messages produced before the fuzz are all read back after it.

``PIGEON_FUZZ_EXAMPLES=500`` for a longer, randomized run (default: 60, derandomized).
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from typing import Any

import hypothesis
import pytest
from admin_support import AdminStandalone, ErrorLines, fuzz_settings
from hypothesis import strategies as st

from pigeon.client import Client
from pigeon.core._codecs import NONE
from pigeon.core._framing import (
    FrameDecoder,
    build_message,
    capnp_message_size,
    encode_frame,
    sniff_foreign_protocol,
)
from pigeon.core._schema import PROTOCOL_VERSION, BrokerFrame
from pigeon.core.batch import encode_batch
from pigeon.core.errors import InternalError, PigeonError

FUZZ = fuzz_settings("PIGEON_FUZZ_EXAMPLES", 60)
TOPIC = "persistent://public/default/fz"
PROTECTED = "persistent://public/default/protected"
#: request ids: fuzzed frames in [2**16, 2**20]; a few bit flips never make the probe's
PROBE_ID = 2**62 + 0x5A5A5A5A5A
#: answers and pushes a broker may send
ANSWERS = {
    "connected",
    "error",
    "ok",
    "lookupResult",
    "producerCreated",
    "sendReceipt",
    "subscribed",
    "message",
    "lastMessageId",
    "closedByBroker",
    "topicList",
}
POSITION = {"segmentId": 1, "entryId": 0, "batchIndex": 0, "batchSize": 2, "offset": 0}


def _batch(sequence_id: int) -> bytes:
    return encode_batch(
        [b"fuzz-a", b"fuzz-b"],
        keys=["k", None],
        properties=[{"p": "v"}, None],
        producer_name="fz-producer",
        sequence_id=sequence_id,
        publish_time=int(time.time() * 1000),
        codec=NONE,
    )


#: a valid request of every kind the broker serves, on a connection whose producer and
#: consumer are both id 1 (see RawConnection.attach); (kind, fields, payload)
REQUESTS: list[tuple[str, dict[str, Any] | None, bytes | None]] = [
    ("ping", None, None),
    ("connect", {"protocolVersion": PROTOCOL_VERSION, "clientName": "again"}, None),
    ("lookup", {"topic": TOPIC}, None),
    ("createTopic", {"topic": "fz-created", "partitions": 2}, None),
    ("listTopics", {"namespace": "public/default"}, None),
    ("createProducer", {"producerId": 2, "topic": TOPIC, "producerName": ""}, None),
    ("send", {"producerId": 1, "sequenceId": 10**6, "numMessages": 2}, _batch(10**6)),
    ("closeProducer", {"producerId": 1}, None),
    (
        "subscribe",
        {
            "consumerId": 2,
            "topic": TOPIC,
            "subscription": "s2",
            "subType": "keyShared",
            "initialPosition": "earliest",
            "consumerName": "c2",
            "priority": 1,
            "durable": True,
            "startOffset": -1,
        },
        None,
    ),
    ("flow", {"consumerId": 1, "permits": 10}, None),
    ("ack", {"consumerId": 1, "ackType": "individual", "positions": [POSITION]}, None),
    ("ack", {"consumerId": 1, "ackType": "cumulative", "positions": [POSITION]}, None),
    ("redeliverUnacked", {"consumerId": 1, "positions": [POSITION]}, None),
    ("seek", {"consumerId": 1, "offset": 0}, None),
    ("seek", {"consumerId": 1, "timestamp": 0}, None),
    ("seek", {"consumerId": 1, "position": POSITION}, None),
    ("getLastMessageId", {"consumerId": 1}, None),
    ("closeConsumer", {"consumerId": 1}, None),
    ("unsubscribe", {"consumerId": 1}, None),
]


def test_every_request_kind_is_fuzzed() -> None:
    served = set(BrokerFrame.schema.union_fields) - ANSWERS
    assert {kind for kind, _f, _p in REQUESTS} == served


def _frame(kind: str, fields: Any, request_id: int, payload: bytes | None = None) -> bytes:
    message = build_message(BrokerFrame, request_id, kind, fields)
    return b"".join(bytes(p) for p in encode_frame(message, payload))


class RawConnection:
    """A blocking socket speaking frames, to send bytes no real client would."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.decoder = FrameDecoder()
        self.frames: list[tuple[int, str, int | None]] = []
        self.closed = False

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _receive(self, timeout: float) -> bool:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return False
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return False
        self.decoder.feed(data)
        for frame in self.decoder.frames():
            size = capnp_message_size(frame)
            with BrokerFrame.from_bytes(frame[:size]) as msg:
                kind = msg.which()
                code = msg.error.code if kind == "error" else None
                self.frames.append((msg.requestId, kind, code))
        return True

    def wait_for(self, request_id: int, timeout: float = 10.0) -> tuple[int, str, int | None]:
        deadline = time.monotonic() + timeout
        while True:
            for frame in self.frames:
                if frame[0] == request_id:
                    return frame
            left = deadline - time.monotonic()
            if self.closed or left <= 0:
                raise TimeoutError(f"no answer to {request_id}: {self.frames}")
            self._receive(left)

    def request(self, kind: str, fields: Any, request_id: int) -> tuple[int, str, int | None]:
        self.send(_frame(kind, fields, request_id))
        answer = self.wait_for(request_id)
        assert answer[1] != "error", (kind, answer)
        return answer

    def attach(self) -> None:
        """Handshake, producer 1 and consumer 1 on the fuzz topic, with permits."""
        self.request(
            "connect",
            {"protocolVersion": PROTOCOL_VERSION, "clientName": "fz", "frameType": "BrokerFrame"},
            1,
        )
        self.request("createProducer", {"producerId": 1, "topic": TOPIC}, 2)
        sub = {"consumerId": 1, "topic": TOPIC, "subscription": "s", "subType": "shared"}
        self.request("subscribe", {**sub, "initialPosition": "earliest", "durable": True}, 3)
        self.send(_frame("flow", {"consumerId": 1, "permits": 1000}, 0))
        self.frames.clear()


@pytest.fixture(scope="module")
def protected(admin_standalone: AdminStandalone) -> list[bytes]:
    """Messages acknowledged before the fuzz; they must all be readable after it."""
    values = [f"protected-{i}".encode() for i in range(20)]
    with Client(admin_standalone.service_url) as client, client.create_producer(PROTECTED) as p:
        for value in values:
            p.send(value)
    return values


def _address(standalone: AdminStandalone) -> tuple[str, int]:
    assert standalone.service is not None
    host, port = standalone.service.address
    return host, port


def exchange(standalone: AdminStandalone, data: bytes) -> None:
    """Send ``data`` after attaching, then a lookup; check everything that came back."""
    conn = RawConnection(_address(standalone))
    try:
        conn.attach()
        conn.send(data)
        probe_frame = _frame("lookup", {"topic": TOPIC}, PROBE_ID)
        waits = server_waits(data + probe_frame)
        if not conn.closed:
            try:
                conn.send(probe_frame)
            except OSError:
                conn.closed = True
        try:
            probe = conn.wait_for(PROBE_ID, timeout=0.05 if waits else 10.0)
        except TimeoutError:
            probe = None
        for request_id, kind, code in conn.frames:
            assert kind in ANSWERS, kind
            if kind == "error":
                assert code in PigeonError._by_code, f"untyped error code {code}"
                assert code != InternalError.code, f"internal error answering {request_id}"
        if probe is not None:
            assert probe[1] == "lookupResult", probe  # still serving valid requests
        elif conn.closed:  # the broker hung up: it said why first, unless not our protocol
            said_why = any(kind == "error" for _rid, kind, _c in conn.frames)
            assert said_why or sniff_foreign_protocol(data) is not None, conn.frames
        else:  # neither answered nor closed: only while a frame is incomplete
            assert waits, f"probe unanswered: {conn.frames}"
    finally:
        conn.close()


def server_waits(data: bytes) -> bool:
    """Whether a server framing ``data`` is left waiting for the rest of a frame (a
    mutated length prefix promised more bytes than were sent)."""
    decoder = FrameDecoder()
    decoder.feed(data)
    try:
        for _frame_bytes in decoder.frames():
            pass
    except PigeonError:
        return False  # it refuses the stream instead
    return decoder.buffered > 0


@st.composite
def flipped_requests(draw: st.DrawFn, *, keep_prefix: bool) -> bytes:
    kind, fields, payload = draw(st.sampled_from(REQUESTS))
    frame = bytearray(_frame(kind, fields, draw(st.integers(2**16, 2**20)), payload))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(4 if keep_prefix else 0, len(frame) - 1))
        frame[at] ^= 1 << draw(st.integers(0, 7))
    return bytes(frame)


def check_protected(standalone: AdminStandalone, values: list[bytes]) -> None:
    with (
        Client(standalone.service_url) as client,
        client.subscribe(
            PROTECTED, f"check-{time.monotonic_ns()}", initial_position="earliest"
        ) as consumer,
    ):
        got = [consumer.receive(timeout=10).value for _ in values]
    assert got == values


def assert_unharmed(
    standalone: AdminStandalone, protected: list[bytes], error_lines: ErrorLines
) -> None:
    """No error was logged, and the messages stored before the fuzz are all readable."""
    assert not error_lines.records, [r.getMessage() for r in error_lines.records]
    check_protected(standalone, protected)


def test_bit_flipped_requests_of_every_kind(
    admin_standalone: AdminStandalone, protected: list[bytes], error_lines: ErrorLines
) -> None:
    @FUZZ
    @hypothesis.given(data=flipped_requests(keep_prefix=True))
    def run(data: bytes) -> None:
        exchange(admin_standalone, data)

    run()
    assert_unharmed(admin_standalone, protected, error_lines)


def test_bit_flips_anywhere_random_bytes_and_truncated_frames(
    admin_standalone: AdminStandalone, protected: list[bytes], error_lines: ErrorLines
) -> None:
    @st.composite
    def truncated(draw: st.DrawFn) -> bytes:
        kind, fields, payload = draw(st.sampled_from(REQUESTS))
        frame = _frame(kind, fields, draw(st.integers(2**16, 2**20)), payload)
        cut = draw(st.integers(5, len(frame) - 1))
        if draw(st.booleans()):
            return struct.pack("<I", cut - 4) + frame[4:cut]  # a short Cap'n Proto message
        return frame[:cut]

    junk = st.binary(min_size=1, max_size=200)
    framed_junk = junk.map(lambda b: struct.pack("<I", len(b)) + b)

    @FUZZ
    @hypothesis.given(data=flipped_requests(keep_prefix=False) | truncated() | junk | framed_junk)
    def run(data: bytes) -> None:
        exchange(admin_standalone, data)

    run()
    assert_unharmed(admin_standalone, protected, error_lines)


def test_unknown_subscription_type_is_a_typed_error(
    admin_standalone: AdminStandalone, error_lines: ErrorLines, caplog: pytest.LogCaptureFixture
) -> None:
    """The reported case: a subscribe whose subType is not one of the four."""
    caplog.set_level(logging.INFO)
    good = build_message(BrokerFrame, 9, "subscribe", {"consumerId": 5, "topic": TOPIC})
    marked = build_message(
        BrokerFrame, 9, "subscribe", {"consumerId": 5, "topic": TOPIC, "subType": "keyShared"}
    )
    (at,) = [i for i in range(len(good)) if good[i] != marked[i]]
    data = bytearray(marked)
    data[at] = 4  # one past keyShared
    conn = RawConnection(_address(admin_standalone))
    try:
        conn.attach()
        conn.send(struct.pack("<I", len(data)) + bytes(data))
        assert conn.wait_for(9)[1:] == ("error", 204)  # MalformedRequest
        conn.send(_frame("lookup", {"topic": TOPIC}, 10))
        assert conn.wait_for(10)[1] == "lookupResult"
    finally:
        conn.close()
    assert not error_lines.records
    lines = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(lines) == 1 and "subType: enum value 4" in lines[0].getMessage()

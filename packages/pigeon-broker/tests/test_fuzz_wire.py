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

import functools
import logging
import struct
import time

import pytest
from admin_support import AdminStandalone

from pigeon.client import Client
from pigeon.core._codecs import NONE
from pigeon.core._framing import build_message
from pigeon.core._schema import PROTOCOL_VERSION, BrokerFrame
from pigeon.core.batch import encode_batch
from pigeon.core.testing.fuzz import (
    ErrorLines,
    RawConnection,
    Request,
    check_exchange,
    flipped_frames,
    fuzz_settings,
    hostile_bytes,
    run_fuzz,
)

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
    "schemaResponse",
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
#: consumer are both id 1 (see attach); (kind, fields, payload)
REQUESTS: list[Request] = [
    ("ping", None, None),
    ("connect", {"protocolVersion": PROTOCOL_VERSION, "clientName": "again"}, None),
    ("lookup", {"topic": TOPIC}, None),
    ("createTopic", {"topic": "fz-created", "partitions": 2}, None),
    ("listTopics", {"namespace": "public/default"}, None),
    ("getSchema", {"topic": TOPIC, "version": -1}, None),
    ("createProducer", {"producerId": 2, "topic": TOPIC, "producerName": ""}, None),
    ("createProducer", {"producerId": 3, "topic": TOPIC, "schemaInfo": {"type": "STRING"}}, None),
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


def attach(address: tuple[str, int]) -> RawConnection:
    """A raw connection past its handshake, with producer 1 and consumer 1 on the fuzz
    topic, and permits."""
    conn = RawConnection(address, BrokerFrame)
    conn.request(
        "connect",
        {"protocolVersion": PROTOCOL_VERSION, "clientName": "fz", "frameType": "BrokerFrame"},
        1,
    )
    conn.request("createProducer", {"producerId": 1, "topic": TOPIC}, 2)
    sub = {"consumerId": 1, "topic": TOPIC, "subscription": "s", "subType": "shared"}
    conn.request("subscribe", {**sub, "initialPosition": "earliest", "durable": True}, 3)
    conn.send(conn.frame("flow", {"consumerId": 1, "permits": 1000}, 0))
    conn.frames.clear()
    return conn


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
    conn = attach(_address(standalone))
    try:
        probe = ("lookup", {"topic": TOPIC})
        check_exchange(conn, data, probe, PROBE_ID, answers=ANSWERS, probe_answer="lookupResult")
    finally:
        conn.close()


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
    error_lines.assert_none()
    check_protected(standalone, protected)


def test_bit_flipped_requests_of_every_kind(
    admin_standalone: AdminStandalone, protected: list[bytes], error_lines: ErrorLines
) -> None:
    hostile = flipped_frames(BrokerFrame, REQUESTS, keep_prefix=True)
    run_fuzz(FUZZ, hostile, functools.partial(exchange, admin_standalone))
    assert_unharmed(admin_standalone, protected, error_lines)


def test_bit_flips_anywhere_random_bytes_and_truncated_frames(
    admin_standalone: AdminStandalone, protected: list[bytes], error_lines: ErrorLines
) -> None:
    hostile = hostile_bytes(BrokerFrame, REQUESTS)
    run_fuzz(FUZZ, hostile, functools.partial(exchange, admin_standalone))
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
    conn = attach(_address(admin_standalone))
    try:
        conn.send(struct.pack("<I", len(data)) + bytes(data))
        assert conn.wait_for(9)[1:3] == ("error", 204)  # MalformedRequest
        conn.send(conn.frame("lookup", {"topic": TOPIC}, 10))
        assert conn.wait_for(10)[1] == "lookupResult"
    finally:
        conn.close()
    assert not error_lines.records
    lines = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(lines) == 1 and "subType: enum value 4" in lines[0].getMessage()

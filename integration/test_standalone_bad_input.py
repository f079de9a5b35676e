"""Acceptance tests of ``pigeon standalone`` as a real process: bad input over raw
sockets (garbage, truncated and oversize frames, wrong versions, invalid topics, unknown
message types) gets a typed error, stores nothing, and leaves the server serving.

The tests share one server (``module_standalone_factory`` in ``conftest.py``): bad input
must not disturb it, so each test ends by checking that it still serves and that the
baseline topic holds exactly what it held; each test writes only its own topics and
checks "nothing was stored" on them.  Every wait is bounded.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any

import pytest
from _produce import (
    OP_TIMEOUT,
    Sent,
    assert_content,
    assert_nothing_more,
    produce,
    receive_n,
    unique,
)
from _wire import RawConnection, frame_bytes

from pigeon.client import Client
from pigeon.core import PluginManager
from pigeon.core._codecs import CodecSet
from pigeon.core._framing import DEFAULT_MAX_FRAME_SIZE, build_message, encode_frame
from pigeon.core._schema import BrokerFrame
from pigeon.core.batch import BatchBuilder
from pigeon.core.errors import (
    CorruptFrame,
    FrameTooLarge,
    InvalidTopicName,
    MessageTooLarge,
    ProtocolError,
    ProtocolVersionMismatch,
    UnknownMessageType,
)
from pigeon.core.testing.servers import Standalone

pytestmark = pytest.mark.integration

MAX_MESSAGE_SIZE = 5 * 1024 * 1024  # the broker's default max_message_size


BASELINE_TOPIC = "baseline"
BASELINE = [Sent(f"baseline-{i}".encode(), f"bk{i}", {"b": str(i)}) for i in range(20)]


@pytest.fixture(scope="module")
def shared(module_standalone_factory: Callable[..., Standalone]) -> Standalone:
    """The module's standalone; it already stores a known topic (checked after each bad
    input)."""
    standalone = module_standalone_factory().start()
    ids = produce(standalone.url, BASELINE_TOPIC, BASELINE)
    assert [mid.offset for mid in ids] == list(range(len(BASELINE)))
    return standalone


@pytest.fixture
def server(shared: Standalone) -> Standalone:
    """The shared standalone, alive (a test that killed it failed already)."""
    assert shared.running, f"the shared server died before this test:\n{shared.log_tail()}"
    return shared


def assert_still_serving(server: Standalone) -> None:
    """The server is alive, serves a new well-behaved client, and kept its data."""
    assert server.running, f"server died; log:\n{server.log_tail()}"
    with Client(server.url, operation_timeout=OP_TIMEOUT) as client:
        topic = unique("after")
        with client.subscribe(topic, "s", initial_position="earliest") as consumer:
            with client.create_producer(topic) as producer:
                mid = producer.send(b"still here", key="k")
            m = consumer.receive(timeout=OP_TIMEOUT)
            assert (m.value, m.key, m.message_id) == (b"still here", "k", mid)
        with client.subscribe(BASELINE_TOPIC, unique("check"), initial_position="earliest") as c:
            stored = receive_n(c, len(BASELINE))
            assert [m.offset for m in stored] == list(range(len(BASELINE)))
            assert_content(stored, BASELINE)
            assert_nothing_more(c, idle=0.3)


def assert_only(server: Standalone, topic: str, value: bytes, why: str) -> None:
    """``value``, sent now to ``topic``, is stored at offset 0 and is all it holds (the
    bad input before stored nothing: else ``why``)."""
    with Client(server.url, operation_timeout=OP_TIMEOUT) as client:
        with client.create_producer(topic) as producer:
            assert producer.send(value).offset == 0, why
        with client.subscribe(topic, "s", initial_position="earliest") as consumer:
            assert consumer.receive(timeout=OP_TIMEOUT).value == value
            assert_nothing_more(consumer)


def error_codes(frames: list[Any]) -> list[int | None]:
    return [f.error_code for f in frames]


@pytest.mark.parametrize(
    ("garbage", "code"),
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: pigeon\r\n\r\n", FrameTooLarge.code, id="http"),
        pytest.param(struct.pack("<I", 64) + b"\xff" * 64, CorruptFrame.code, id="bad-capnp"),
        pytest.param(struct.pack("<I", 3) + b"abc", CorruptFrame.code, id="short-frame"),
    ],
)
def test_garbage_bytes_get_a_typed_error_and_a_close(
    server: Standalone, garbage: bytes, code: int
) -> None:
    for after_handshake in (False, True):
        with RawConnection(server.port) as raw:
            if after_handshake:
                raw.handshake()
            raw.send(garbage)
            if garbage.startswith(b"GET ") and not after_handshake:
                # an HTTP client on the native port is answered in HTTP, which it can show
                raw._fill(12, time.monotonic() + OP_TIMEOUT)
                assert bytes(raw._buf).startswith(b"HTTP/1.1 400"), bytes(raw._buf[:80])
                continue
            assert error_codes(raw.read_until_closed()) == [code], after_handshake
    assert_still_serving(server)


def test_oversize_length_prefix_is_refused_before_reading_the_body(server: Standalone) -> None:
    with RawConnection(server.port) as raw:
        raw.handshake()
        # Announce 4 GiB - 1 and one byte over the limit; send only a few bytes of body.
        raw.send(struct.pack("<I", DEFAULT_MAX_FRAME_SIZE + 1) + b"\0" * 16)
        assert error_codes(raw.read_until_closed()) == [FrameTooLarge.code]
    with RawConnection(server.port) as raw:
        raw.send(struct.pack("<I", 0xFFFFFFFF) + b"\0" * 16)
        assert error_codes(raw.read_until_closed()) == [FrameTooLarge.code]
    assert_still_serving(server)


def _batch(values: list[bytes], *, producer_name: str, sequence_id: int = 0) -> bytes:
    builder = BatchBuilder(
        producer_name=producer_name,
        codec=CodecSet.from_registry(PluginManager().codecs).by_name("none"),
        max_messages=len(values),
        max_bytes=1 << 30,
    )
    for v in values:
        builder.add(v)
    return builder.build(sequence_id=sequence_id, publish_time=int(time.time() * 1000))


def _raw_producer(raw: RawConnection, topic: str) -> str:
    answer = raw.request("createProducer", {"producerId": 1, "topic": topic}, request_id=2)
    assert answer.kind == "producerCreated", answer
    return str(answer.body["producerName"])


def test_truncated_frames_then_disconnect_store_nothing(server: Standalone) -> None:
    topic = "truncated"
    # A send frame cut in half: its batch must not be stored.
    with RawConnection(server.port) as raw:
        raw.handshake()
        name = _raw_producer(raw, topic)
        frame = frame_bytes(
            "send",
            {"producerId": 1, "sequenceId": 0, "numMessages": 2},
            request_id=3,
            payload=_batch([b"half-1", b"half-2"], producer_name=name),
        )
        raw.send(frame[: len(frame) // 2])
    # A length prefix promising more than ever comes; and a prefix cut in half.
    with RawConnection(server.port) as raw:
        raw.handshake()
        raw.send(struct.pack("<I", 1000) + b"\0" * 10)
    with RawConnection(server.port) as raw:
        raw.send(frame_bytes("connect", {"protocolVersion": 1, "clientName": "x"})[:2])

    assert_still_serving(server)
    assert_only(server, topic, b"whole", "part of a truncated frame was stored")


def test_wrong_protocol_version_gets_version_mismatch_then_close(server: Standalone) -> None:
    message = build_message(BrokerFrame, 1, "connect", {"protocolVersion": 99, "clientName": "x"})
    with RawConnection(server.port) as raw:
        raw.send(b"".join(bytes(p) for p in encode_frame(message)))
        frames = raw.read_until_closed()
    assert [(f.request_id, f.error_code) for f in frames] == [(1, ProtocolVersionMismatch.code)]
    assert "99" in frames[0].body["message"]
    assert_still_serving(server)


def test_request_before_connect_gets_protocol_error_then_close(server: Standalone) -> None:
    # errors.ProtocolError: "The peer broke the protocol; the connection is closed."
    with RawConnection(server.port) as raw:
        raw.send(frame_bytes("lookup", {"topic": "events"}, request_id=1))
        frames = raw.read_until_closed()
    assert [(f.request_id, f.error_code) for f in frames] == [(1, ProtocolError.code)]
    assert_still_serving(server)


INVALID_TOPICS = [
    "bad topic",
    "a/b",
    "a/b/c/d",
    "http://public/default/x",
    "persistent://public/default",
    "events/",
    "x" * 300,
]


def test_invalid_topic_names(server: Standalone) -> None:
    with Client(server.url, operation_timeout=OP_TIMEOUT) as client:
        for topic in INVALID_TOPICS:
            with pytest.raises(InvalidTopicName):
                client.create_producer(topic)
            with pytest.raises(InvalidTopicName):
                client.subscribe(topic, "s")
    # The broker checks too, whatever a client does, and keeps the connection.
    with RawConnection(server.port) as raw:
        raw.handshake()
        request_id = 1
        for topic in INVALID_TOPICS:
            request_id += 1
            answer = raw.request("lookup", {"topic": topic}, request_id=request_id)
            assert (answer.request_id, answer.error_code) == (request_id, InvalidTopicName.code)
            request_id += 1
            answer = raw.request(
                "createProducer", {"producerId": 1, "topic": topic}, request_id=request_id
            )
            assert (answer.request_id, answer.error_code) == (request_id, InvalidTopicName.code)
        assert raw.request("ping", None, request_id=request_id + 1).kind == "ok"
    assert_still_serving(server)


def test_message_over_max_size_is_refused_and_nothing_stored(server: Standalone) -> None:
    topic = "big"
    with (
        Client(server.url, operation_timeout=OP_TIMEOUT) as client,
        client.create_producer(topic) as producer,
    ):
        with pytest.raises(MessageTooLarge):
            producer.send(b"x" * (MAX_MESSAGE_SIZE + 1))
        with pytest.raises(MessageTooLarge):  # fits alone, not with the batch header
            producer.send(b"x" * MAX_MESSAGE_SIZE)
    # The broker enforces the limit whatever the client does.
    with RawConnection(server.port) as raw:
        raw.handshake()
        name = _raw_producer(raw, topic)
        payload = _batch([b"y" * (MAX_MESSAGE_SIZE + 1024)], producer_name=name)
        answer = raw.request(
            "send",
            {"producerId": 1, "sequenceId": 0, "numMessages": 1},
            request_id=3,
            payload=payload,
        )
        assert (answer.request_id, answer.error_code) == (3, MessageTooLarge.code)
        # a refused send fences its producer until it re-attaches (issue #12)
        push = raw.read_frame(timeout=OP_TIMEOUT)
        assert push is not None and push.kind == "closedByBroker"
        assert raw.request("ping", None, request_id=4).kind == "ok"

    assert_still_serving(server)
    assert_only(server, topic, b"small", "part of an oversize message was stored")


def test_messages_under_the_limit_are_not_refused_because_of_batching(
    server: Standalone,
) -> None:
    # Each message fits in max_message_size on its own; batched together they would not,
    # so the producer must put them in separate batches rather than fail both.
    small, large = b"s" * (100 * 1024), b"L" * (MAX_MESSAGE_SIZE - 50 * 1024)
    with (
        Client(server.url, operation_timeout=OP_TIMEOUT) as client,
        client.create_producer("near-limit", batching_max_delay_ms=1000) as producer,
    ):
        assert producer.send(large).offset == 0  # alone it is accepted
        futures = [producer.send_async(small), producer.send_async(large)]
        producer.flush()
        assert [f.result(timeout=OP_TIMEOUT).offset for f in futures] == [1, 2]


def test_unknown_message_types(server: Standalone) -> None:
    with RawConnection(server.port) as raw:
        raw.handshake()
        # A kind the broker does not serve (it only ever sends it): typed error, same id,
        # and the connection keeps working.
        answer = raw.request("lookupResult", {"topic": "events"}, request_id=5)
        assert (answer.request_id, answer.error_code) == (5, UnknownMessageType.code)
        assert raw.request("ping", None, request_id=6).kind == "ok"
        # A union member this schema does not know (a newer peer): typed error.
        message = bytearray(build_message(BrokerFrame, 7, "ping", None))
        assert message[24] == 4  # the union discriminant of BrokerFrame: ping
        message[24] = 200
        raw.send(b"".join(bytes(p) for p in encode_frame(bytes(message))))
        frame = raw.read_frame()
        assert frame is not None and frame.error_code == UnknownMessageType.code, frame
    assert_still_serving(server)

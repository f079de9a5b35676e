"""What a client says of a port that answered its silence over HTTP (``describe_http_answer``,
the verdict of ``probe_http``) or as a Kafka broker (``describe_kafka_answer``, the verdict
of ``probe_kafka``): pure functions of the bytes answered."""

from __future__ import annotations

import json
import struct

from pigeon.core._framing import http_refusal
from pigeon.core._rpc import (
    KAFKA_PROBE_CORRELATION_ID,
    describe_http_answer,
    describe_kafka_answer,
    kafka_probe_request,
)


def _http(status: str, body: bytes) -> bytes:
    return f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


HEALTH = {
    "status": "ok",
    "checks": {},
    "brokers": [
        {"service_url": "pigeon://10.0.0.1:6650", "http_url": "http://10.0.0.1:8080"},
        {"service_url": "pigeon://10.0.0.2:6651", "http_url": "http://10.0.0.2:8081"},
    ],
}


def test_an_admin_port_is_named_with_the_service_url_of_its_own_broker() -> None:
    text = describe_http_answer(_http("200 OK", json.dumps(HEALTH).encode()), 8081, "broker")
    assert text == (
        "port 8081 is a PigeonMQ broker's admin HTTP port, not a broker port:"
        " use pigeon://10.0.0.2:6651"
    )


def test_an_admin_port_that_tells_an_anonymous_caller_little_still_says_what_it_is() -> None:
    body = json.dumps({"status": "ok", "checks": {"broker": {"ok": True}}}).encode()
    text = describe_http_answer(_http("200 OK", body), 8080, "broker")
    assert text is not None
    assert "admin HTTP port" in text and "6650 by default" in text


def test_another_http_server_is_named_by_its_status_line() -> None:
    text = describe_http_answer(_http("404 Not Found", b"<html>nope</html>"), 80, "broker")
    assert text is not None
    assert "port 80 is an HTTP server ('HTTP/1.1 404 Not Found')" in text


def test_our_own_protocol_port_or_no_http_is_no_verdict() -> None:
    # a slow PigeonMQ node answers the probe with its HTTP refusal: keep waiting for it
    refusal = http_refusal("This port speaks the PigeonMQ broker protocol; it received x.")
    assert describe_http_answer(refusal, 6650, "broker") is None
    assert describe_http_answer(b"", 6650, "broker") is None
    assert describe_http_answer(b"\x00\x01binary", 6650, "broker") is None


# ----------------------------------------------------------------- a Kafka broker's port


def _kafka_answer(correlation_id: int, error_code: int = 0, rest: bytes = b"") -> bytes:
    body = struct.pack(">ih", correlation_id, error_code) + rest
    return struct.pack(">i", len(body)) + body


def test_the_kafka_probe_is_an_api_versions_request() -> None:
    request = kafka_probe_request()
    (size,) = struct.unpack_from(">i", request)
    assert size == len(request) - 4
    api_key, version, correlation_id = struct.unpack_from(">hhi", request, 4)
    assert (api_key, version, correlation_id) == (18, 0, KAFKA_PROBE_CORRELATION_ID)


def test_a_kafka_broker_is_named_from_its_answer_alone() -> None:
    # an ApiVersions v0 answer (any Kafka broker: Apache Kafka, Tansu, Redpanda, ours)
    versions = struct.pack(">i", 1) + struct.pack(">hhh", 18, 0, 3)
    answer = _kafka_answer(KAFKA_PROBE_CORRELATION_ID, 0, versions)
    assert describe_kafka_answer(answer, 9092, "broker") == (
        "port 9092 speaks the Kafka protocol; use a Kafka client or pigeon's service port"
        " (pigeon://, 6650 by default)"
    )
    # a broker that does not know v0 answers UNSUPPORTED_VERSION (35), still Kafka
    text = describe_kafka_answer(_kafka_answer(KAFKA_PROBE_CORRELATION_ID, 35), 9092, "bookie")
    assert text is not None and "port 9092 speaks the Kafka protocol" in text


def test_bytes_that_are_not_a_kafka_answer_are_no_verdict() -> None:
    assert describe_kafka_answer(b"", 9092, "broker") is None
    assert describe_kafka_answer(_kafka_answer(12345), 9092, "broker") is None
    assert describe_kafka_answer(_http("200 OK", b"{}"), 9092, "broker") is None
    assert describe_kafka_answer(b"\x00\x00\x00\x06\x00", 9092, "broker") is None

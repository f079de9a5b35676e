"""Kafka framing and message types (``_kafka_wire``) and the ``[kafka]`` configuration."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import pytest
from kio.schema.api_versions.v3.request import ApiVersionsRequest
from kio.schema.api_versions.v3.response import ApiVersionsResponse
from kio.schema.errors import ErrorCode
from kio.schema.metadata.v1.response import MetadataResponse as MetadataV1
from kio.schema.metadata.v12.response import MetadataResponse as MetadataV12
from kio.schema.request_header.v2.header import RequestHeader
from kio.serial import entity_reader, entity_writer

from pigeon.broker._cli import _broker_config
from pigeon.broker._config import KafkaConfig
from pigeon.broker._kafka_wire import (
    ZERO,
    UnsupportedApi,
    build,
    decode_request,
    encode_response,
    error_code,
    part,
)
from pigeon.core.errors import (
    ConfigError,
    CorruptRecordBatch,
    MalformedRequest,
    NotOwner,
    ServiceUnavailable,
    TopicNotFound,
)


def frame(api_key: int, version: int, correlation_id: int, body: bytes) -> bytes:
    header = io.BytesIO()
    entity_writer(RequestHeader)(
        header,
        RequestHeader(
            request_api_key=api_key,
            request_api_version=version,
            correlation_id=correlation_id,
            client_id="test",
        ),
    )
    return header.getvalue() + body


def api_versions_body() -> bytes:
    buf = io.BytesIO()
    entity_writer(ApiVersionsRequest)(
        buf, ApiVersionsRequest(client_software_name="t", client_software_version="1")
    )
    return buf.getvalue()


def test_a_request_is_decoded_with_the_header_of_its_version() -> None:
    header, request = decode_request(frame(18, 3, 77, api_versions_body()))
    assert (header.request_api_key, header.correlation_id, header.client_id) == (18, 77, "test")
    assert isinstance(request, ApiVersionsRequest)
    assert request.client_software_name == "t"


def test_an_api_or_version_not_served_is_refused_with_its_correlation_id() -> None:
    with pytest.raises(UnsupportedApi) as refused:
        decode_request(frame(18, 9, 5, api_versions_body()))
    assert (refused.value.api_key, refused.value.correlation_id) == (18, 5)
    with pytest.raises(UnsupportedApi, match="API 57 version 0 is not served"):
        decode_request(frame(57, 0, 6, b""))


@pytest.mark.parametrize("body", [b"", b"\xff" * 3, b"\x05abc"])
def test_a_body_that_does_not_parse_is_malformed(body: bytes) -> None:
    head = struct.pack(">hhi", 3, 12, 1) + b"\x00\x04test\x00"
    with pytest.raises(MalformedRequest, match="malformed Kafka request"):
        decode_request(head + body)
    with pytest.raises(MalformedRequest, match="shorter than a header"):
        decode_request(b"\x00\x03")


def test_api_versions_answers_keep_header_v0_and_others_add_tagged_fields() -> None:
    answer = build(ApiVersionsResponse, error_code=ErrorCode.none, api_keys=(), throttle_time=ZERO)
    data = encode_response(9, answer)
    size, correlation = struct.unpack_from(">ii", data)
    assert (size, correlation) == (len(data) - 4, 9)
    body, _ = entity_reader(ApiVersionsResponse)(data, 8)  # no tagged-field byte first
    assert body == answer
    meta = build(
        MetadataV12, throttle_time=ZERO, brokers=(), cluster_id="c", controller_id=1, topics=()
    )
    data = encode_response(10, meta)
    assert data[8] == 0  # header v1: empty tagged fields
    assert entity_reader(MetadataV12)(data, 9)[0] == meta


def test_build_drops_fields_an_older_version_lacks() -> None:
    answer = build(
        MetadataV1,
        throttle_time=ZERO,
        brokers=(
            part(MetadataV1, "MetadataResponseBroker", node_id=1, host="h", port=9, rack=None),
        ),
        cluster_id="c",
        controller_id=1,
        topics=(),
        cluster_authorized_operations=0,
    )
    assert answer.brokers[0].host == "h"
    assert not hasattr(answer, "cluster_id")


def test_errors_map_to_the_kafka_code_a_client_acts_on() -> None:
    assert error_code(NotOwner("x")) == ErrorCode.not_leader_or_follower
    assert error_code(ServiceUnavailable("x")) == ErrorCode.not_leader_or_follower
    assert error_code(TopicNotFound("x")) == ErrorCode.unknown_topic_or_partition
    assert error_code(CorruptRecordBatch("x")) == ErrorCode.corrupt_message
    assert error_code(RuntimeError("x")) == ErrorCode.unknown_server_error


def test_kafka_table_flags_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "pigeon.toml"
    config.write_text('[kafka]\nport = 19092\nnamespace = "acme/orders"\ndefault_partitions = 4\n')
    loaded = _broker_config(str(config), kafka_port=None, kafka_default=9092)
    assert (loaded.kafka.port, loaded.kafka.namespace, loaded.kafka.default_partitions) == (
        19092,
        "acme/orders",
        4,
    )
    assert _broker_config(str(config), kafka_port=-1, kafka_default=9092).kafka.port == -1
    monkeypatch.setenv("PIGEON_KAFKA_PORT", "29092")
    assert _broker_config(None, kafka_port=None, kafka_default=9092).kafka.port == 29092
    monkeypatch.delenv("PIGEON_KAFKA_PORT")
    assert _broker_config(None, kafka_port=None, kafka_default=-1).kafka.port == -1


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"port": 70000}, "'port'"),
        ({"namespace": "orders"}, "'namespace'"),
        ({"default_partitions": 0}, "'default_partitions'"),
        ({"group_initial_rebalance_delay_ms": -1}, "'group_initial_rebalance_delay_ms'"),
    ],
)
def test_bad_kafka_settings_are_config_errors_naming_the_key(
    fields: dict[str, object], key: str
) -> None:
    with pytest.raises(ConfigError, match=key):
        KafkaConfig(**fields).validate()  # type: ignore[arg-type]

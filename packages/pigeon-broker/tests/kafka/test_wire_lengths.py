"""Kafka request decoding refuses hostile input before it can hurt the process.

* every served API version's valid requests pass the length check and decode;
* an array that claims more elements than the request's bytes can hold is refused before
  ``kio`` reserves memory for it (two billion elements aborted the broker);
* a null where the schema allows none is refused (handlers would meet ``None``);
* a PigeonMQ or HTTP client on the Kafka port is told so in its own protocol.
"""

from __future__ import annotations

import datetime
import io
import struct
import uuid
from dataclasses import fields
from typing import Any

import pytest
from kio.index import load_request_schema
from kio.schema.request_header.v1.header import RequestHeader as HeaderV1
from kio.schema.request_header.v2.header import RequestHeader as HeaderV2
from kio.serial import entity_writer
from kio.serial._introspect import (
    EntityField,
    EntityTupleField,
    PrimitiveTupleField,
    classify_field,
)

from pigeon.broker._kafka_lengths import check_lengths
from pigeon.broker._kafka_wire import API_VERSIONS, decode_request, foreign_client
from pigeon.core.errors import MalformedRequest, ProtocolError
from pigeon.core.rpc import BrokerFrame

_VALUES: dict[str, Any] = {
    "bool": True,
    "string": "ab",
    "bytes": b"xyz",
    "records": b"records",
    "uuid": uuid.UUID(int=7),
    "timedelta_i32": datetime.timedelta(milliseconds=5),
    "timedelta_i64": datetime.timedelta(milliseconds=6),
}


def sample(cls: Any) -> Any:
    """An instance of ``cls`` with every field set (arrays of two)."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        fc = classify_field(f)
        if isinstance(fc, EntityTupleField):
            values[f.name] = (sample(fc.type_), sample(fc.type_))
        elif isinstance(fc, EntityField):
            values[f.name] = sample(fc.type_)
        else:
            kafka_type = f.metadata["kafka_type"]
            one = _VALUES[kafka_type] if kafka_type in _VALUES else fc.type_(1)
            values[f.name] = (one, one) if isinstance(fc, PrimitiveTupleField) else one
    return cls(**values)


def frame_of(request: Any, correlation_id: int = 9) -> bytes:
    header_cls = HeaderV2 if type(request).__flexible__ else HeaderV1
    buf = io.BytesIO()
    entity_writer(header_cls)(
        buf,
        header_cls(
            request_api_key=type(request).__api_key__,
            request_api_version=type(request).__version__,
            correlation_id=correlation_id,
            client_id="test",
        ),
    )
    entity_writer(type(request))(buf, request)
    return buf.getvalue()


SERVED = [(key, v) for key, (lo, hi) in sorted(API_VERSIONS.items()) for v in range(lo, hi + 1)]


@pytest.mark.parametrize(("api_key", "version"), SERVED, ids=[f"{k}v{v}" for k, v in SERVED])
def test_every_served_request_passes_the_length_check_and_decodes(
    api_key: int, version: int
) -> None:
    cls = load_request_schema(api_key, version)
    request = sample(cls)
    body = io.BytesIO()
    entity_writer(cls)(body, request)
    data = body.getvalue()
    assert check_lengths(cls, data, 0, len(data)) == len(data)
    header, decoded = decode_request(frame_of(request))
    assert header.correlation_id == 9
    assert decoded == request


def metadata_v12_with_count(count: int) -> bytes:
    """A Metadata v12 request whose topics array claims ``count`` elements (compact)."""
    head = struct.pack(">hhi", 3, 12, 5) + struct.pack(">h", 4) + b"test" + b"\x00"
    n = count + 1
    varint = bytearray()
    while n >= 0x80:
        varint.append((n & 0x7F) | 0x80)
        n >>= 7
    varint.append(n)
    return head + bytes(varint) + b"\x00" * 16


@pytest.mark.parametrize("count", [2**31 - 2, 10**9, 17])
def test_an_array_longer_than_the_request_is_refused_before_parsing(count: int) -> None:
    with pytest.raises(MalformedRequest, match=r"claims \d+ elements"):
        decode_request(metadata_v12_with_count(count))


def test_a_legacy_array_count_of_two_billion_is_refused() -> None:
    # Metadata v4: int32 topics count, then nothing
    frame = struct.pack(">hhih", 3, 4, 5, -1) + struct.pack(">i", 2**31 - 1) + b"\x00" * 8
    with pytest.raises(MalformedRequest, match=r"MetadataRequest\.topics claims 2147483647"):
        decode_request(frame)


def test_a_null_where_the_schema_allows_none_is_refused() -> None:
    # ListOffsets v1: replica_id, then topics count -1 (null): kio reads None
    frame = struct.pack(">hhih", 2, 1, 5, -1) + struct.pack(">ii", -1, -1)
    with pytest.raises(MalformedRequest, match=r"ListOffsetsRequest\.topics is null"):
        decode_request(frame)


def test_a_pigeon_client_gets_an_error_answer_naming_the_broker_port() -> None:
    ping = BrokerFrame.new_message()
    ping.requestId = 7
    ping.ping = None
    data = ping.to_bytes()
    first = struct.pack("<I", len(data)) + data
    what, reply = foreign_client(first)
    assert what == "a PigeonMQ client"
    size = struct.unpack_from("<I", reply)[0]
    assert len(reply) == 4 + size
    with BrokerFrame.from_bytes(reply[4:]) as msg:
        assert msg.requestId == 7 and msg.which() == "error"
        assert msg.error.code == ProtocolError.code
        assert "speaks the Kafka protocol" in msg.error.message
        assert "broker port" in msg.error.message


def test_an_http_client_gets_a_400_and_garbage_gets_nothing() -> None:
    what, reply = foreign_client(b"GET / HTTP/1.1\r\n\r\n")
    assert what == "an HTTP client"
    assert reply.startswith(b"HTTP/1.1 400 ") and b"Kafka protocol" in reply
    assert foreign_client(b"\x7f\xff\xff\xffgarbage") == ("garbage", b"")

"""The Kafka protocol's framing and message types, for the Kafka front door.

A Kafka request is ``int32 size | request header | body``; the header is v1 (api key,
api version, correlation id, client id) or, for the flexible versions of an API, v2
(the same plus tagged fields).  The response is ``int32 size | response header | body``,
header v0 (correlation id) or v1 (plus tagged fields) — except ApiVersions, whose
response header is always v0 so that a client can read it before it knows our versions.

Message types are ``kio``'s dataclasses, generated from Kafka's own schemas: one class
per API and version.  Handlers build answers with :func:`build` and :func:`part`, which
drop the fields a version does not have, so one handler serves every version of its
API.  Which versions we serve is :data:`API_VERSIONS`; an API or version absent from it
is never half-answered: the connection is closed with a log line (ApiVersions itself is
answered with UNSUPPORTED_VERSION and our table, as Kafka does).
"""

from __future__ import annotations

import datetime
import functools
import io
import struct
import sys
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Final, Generic, TypeVar, cast

import trio
from kio.index import load_request_schema, load_response_from_request
from kio.schema.errors import ErrorCode
from kio.schema.request_header.v1.header import RequestHeader as RequestHeaderV1
from kio.schema.request_header.v2.header import RequestHeader as RequestHeaderV2
from kio.serial import entity_reader, entity_writer

from pigeon.broker._kafka_lengths import check_lengths
from pigeon.core.errors import (
    AuthorizationError,
    CorruptFrame,
    InvalidArgument,
    InvalidTopicName,
    MalformedRequest,
    MessageTooLarge,
    NotEnoughBookies,
    NotOwner,
    NotSupported,
    PigeonError,
    ProducerBlocked,
    ProtocolError,
    TopicExists,
    TopicNotFound,
)
from pigeon.core.rpc import DEFAULT_MAX_FRAME_SIZE, BrokerFrame, http_refusal

__all__ = [
    "API_VERSIONS",
    "FETCH_VERSIONS",
    "NO_LEADER_EPOCH",
    "ZERO",
    "Encoded",
    "FetchAnswer",
    "Later",
    "PRODUCE_VERSIONS",
    "ProduceAnswer",
    "RawFrame",
    "build",
    "decode_request",
    "encode_response",
    "error_code",
    "foreign_client",
    "part",
]

#: throttle_time and the other millisecond durations kio types as timedelta
ZERO: Final = datetime.timedelta(0)
#: the leader epoch Metadata and ListOffsets name: unknown, as from a broker without
#: KIP-320 (a known epoch makes clients validate positions with OffsetForLeaderEpoch,
#: which is not served; see ``_kafka_topics``)
NO_LEADER_EPOCH: Final = -1

#: API key -> (lowest, highest) version served.  The highest versions are those current
#: clients negotiate and whose fields we fill truthfully: Fetch stops at 12 (13 names
#: topics by id), Metadata at 12, Produce at 9 (10 adds leader hints).
API_VERSIONS: Final[dict[int, tuple[int, int]]] = {
    0: (3, 9),  # Produce
    1: (4, 12),  # Fetch
    2: (1, 7),  # ListOffsets
    3: (1, 12),  # Metadata
    8: (2, 8),  # OffsetCommit
    9: (1, 7),  # OffsetFetch
    10: (0, 3),  # FindCoordinator
    11: (0, 9),  # JoinGroup
    12: (0, 4),  # Heartbeat
    13: (0, 5),  # LeaveGroup
    14: (0, 5),  # SyncGroup
    15: (0, 5),  # DescribeGroups
    16: (0, 4),  # ListGroups
    18: (0, 3),  # ApiVersions
    19: (2, 5),  # CreateTopics
    20: (1, 5),  # DeleteTopics
    22: (0, 4),  # InitProducerId
    32: (1, 4),  # DescribeConfigs
    33: (0, 2),  # AlterConfigs
    37: (0, 3),  # CreatePartitions
    44: (0, 1),  # IncrementalAlterConfigs
}

API_VERSIONS_KEY: Final = 18
_HEAD = struct.Struct(">hhi")
_I32 = struct.Struct(">i")
_U32_LE = struct.Struct("<I")
_HTTP_METHODS = (b"GET ", b"POST", b"PUT ", b"HEAD", b"DELE", b"PATC", b"OPTI", b"CONN")


class UnsupportedApi(MalformedRequest):
    """A request for an API or version we do not serve."""

    def __init__(self, message: str, *, api_key: int, correlation_id: int) -> None:
        super().__init__(message)
        self.api_key = api_key
        self.correlation_id = correlation_id


@functools.cache
def _request_reader(api_key: int, version: int) -> tuple[Any, Any, Any]:
    cls = load_request_schema(api_key, version)
    header_cls = RequestHeaderV2 if cls.__flexible__ else RequestHeaderV1
    return cls, entity_reader(header_cls), entity_reader(cls)


def decode_request(
    frame: bytes | bytearray | memoryview, extra: dict[int, tuple[int, int]] | None = None
) -> tuple[Any, Any]:
    """(request header, request) of one frame (without its size prefix); ``extra``:
    APIs served besides :data:`API_VERSIONS` (SASL's, on a SASL listener).

    :raises UnsupportedApi: an API or version not in :data:`API_VERSIONS`.
    :raises MalformedRequest: the frame does not parse.
    """
    if len(frame) < _HEAD.size:
        raise MalformedRequest(f"Kafka request of {len(frame)} bytes is shorter than a header")
    api_key, version, correlation_id = _HEAD.unpack_from(frame, 0)
    served = API_VERSIONS.get(api_key)
    if served is None and extra:
        served = extra.get(api_key)
    if served is None or not served[0] <= version <= served[1]:
        raise UnsupportedApi(
            f"Kafka API {api_key} version {version} is not served"
            + (f" (versions {served[0]}-{served[1]} are)" if served else ""),
            api_key=api_key,
            correlation_id=correlation_id,
        )
    cls, read_header, read_body = _request_reader(api_key, version)
    if not isinstance(frame, bytes):
        frame = memoryview(frame).toreadonly()  # kio reads read-only buffers only
    try:
        header, used = read_header(frame, 0)
        if api_key == PRODUCE_KEY:  # read here, every length checked against the frame
            request = _read_produce(cls, memoryview(frame), used)
        else:
            # kio reserves memory for the lengths a request states before it reads
            # them: a huge array count must be refused first, or the allocation aborts
            # the process
            check_lengths(cls, frame, used, len(frame))
            request, _size = read_body(frame, used)
    except MalformedRequest as exc:
        raise MalformedRequest(
            f"malformed Kafka request (API {api_key} v{version}): {exc.message}"
        ) from None
    except Exception as exc:  # kio raises several types on garbage: one answer for all
        raise MalformedRequest(
            f"malformed Kafka request (API {api_key} v{version}): {type(exc).__name__}: {exc}"
        ) from None
    # Trailing bytes are ignored, as Kafka's own brokers do (librdkafka's AdminClient
    # sends a few after some Metadata v12 requests).
    null = _null_field(request)
    if null is not None:
        raise MalformedRequest(
            f"malformed Kafka request (API {api_key} v{version}): {null} is null"
        )
    return header, request


PRODUCE_KEY: Final = 0
_I16 = struct.Struct(">h")
_PRODUCE_HEAD = struct.Struct(">hi")  # acks, timeout


def _read_produce(cls: Any, mv: memoryview, at: int) -> Any:
    """A Produce request (v3-v9) whose records are views of ``mv`` (kio would copy
    each partition's records into a bytes object of their own)."""
    mod = sys.modules[cls.__module__]
    topic_cls, partition_cls = mod.TopicProduceData, mod.PartitionProduceData
    flexible = cls.__flexible__

    def uvarint() -> int:
        nonlocal at
        n = shift = 0
        while True:
            b = mv[at]
            at += 1
            n |= (b & 0x7F) << shift
            if b < 0x80:
                return n
            shift += 7
            if shift > 28:
                raise ValueError("varint too long")

    def length(wide: bool) -> int:
        """A length prefix: -1 is null; flexible versions count from 0 = null."""
        nonlocal at
        if flexible:
            return uvarint() - 1
        if wide:
            (n,) = _I32.unpack_from(mv, at)
            at += 4
        else:
            (n,) = _I16.unpack_from(mv, at)
            at += 2
        return int(n)

    def take(n: int) -> memoryview:
        nonlocal at
        if n < 0 or at + n > len(mv):
            raise ValueError(f"field of {n} bytes at {at} runs past the request's end")
        view = mv[at : at + n]
        at += n
        return view

    def string(nullable: bool) -> str | None:
        n = length(False)
        if n < 0:
            if nullable:
                return None
            raise ValueError("null string")
        return str(take(n), "utf-8")

    def skip_tags() -> None:
        if flexible:
            for _ in range(uvarint()):
                uvarint()
                take(uvarint())

    transactional_id = string(True)
    acks, timeout = _PRODUCE_HEAD.unpack_from(mv, at)
    at += _PRODUCE_HEAD.size
    topics = []
    for _ in range(max(0, length(True))):
        name = string(False)
        partitions = []
        for _ in range(max(0, length(True))):
            (index,) = _I32.unpack_from(mv, at)
            at += 4
            n = length(True)
            records = None if n < 0 else take(n)
            skip_tags()
            partitions.append(partition_cls(index=index, records=records))
        skip_tags()
        topics.append(topic_cls(name=name, partition_data=tuple(partitions)))
    skip_tags()
    return cls(
        transactional_id=transactional_id,
        acks=acks,
        timeout=datetime.timedelta(milliseconds=timeout),
        topic_data=tuple(topics),
    )


@functools.cache
def _required(cls: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(fields that must not be null, fields that may hold nested entities) of a kio type.

    kio's reader gives ``None`` for an array or string of length -1 whatever the schema
    says, so a handler would meet ``None`` where its type promises a value."""
    required: list[str] = []
    nested: list[str] = []
    for f in fields(cls):
        args = typing.get_args(f.type)
        if type(None) not in args:
            required.append(f.name)
        if f.type is not None and (
            is_dataclass(f.type) or any(is_dataclass(a) for a in _flat_args(f.type))
        ):
            nested.append(f.name)
    return tuple(required), tuple(nested)


def _flat_args(t: Any) -> list[Any]:
    out: list[Any] = []
    for a in typing.get_args(t):
        out.append(a)
        out.extend(_flat_args(a))
    return out


def _null_field(entity: Any) -> str | None:
    """The first field of ``entity`` (or of an entity in it) that is null where its schema
    does not allow null, as ``Type.field``; None if there is none."""
    cls: Any = type(entity)
    required, nested = _required(cls)
    for name in required:
        if getattr(entity, name) is None:
            return f"{type(entity).__name__}.{name}"
    for name in nested:
        value = getattr(entity, name)
        for item in value if isinstance(value, tuple) else (value,):
            if is_dataclass(item):
                found = _null_field(item)
                if found is not None:
                    return found
    return None


@functools.cache
def _writer(cls: Any) -> Any:
    return entity_writer(cls)


def encode_response(correlation_id: int, response: Any) -> bytes:
    """The whole response frame (size prefix included)."""
    cls: Any = type(response)
    buf = io.BytesIO()
    buf.write(b"\0\0\0\0")
    buf.write(_I32.pack(correlation_id))
    if cls.__flexible__ and cls.__api_key__ != API_VERSIONS_KEY:
        buf.write(b"\0")  # response header v1: no tagged fields
    _writer(cls)(buf, response)
    out = buf.getbuffer()
    _I32.pack_into(out, 0, len(out) - 4)
    del out
    return buf.getvalue()


class Encoded:
    """An answer encoded by its handler as buffers (sent unjoined with one vectored
    write), instead of a kio message for :func:`encode_response`."""

    __slots__ = ()

    def buffers(self, correlation_id: int) -> list[bytes | memoryview]:
        """The whole response frame (size prefix included), in order."""
        raise NotImplementedError


class RawFrame(Encoded):
    """A bare size-prefixed frame without a response header (the answer to a Kafka
    0.10 SASL token sent after SaslHandshake v0)."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes = b"") -> None:
        self.payload = payload

    def buffers(self, correlation_id: int) -> list[bytes | memoryview]:
        return [_I32.pack(len(self.payload)) + self.payload]


_T = TypeVar("_T")


class Later(Generic[_T]):
    """A value that is not ready yet, set once (later sets are ignored): an answer the
    connection's writer waits for in turn, or a group member's pending JoinGroup or
    SyncGroup result."""

    __slots__ = ("_event", "_value")

    def __init__(self) -> None:
        self._event = trio.Event()
        self._value: _T | None = None

    def set(self, value: _T) -> None:
        if not self._event.is_set():
            self._value = value
            self._event.set()

    async def wait(self) -> _T:
        await self._event.wait()
        return cast(_T, self._value)


#: Fetch versions :class:`FetchAnswer` encodes (the versions served)
FETCH_VERSIONS: Final = range(4, 13)
_I64 = struct.Struct(">q")
_I64x3 = struct.Struct(">qqq")
_NULL_ARRAY = _I32.pack(-1)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class FetchAnswer(Encoded):
    """A Fetch response (versions :data:`FETCH_VERSIONS`) whose records are the stored
    buffers themselves: nothing is joined or copied on the way to the socket.

    ``topics`` is ``[(topic, [partition, ...]), ...]``; a partition is ``(index,
    error_code, high_watermark, last_stable_offset, log_start_offset, records)``, the
    records a list of buffers.  No aborted transactions (null), no preferred replica
    (-1), session 0, no throttle; the same bytes kio writes for such a response.
    """

    __slots__ = ("error_code", "topics", "version")

    def __init__(
        self,
        version: int,
        topics: list[tuple[str, list[tuple[int, int, int, int, int, list[Any]]]]],
        error_code: int = 0,
    ) -> None:
        if version not in FETCH_VERSIONS:
            raise NotSupported(f"Fetch v{version} responses are not encoded here")
        self.version = version
        self.topics = topics
        self.error_code = error_code

    def buffers(self, correlation_id: int) -> list[bytes | memoryview]:
        v = self.version
        flexible = v >= 12
        head = bytearray(_I32.pack(0) + _I32.pack(correlation_id))
        if flexible:
            head += b"\0"  # response header v1: no tagged fields
        head += _I32.pack(0)  # throttle_time
        if v >= 7:
            head += _I16.pack(self.error_code) + _I32.pack(0)  # error, session 0
        out: list[bytes | memoryview] = []
        cur = head  # small fields accumulate here between the records' buffers

        def count(n: int) -> bytes:
            return _uvarint(n + 1) if flexible else _I32.pack(n)

        cur += count(len(self.topics))
        for topic, partitions in self.topics:
            name = topic.encode()
            cur += (_uvarint(len(name) + 1) if flexible else _I16.pack(len(name))) + name
            cur += count(len(partitions))
            for index, error, high, stable, start, records in partitions:
                cur += _I32.pack(index) + _I16.pack(error)
                if v >= 5:
                    cur += _I64x3.pack(high, stable, start)
                else:
                    cur += _I64x3.pack(high, stable, 0)[:16]
                cur += b"\0" if flexible else _NULL_ARRAY  # aborted_transactions: null
                if v >= 11:
                    cur += _I32.pack(-1)  # preferred_read_replica
                size = sum(len(b) for b in records)
                cur += _uvarint(size + 1) if flexible else _I32.pack(size)
                if records:
                    out.append(bytes(cur))
                    out += records
                    cur = bytearray()
                if flexible:
                    cur += b"\0"  # partition's tagged fields
            if flexible:
                cur += b"\0"  # topic's tagged fields
        if flexible:
            cur += b"\0"  # response's tagged fields
        if cur:
            out.append(bytes(cur))
        total = sum(len(b) for b in out) - 4
        first = bytearray(out[0])
        _I32.pack_into(first, 0, total)
        out[0] = bytes(first)
        return out


#: Produce versions :class:`ProduceAnswer` encodes (the versions served)
PRODUCE_VERSIONS: Final = range(3, 10)
_PRODUCED = struct.Struct(">ihqq")  # index, error, base offset, log append time (-1)


class ProduceAnswer(Encoded):
    """A Produce response (versions :data:`PRODUCE_VERSIONS`), written directly: kio's
    writer took longer per response than storing its batch.

    ``topics`` is ``[(topic, [(index, error_code, base_offset, error_message), ...]),
    ...]``; no log append time (-1), log start offset -1, no record errors, no throttle:
    the same bytes kio writes for such a response.
    """

    __slots__ = ("topics", "version")

    def __init__(
        self, version: int, topics: list[tuple[str, list[tuple[int, int, int, str | None]]]]
    ) -> None:
        if version not in PRODUCE_VERSIONS:
            raise NotSupported(f"Produce v{version} responses are not encoded here")
        self.version = version
        self.topics = topics

    def buffers(self, correlation_id: int) -> list[bytes | memoryview]:
        v = self.version
        flexible = v >= 9
        out = bytearray(_I32.pack(0) + _I32.pack(correlation_id))
        if flexible:
            out += b"\0"  # response header v1: no tagged fields

        def count(n: int) -> bytes:
            return _uvarint(n + 1) if flexible else _I32.pack(n)

        def string(value: str | None) -> bytes:
            if value is None:
                return b"\0" if flexible else _I16.pack(-1)
            raw = value.encode()
            return (_uvarint(len(raw) + 1) if flexible else _I16.pack(len(raw))) + raw

        out += count(len(self.topics))
        for topic, partitions in self.topics:
            out += string(topic) + count(len(partitions))
            for index, error, base_offset, message in partitions:
                out += _PRODUCED.pack(index, error, base_offset, -1)
                if v >= 5:
                    out += _I64.pack(-1)  # log_start_offset
                if v >= 8:
                    out += count(0) + string(message)  # record_errors, error_message
                if flexible:
                    out += b"\0"
            if flexible:
                out += b"\0"
        out += _I32.pack(0)  # throttle_time
        if flexible:
            out += b"\0"
        _I32.pack_into(out, 0, len(out) - 4)
        return [bytes(out)]


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


def build(cls: type, /, **values: Any) -> Any:
    """``cls(**values)`` without the values this version of the message has no field
    for (older versions lack newer fields)."""
    names = _field_names(cls)
    return cls(**{k: v for k, v in values.items() if k in names})


def part(owner: type, nested: str, /, **values: Any) -> Any:
    """Build the nested type ``nested`` of the message type ``owner``'s version."""
    return build(getattr(sys.modules[owner.__module__], nested), **values)


def response_type(request: Any) -> type:
    return load_response_from_request(type(request))


_CODES: Final[list[tuple[type[PigeonError], ErrorCode]]] = [
    (AuthorizationError, ErrorCode.topic_authorization_failed),
    (NotOwner, ErrorCode.not_leader_or_follower),
    (TopicNotFound, ErrorCode.unknown_topic_or_partition),
    (TopicExists, ErrorCode.topic_already_exists),
    (InvalidTopicName, ErrorCode.invalid_topic_exception),
    (MessageTooLarge, ErrorCode.message_too_large),
    (CorruptFrame, ErrorCode.corrupt_message),
    (NotEnoughBookies, ErrorCode.not_enough_replicas),
    (ProducerBlocked, ErrorCode.policy_violation),
    (NotSupported, ErrorCode.unsupported_version),
    (InvalidArgument, ErrorCode.invalid_request),
]


def error_code(exc: BaseException) -> ErrorCode:
    """The Kafka error code a client acts on correctly for ``exc``: anything retriable
    we cannot name is NOT_LEADER_OR_FOLLOWER (the client refreshes metadata and sends
    again, to whichever broker serves the partition then)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    if isinstance(exc, PigeonError) and exc.retriable:
        return ErrorCode.not_leader_or_follower
    return ErrorCode.unknown_server_error


def foreign_client(head: bytes) -> tuple[str, bytes]:
    """What a client whose first bytes ``head`` are not a Kafka request is, and the
    bytes that tell it so in its own protocol (``b""`` when it has none we can speak).

    An HTTP client gets a ``400`` with the text; a PigeonMQ client (its first frame is a
    little-endian length and a Cap'n Proto request) an ``error`` answer to that request,
    which it raises as a :class:`~pigeon.core.errors.ProtocolError` naming the port.
    """
    if head[:4] in _HTTP_METHODS:
        return "an HTTP client", http_refusal(
            "This port speaks the Kafka protocol (a PigeonMQ broker's Kafka listener); it"
            " received an HTTP request. The admin REST API is on the broker's HTTP port."
        )
    if len(head) >= 4:
        size = _U32_LE.unpack_from(head, 0)[0]
        if 8 <= size <= DEFAULT_MAX_FRAME_SIZE and len(head) >= 4 + size:
            request_id = _pigeon_request_id(head[4 : 4 + size])
            if request_id is not None:
                return "a PigeonMQ client", _pigeon_error(
                    request_id,
                    "This port speaks the Kafka protocol (a PigeonMQ broker's Kafka"
                    " listener), not the PigeonMQ protocol: connect pigeon:// clients to"
                    " the broker port (6650 by default)",
                )
    return "garbage", b""


def _pigeon_error(request_id: int, text: str) -> bytes:
    """A PigeonMQ frame (length, message) answering ``request_id`` with a ProtocolError."""
    msg = BrokerFrame.new_message()
    msg.requestId = request_id
    error = msg.init("error")
    error.code = ProtocolError.code
    error.message = text
    data: bytes = msg.to_bytes()
    return _U32_LE.pack(len(data)) + data


def _pigeon_request_id(frame: bytes) -> int | None:
    """The request id of a PigeonMQ broker request frame, None if it is not one."""
    try:
        with BrokerFrame.from_bytes(frame) as msg:
            request_id = int(msg.requestId)
            msg.which()
    except Exception:  # pycapnp raises several types on garbage: not a PigeonMQ frame
        return None
    return request_id if request_id > 0 else None

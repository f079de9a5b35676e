"""Framing: turning a byte stream into frames and back, without any I/O.

Byte layout of one frame::

    offset 0   u32 LE   frame_length   bytes that follow (Cap'n Proto message + payload)
    offset 4   ...      Cap'n Proto message, standard (unpacked) serialisation:
                          u32 segment_count - 1, u32 size (in 8-byte words) per segment,
                          padding to 8 bytes, then the segments
    ...        ...      payload: the rest of the frame (may be empty)

The Cap'n Proto message delimits itself through its segment table, so the payload needs no
length of its own.  Payloads are entry bytes that PigeonMQ moves without re-encoding; a
sender may hand a payload over as several buffers (a batch of stored entries, each its own
object) that go on the wire back to back, so that nothing joins them (DESIGN §12).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias

from pigeon.core._capnp_fast import ENCODE_ERRORS
from pigeon.core._schema import frame_codec
from pigeon.core.errors import CorruptFrame, FrameTooLarge

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "FrameDecoder",
    "Payload",
    "build_message",
    "capnp_message_size",
    "consume_buffers",
    "encode_frame",
    "http_refusal",
    "sniff_foreign_protocol",
]

DEFAULT_MAX_FRAME_SIZE = 5 * 1024 * 1024 + 64 * 1024  # 5 MiB of payload plus headroom
_U32 = struct.Struct("<I")
_U32_BE = struct.Struct(">I")
_I16_BE = struct.Struct(">hh")
_MAX_SEGMENTS = 512
#: frames at least this large are assembled in a buffer of their own (see FrameDecoder)
ASSEMBLE_SIZE = 64 * 1024
_HTTP_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"PATCH ", b"OPTIONS ")
_HTTP_OTHER = (b"CONNECT ", b"TRACE ", b"PRI * HTTP/2")
#: highest Kafka API key we recognise as one (ApiVersions is 18; 2024's keys stay < 80)
_KAFKA_MAX_API_KEY = 100

Buffer: TypeAlias = bytes | bytearray | memoryview
#: a frame's payload: one buffer, or a sequence (list, tuple) of buffers sent back to back
Payload: TypeAlias = Buffer | Sequence[Buffer]


def capnp_message_size(buf: bytes | bytearray | memoryview) -> int:
    """Size in bytes of the standard-serialised Cap'n Proto message at the start of buf."""
    n = len(buf)
    if n < 8:
        raise CorruptFrame("frame too short for a Cap'n Proto message")
    nseg: int = _U32.unpack_from(buf, 0)[0] + 1
    if nseg > _MAX_SEGMENTS:
        raise CorruptFrame(f"Cap'n Proto segment count {nseg} is implausible")
    table = 4 * (1 + nseg)
    table += table & 4  # pad to a multiple of 8
    if table > n:
        raise CorruptFrame("Cap'n Proto segment table is truncated")
    words: int = sum(struct.unpack_from(f"<{nseg}I", buf, 4))
    size = table + 8 * words
    if size > n:
        raise CorruptFrame("Cap'n Proto message is longer than its frame")
    return size


def encode_frame(message: bytes, payload: Payload | None = None) -> list[Any]:
    """Buffers that make one frame: the caller writes them in order (or joins them).

    ``payload`` is one buffer or a sequence of buffers; each is passed on as it is (the
    same object, not a copy), so that a batch of entries reaches the socket unjoined."""
    if payload is None:
        parts: list[Any] = []
    elif isinstance(payload, (bytes, bytearray, memoryview)):
        parts = [payload]
    else:
        parts = list(payload)
    size = sum(map(len, parts))
    if size == 0:
        return [_U32.pack(len(message)) + message]
    return [_U32.pack(len(message) + size) + message, *parts]


def consume_buffers(buffers: list[Any], sent: int) -> list[Any]:
    """What is left of ``buffers`` once their first ``sent`` bytes are written (a
    vectored write may write fewer bytes than it was given): the buffers not written at
    all, after a view of the rest of one that was partly written (no copy)."""
    i = 0
    while i < len(buffers) and sent >= len(buffers[i]):
        sent -= len(buffers[i])
        i += 1
    rest = buffers[i:]
    if sent:
        rest[0] = memoryview(rest[0])[sent:]
    return rest


def _fill(builder: Any, fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        if isinstance(value, dict):
            if value:
                _fill(builder.init(name), value)
            else:
                builder.init(name)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            items = builder.init(name, len(value))
            for i, item in enumerate(value):
                _fill(items[i], item)
        else:
            setattr(builder, name, value)


def build_message(
    frame_type: Any, request_id: int, kind: str, fields: dict[str, Any] | None
) -> bytes:
    """Serialise one frame struct: ``requestId`` plus the union member ``kind``.

    The kinds of the per-entry path are built at fixed offsets
    (:func:`~pigeon.core._schema.frame_codec`), byte for byte what pycapnp builds (a
    message pycapnp would split over several segments, above 8 KiB, is one segment
    here); any other kind, or values that codec does not take, go through pycapnp."""
    codec = frame_codec(frame_type)
    if kind in codec.kinds:
        try:
            return codec.encode(request_id, kind, fields)
        except ENCODE_ERRORS:
            pass  # pycapnp builds it, or raises what it always raised
    return build_message_pycapnp(frame_type, request_id, kind, fields)


def build_message_pycapnp(
    frame_type: Any, request_id: int, kind: str, fields: dict[str, Any] | None
) -> bytes:
    """:func:`build_message` through pycapnp's builder, whatever the kind (the reference
    the fixed-offset codec is checked against)."""
    msg = frame_type.new_message()
    msg.requestId = request_id
    if fields is None:
        setattr(msg, kind, None)
    elif fields:
        _fill(msg.init(kind), fields)
    else:
        msg.init(kind)
    data: bytes = msg.to_bytes()
    return data


class FrameDecoder:
    """Accumulates received bytes and yields complete frames.

    ``feed`` takes whatever the transport delivered; ``frames`` yields each complete frame
    (the frame body without its length prefix) as an object of its own that the decoder
    never touches again, so that memoryviews of it stay valid as long as they are held:
    a payload can be stored or forwarded by reference.  A frame announcing more than
    ``max_frame_size`` bytes raises :class:`FrameTooLarge` as soon as its prefix arrives,
    before the body is buffered.

    Copies (DESIGN §12): each frame is copied once out of what was received.  ``feed``
    keeps a ``bytes`` chunk by reference and a frame that arrived whole is sliced out of
    it (``bytes``, aligned for Cap'n Proto); a frame of at least ``ASSEMBLE_SIZE`` bytes
    that arrives over several chunks is assembled in a ``bytearray`` of its exact size,
    allocated when its prefix is read, each chunk copied straight into it (or received
    into it: :meth:`assembly_space`).  Only the start of a small frame that a chunk cut
    is copied twice.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        # Bytes not yet framed, from _pos on: a view of a fed ``bytes`` chunk (kept by
        # reference: it is immutable) or a bytearray of the decoder's own.
        self._buf: bytearray | memoryview = memoryview(b"")
        self._pos = 0
        self._frame: bytearray | None = None  # a large frame being assembled
        self._filled = 0  # bytes of _frame received so far

    @property
    def buffered(self) -> int:
        """Bytes received and not yet yielded as frames."""
        return len(self._buf) - self._pos + self._filled

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        # bytes are kept by reference; a caller may reuse another buffer: copy that
        view = memoryview(data if isinstance(data, bytes) else bytes(data))
        frame = self._frame
        if frame is not None:
            take = min(len(view), len(frame) - self._filled)
            frame[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if not view:
                return
        if self._pos >= len(self._buf):  # nothing pending: frame the chunk in place
            self._buf, self._pos = view, 0
            return
        if not isinstance(self._buf, bytearray):  # a frame's start that the chunk cut
            self._buf = bytearray(self._buf[self._pos :])
            self._pos = 0
        elif self._pos and self._pos >= len(self._buf) // 2:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += view

    def assembly_space(self) -> memoryview | None:
        """The part still to come of a large frame being assembled (None if there is
        none): a reader may receive straight into it, then call :meth:`assembled`, and
        so save the copy out of a chunk that :meth:`feed` makes."""
        frame = self._frame
        if frame is None:
            return None
        return memoryview(frame)[self._filled :]

    def assembled(self, n: int) -> None:
        """``n`` bytes were received into :meth:`assembly_space`."""
        self._filled += n

    def frames(self) -> Iterator[bytes | bytearray]:
        while (frame := self._next_frame()) is not None:
            yield frame

    def _next_frame(self) -> bytes | bytearray | None:
        frame = self._frame
        if frame is not None:
            if self._filled < len(frame):
                return None
            self._frame = None
            self._filled = 0
            return frame
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail < 4:
            return None
        length = _U32.unpack_from(buf, pos)[0]
        if length > self.max_frame_size:
            raise FrameTooLarge(
                f"frame of {length} bytes exceeds max_frame_size {self.max_frame_size}"
            )
        if length < 8:
            raise CorruptFrame(f"frame of {length} bytes is too short")
        start = pos + 4
        end = start + length
        if avail >= 4 + length:
            self._pos = end
            with memoryview(buf) as view:  # released at once: a bytearray can grow again
                return bytes(view[start:end])
        if length >= ASSEMBLE_SIZE:
            frame = bytearray(length)
            have = avail - 4
            frame[:have] = buf[start:]
            self._frame, self._filled = frame, have
            self._buf, self._pos = memoryview(b""), 0
        return None

    def at_frame_boundary(self) -> bool:
        return self.buffered == 0


def sniff_foreign_protocol(data: bytes | bytearray | memoryview) -> str | None:
    """What the first bytes of a stream are when they are not PigeonMQ frames, or None.

    Used on a connection's first bytes (until its first frame is complete) and on a first
    frame that fails to decode, to tell the user which wrong port they dialled:
    ``"an HTTP request"``, ``"an HTTP response"``, ``"an HTML page (an HTTP server)"``,
    ``"a TLS handshake"`` or
    ``"a Kafka request (api key N)"``.  Layouts recognised::

        HTTP/1.x request   b"GET " | b"POST " | ... (method, space)
        HTTP response      b"HTTP/"
        HTML page          b"<!DOCTYPE" | b"<html" (any case: an HTTP/0.9-style error page)
        TLS record         0x16 0x03 0x00-0x04 len:u16 0x01 (a ClientHello; byte 5 of a
                           PigeonMQ frame is 0: its segment count is below 256)
        Kafka request      i32 BE length | i16 BE api_key | i16 BE api_version | ...
                           (a length our little-endian prefix would read as too large)
    """
    head = bytes(data[:16])
    if head.startswith(_HTTP_METHODS + _HTTP_OTHER):
        return "an HTTP request"
    if head.startswith(b"HTTP/"):
        return "an HTTP response"
    if head.lower().startswith((b"<!doctype", b"<html")):
        return "an HTML page (an HTTP server)"
    if len(head) >= 6 and head[0] == 0x16 and head[1] == 0x03 and head[2] <= 4 and head[5] == 1:
        return "a TLS handshake"
    if len(head) >= 8:
        length = _U32_BE.unpack_from(head, 0)[0]
        api_key, api_version = _I16_BE.unpack_from(head, 4)
        if (
            8 <= length <= 100 * 1024 * 1024
            and _U32.unpack_from(head, 0)[0] > DEFAULT_MAX_FRAME_SIZE
            and 0 <= api_key <= _KAFKA_MAX_API_KEY
            and 0 <= api_version <= 32
        ):
            return f"a Kafka request (api key {api_key})"
    return None


def http_refusal(text: str) -> bytes:
    """A complete ``HTTP/1.1 400`` response carrying ``text``, for an HTTP client that
    reached a PigeonMQ protocol port: it shows the text instead of failing to parse."""
    body = (text.rstrip("\n") + "\n").encode()
    head = (
        "HTTP/1.1 400 Bad Request\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body

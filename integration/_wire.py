"""A blocking, hand-driven broker connection for feeding a real server bad input.

:class:`RawConnection` writes whatever bytes a test wants and decodes what the server
answers (``u32 length | Cap'n Proto BrokerFrame | payload``) with the product's own
schema, so tests can assert on error codes and on the server closing the connection.
Every read has a deadline.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from pigeon.core._framing import build_message, capnp_message_size, encode_frame
from pigeon.core._schema import PROTOCOL_VERSION, BrokerFrame

__all__ = ["Frame", "RawConnection", "frame_bytes"]

_U32 = struct.Struct("<I")


def frame_bytes(
    kind: str, fields: dict[str, Any] | None = None, *, request_id: int = 1, payload: bytes = b""
) -> bytes:
    """One complete frame as the product's client would write it."""
    message = build_message(BrokerFrame, request_id, kind, fields)
    return b"".join(bytes(part) for part in encode_frame(message, payload or None))


@dataclass
class Frame:
    request_id: int
    kind: str
    body: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""

    @property
    def error_code(self) -> int | None:
        return int(self.body["code"]) if self.kind == "error" else None


class RawConnection:
    """A TCP connection to the broker port that the test drives byte by byte."""

    def __init__(self, port: int, *, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._buf = bytearray()
        self.eof = False

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(
        self,
        kind: str,
        fields: dict[str, Any] | None = None,
        *,
        request_id: int = 1,
        payload: bytes = b"",
    ) -> Frame:
        self.send(frame_bytes(kind, fields, request_id=request_id, payload=payload))
        frame = self.read_frame()
        assert frame is not None, f"server closed the connection instead of answering {kind!r}"
        return frame

    def handshake(self) -> Frame:
        answer = self.request(
            "connect", {"protocolVersion": PROTOCOL_VERSION, "clientName": "raw-test"}
        )
        assert answer.kind == "connected", answer
        return answer

    def _fill(self, n: int, deadline: float) -> bool:
        """Read until ``n`` bytes are buffered; False on EOF (or a reset)."""
        while len(self._buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no data from the server within {self.timeout}s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.eof = True
                return False
            self._buf += chunk
        return True

    def read_frame(self, timeout: float | None = None) -> Frame | None:
        """The next frame the server sent, or None when it closed the connection."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        if not self._fill(4, deadline):
            assert not self._buf, f"connection closed inside a length prefix: {bytes(self._buf)!r}"
            return None
        length = _U32.unpack_from(self._buf, 0)[0]
        if not self._fill(4 + length, deadline):
            raise AssertionError(f"connection closed inside a frame of {length} bytes")
        data = bytes(self._buf[4 : 4 + length])
        del self._buf[: 4 + length]
        size = capnp_message_size(data)
        with BrokerFrame.from_bytes(data[:size]) as msg:
            kind = msg.which()
            body = getattr(msg, kind) if kind not in ("ok", "ping") else None
            fields = body.to_dict() if body is not None else {}
            return Frame(msg.requestId, kind, fields, data[size:])

    def read_until_closed(self, timeout: float | None = None, max_frames: int = 100) -> list[Frame]:
        """Every frame until the server closes the connection (bounded in time and count)."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        frames: list[Frame] = []
        for _ in range(max_frames):
            frame = self.read_frame(max(0.0, deadline - time.monotonic()))
            if frame is None:
                return frames
            frames.append(frame)
        raise AssertionError(f"server sent more than {max_frames} frames and kept the connection")

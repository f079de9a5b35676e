"""The Kafka port's read loop cuts requests out of whatever the socket delivers: several
in one read, one split over many, and a large one received into a buffer of its own."""

from __future__ import annotations

import os
import struct
from types import SimpleNamespace

import pytest
import trio
import trio.lowlevel

from pigeon.broker._kafka import _READ, _frames
from pigeon.core.errors import MalformedRequest


def framed(body: bytes) -> bytes:
    return struct.pack(">i", len(body)) + body


async def read_all(chunks: list[bytes]) -> list[bytes]:
    """The frames the read loop yields when the peer writes ``chunks`` one by one."""
    a, b = trio.socket.socketpair()
    conn = SimpleNamespace(stream=trio.SocketStream(b), name="test")
    got: list[bytes] = []

    async def write() -> None:
        for chunk in chunks:
            await a.send(chunk)
            await trio.lowlevel.checkpoint()  # let the reader see each piece alone
        a.close()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            async for frame in _frames(conn):  # type: ignore[arg-type]
                got.append(bytes(frame))
    finally:
        b.close()
    return got


async def test_small_and_large_requests_split_anywhere() -> None:
    bodies = [b"a" * 10, os.urandom(3 * _READ + 17), b"", b"b" * (_READ - 4), os.urandom(_READ)]
    stream = b"".join(framed(x) for x in bodies)
    # split at awkward places: inside a size prefix, right after one, inside a large body
    cuts = [2, 5, 14, 16, 900, _READ, 2 * _READ + 3, len(stream) - 3]
    chunks = [stream[i:j] for i, j in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert await read_all(chunks) == bodies


async def test_many_requests_in_one_read() -> None:
    bodies = [bytes([i]) * (i * 7) for i in range(200)]
    assert await read_all([b"".join(framed(x) for x in bodies)]) == bodies


@pytest.mark.parametrize("cut", [3, _READ + 9])
async def test_stream_ending_inside_a_request_is_malformed(cut: int) -> None:
    """A client that hangs up in the middle of a request gets one log line (the caller
    logs the MalformedRequest); the requests before it were served."""
    a, b = trio.socket.socketpair()
    await a.send(framed(b"whole") + framed(b"x" * (2 * _READ))[:cut])
    a.close()
    conn = SimpleNamespace(stream=trio.SocketStream(b), name="test")
    got: list[bytes] = []
    try:
        with pytest.raises(MalformedRequest, match=r"closed the connection .* into a request"):
            async for frame in _frames(conn):  # type: ignore[arg-type]
                got.append(bytes(frame))
    finally:
        b.close()
    assert got == [b"whole"]


async def test_http_on_the_kafka_port_is_malformed() -> None:
    a, b = trio.socket.socketpair()
    await a.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    conn = SimpleNamespace(stream=trio.SocketStream(b), name="test")
    with pytest.raises(MalformedRequest, match="HTTP client"):
        async for _ in _frames(conn):  # type: ignore[arg-type]
            pass
    a.close()
    b.close()

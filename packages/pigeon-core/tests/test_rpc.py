"""The RPC layer over loopback: the connect handshake, serve_tcp/connect_tcp, bad bytes.

Connection itself is tested in test_connection.py, whose test service this file shares."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from test_connection import TIMEOUT, LookupService, raw_frame, read_until_eof

from pigeon.core._rpc import connect_tcp, serve_tcp
from pigeon.core._schema import PROTOCOL_VERSION, BrokerFrame
from pigeon.core.errors import (
    ConnectionClosed,
    ProtocolError,
    ProtocolVersionMismatch,
)

# ------------------------------------------------------------------ TCP: handshake


@asynccontextmanager
async def tcp_server(
    service: Any, **kwargs: Any
) -> AsyncIterator[tuple[trio.Nursery, tuple[str, int]]]:
    async with trio.open_nursery() as nursery:
        address = await nursery.start(
            lambda task_status: serve_tcp(
                service, BrokerFrame, server_name="test-server", task_status=task_status, **kwargs
            )
        )
        yield nursery, address
        nursery.cancel_scope.cancel()


async def test_tcp_connect_handshake_and_request() -> None:
    service = LookupService()
    async with tcp_server(service, max_message_size=1234) as (nursery, (host, port)):
        assert host == "127.0.0.1" and port > 0
        with trio.fail_after(TIMEOUT):
            conn, info = await connect_tcp(host, port, BrokerFrame, nursery, client_name="me")
            assert info["protocolVersion"] == PROTOCOL_VERSION
            assert info["serverName"] == "test-server"
            assert info["maxMessageSize"] == 1234
            assert conn.peer_name == "test-server"
            assert (await conn.request("lookup", {"topic": "a"}))["topic"] == "a"
        assert len(service.opened) == 1
        assert service.opened[0].peer_name == "me"
        # closing the client ends the stream: the server notices and tells its service
        conn.close()
        with trio.fail_after(TIMEOUT):
            await service.opened[0].closed_event.wait()
        assert service.closed == service.opened


async def test_tcp_wrong_protocol_version_is_refused_and_closed() -> None:
    service = LookupService()
    async with tcp_server(service) as (nursery, (host, port)):
        with trio.fail_after(TIMEOUT), pytest.raises(ProtocolVersionMismatch, match="99"):
            await connect_tcp(host, port, BrokerFrame, nursery, protocol_version=99)
        # the same over a raw socket: an error answer, then the server hangs up
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(raw_frame("connect", {"protocolVersion": 99, "clientName": "old"}, 1))
        frames = await read_until_eof(stream)
        assert frames == [(1, "error", (ProtocolVersionMismatch.code, frames[0][2][1]))]
        await stream.aclose()
    assert service.opened == []


async def test_tcp_first_frame_not_connect_closes_connection() -> None:
    service = LookupService()
    async with tcp_server(service) as (_nursery, (host, port)):
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(raw_frame("lookup", {"topic": "t"}, 1))
        frames = await read_until_eof(stream)  # times out if the server keeps it open
        await stream.aclose()
    assert len(frames) == 1
    request_id, kind, (code, message) = frames[0]
    assert (request_id, kind) == (1, "error")
    assert code == ProtocolError.code
    assert "connect" in message
    assert not service.got_request.is_set()  # the service never saw the lookup


def _garbage_cases() -> list[Any]:
    return [
        pytest.param(
            struct.pack("<I", 16) + struct.pack("<II", 0xFFFF, 0) + b"\0" * 8,
            True,
            id="garbage-segment-table",
        ),
        pytest.param(struct.pack("<I", 4) + b"\0" * 4, True, id="too-short"),
        pytest.param(
            struct.pack("<I", 16) + b"\0" * 4 + b"\x01\0\0\0" + b"\xff" * 8,
            True,
            id="garbage-pointer",
        ),
        pytest.param(struct.pack("<I", 10_000_000), True, id="oversize"),
        pytest.param(raw_frame("connect", {"protocolVersion": 1}, 1)[:20], False, id="truncated"),
    ]


@pytest.mark.parametrize(("junk", "server_closes"), _garbage_cases())
async def test_tcp_bad_bytes_close_only_that_connection(junk: bytes, server_closes: bool) -> None:
    service = LookupService()
    async with tcp_server(service) as (nursery, (host, port)):
        with trio.fail_after(TIMEOUT):
            good, _ = await connect_tcp(host, port, BrokerFrame, nursery)
            bad = await trio.open_tcp_stream(host, port)
            await bad.send_all(junk)
            if server_closes:
                frames = await read_until_eof(bad)
                assert all(kind == "error" for _rid, kind, _err in frames)
            await bad.aclose()
            # the other client is untouched, and the server still accepts new ones
            for i in range(3):
                assert (await good.request("lookup", {"topic": f"g{i}"}))["topic"] == f"g{i}"
            other, _ = await connect_tcp(host, port, BrokerFrame, nursery)
            assert (await other.request("lookup", {"topic": "o"}))["topic"] == "o"
            assert not good.closed


async def test_tcp_garbage_after_handshake_closes_that_connection() -> None:
    service = LookupService()
    async with tcp_server(service) as (nursery, (host, port)):
        with trio.fail_after(TIMEOUT):
            good, _ = await connect_tcp(host, port, BrokerFrame, nursery)
            victim, _ = await connect_tcp(host, port, BrokerFrame, nursery)
            service.never_answer = True
            pending = trio.Event()
            box: list[BaseException | None] = []

            def cb(result: Any, error: BaseException | None) -> None:
                box.append(error)
                pending.set()

            victim.request_nowait("lookup", {"topic": "never"}, cb)
            await service.got_request.wait()
            victim.send_raw_nowait(b"\xff" * 16)  # a frame whose segment table is garbage
            await pending.wait()
            assert isinstance(box[0], ConnectionClosed)
            await victim.closed_event.wait()
            service.never_answer = False
            assert (await good.request("lookup", {"topic": "still"}))["topic"] == "still"


async def test_tcp_server_dies_mid_call() -> None:
    service = LookupService()
    service.never_answer = True
    async with trio.open_nursery() as outer:
        server_scope = trio.CancelScope()

        async def run_server(task_status: trio.TaskStatus[tuple[str, int]]) -> None:
            with server_scope:
                await serve_tcp(service, BrokerFrame, task_status=task_status)

        host, port = await outer.start(run_server)
        with trio.fail_after(TIMEOUT):
            conn, _ = await connect_tcp(host, port, BrokerFrame, outer)
            results: list[BaseException] = []

            async def call() -> None:
                try:
                    await conn.request("lookup", {"topic": "t"})
                except ConnectionClosed as exc:
                    results.append(exc)

            async with trio.open_nursery() as calls:
                for _ in range(3):
                    calls.start_soon(call)
                await service.got_request.wait()
                server_scope.cancel()
        assert len(results) == 3
        outer.cancel_scope.cancel()


async def test_connect_to_closed_port_is_connection_closed() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    async with trio.open_nursery() as nursery:
        with pytest.raises(ConnectionClosed, match=str(port)):
            await connect_tcp("127.0.0.1", port, BrokerFrame, nursery, connect_timeout=2.0)

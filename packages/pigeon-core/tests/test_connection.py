"""Connection over memory streams and socket pairs: requests, pushes, payloads, writes."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from pigeon.core import _connection
from pigeon.core._connection import Connection, Request
from pigeon.core._framing import FrameDecoder, build_message, capnp_message_size, encode_frame
from pigeon.core._schema import BookieFrame, BrokerFrame
from pigeon.core.errors import (
    ConnectionClosed,
    PigeonError,
    ProtocolError,
    SegmentNotFound,
    UnknownMessageType,
)

TIMEOUT = 5.0


class CountingStream(trio.abc.Stream):
    """Wraps a stream and records every send_all call."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.sends: list[int] = []

    async def send_all(self, data: Any) -> None:
        self.sends.append(len(data))
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:  # pragma: no cover - not used by Connection
        await self.inner.send_eof()  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        await self.inner.aclose()


class Recorder:
    """A client-side handler recording server pushes."""

    def __init__(self) -> None:
        self.pushes: list[tuple[int, int, bytes]] = []
        self.got_push = trio.Event()

    def on_message(self, conn: Connection, req: Request) -> None:
        self.pushes.append((req.request_id, req.body.consumerId, bytes(req.payload)))
        self.got_push.set()


class LookupService:
    """Answers lookups with the topic it was asked for; other requests as configured."""

    def __init__(self) -> None:
        self.held: list[tuple[Connection, int, str]] = []
        self.hold = 0  # answer in reverse order once this many lookups are held
        self.never_answer = False
        self.got_request = trio.Event()
        self.opened: list[Connection] = []
        self.closed: list[Connection] = []

    def on_lookup(self, conn: Connection, req: Request) -> None:
        topic = str(req.body.topic)
        self.got_request.set()
        if self.never_answer:
            return
        if self.hold:
            self.held.append((conn, req.request_id, topic))
            if len(self.held) == self.hold:
                for c, rid, t in reversed(self.held):
                    c.respond(rid, "lookupResult", {"topic": t, "partitions": len(t)})
                self.held.clear()
            return
        conn.respond(req.request_id, "lookupResult", {"topic": topic, "partitions": 0})

    def on_createProducer(self, conn: Connection, req: Request) -> None:
        raise SegmentNotFound(f"segment {req.body.producerId} is gone")

    def on_closeProducer(self, conn: Connection, req: Request) -> None:
        raise ValueError("boom")

    def on_send(self, conn: Connection, req: Request) -> None:
        # echoes the payload length back, proving the payload arrived whole
        conn.respond(
            req.request_id,
            "sendReceipt",
            {"producerId": req.body.producerId, "entryId": len(req.payload)},
            payload=bytes(req.payload),
        )

    def connection_opened(self, conn: Connection) -> None:
        self.opened.append(conn)

    def connection_closed(self, conn: Connection) -> None:
        self.closed.append(conn)


@asynccontextmanager
async def conn_pair(
    service: Any = None,
    client_handler: Any = None,
    *,
    frame_type: Any = BrokerFrame,
    client_stream_wrapper: Any = None,
) -> AsyncIterator[tuple[Connection, Connection]]:
    a, b = trio.testing.memory_stream_pair()
    client_stream = client_stream_wrapper(a) if client_stream_wrapper else a
    client = Connection(client_stream, frame_type, handler=client_handler, name="client")
    server = Connection(b, frame_type, handler=service, name="server")
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        await nursery.start(client.run)
        yield client, server
        nursery.cancel_scope.cancel()


def raw_frame(kind: str, fields: Any, request_id: int, frame_type: Any = BrokerFrame) -> bytes:
    message = build_message(frame_type, request_id, kind, fields)
    return b"".join(bytes(p) for p in encode_frame(message))


async def read_until_eof(stream: trio.abc.Stream) -> list[tuple[int, str, Any]]:
    """Every frame the peer sends until it closes: (requestId, kind, error code or None)."""
    decoder = FrameDecoder()
    out: list[tuple[int, str, Any]] = []
    with trio.fail_after(TIMEOUT):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return out
            if not data:
                return out
            decoder.feed(data)
            out.extend(map(summary, decoder.frames()))


def summary(frame: bytes | bytearray) -> tuple[int, str, Any]:
    """A received frame's (requestId, kind, (error code, message) or None)."""
    with BrokerFrame.from_bytes(frame[: capnp_message_size(frame)]) as msg:
        kind = msg.which()
        error = (msg.error.code, str(msg.error.message)) if kind == "error" else None
        return msg.requestId, kind, error


# ------------------------------------------------------------------ Connection


async def test_request_response() -> None:
    async with conn_pair(LookupService()) as (client, _server):
        with trio.fail_after(TIMEOUT):
            result = await client.request("lookup", {"topic": "t1"}, expect="lookupResult")
        assert result["topic"] == "t1"


async def test_ping_is_answered_without_a_handler() -> None:
    async with conn_pair(None) as (client, _server):
        with trio.fail_after(TIMEOUT):
            assert await client.request("ping", None, expect="ok") is None


async def test_pipelined_requests_matched_by_id_when_answered_out_of_order() -> None:
    service = LookupService()
    service.hold = 20
    async with conn_pair(service) as (client, _server):
        results: dict[int, dict[str, Any]] = {}

        async def ask(i: int) -> None:
            results[i] = await client.request(
                "lookup", {"topic": f"topic-{i:0{i % 5 + 1}d}"}, expect="lookupResult"
            )

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(ask, i)
    assert len(results) == 20
    for i, r in results.items():
        topic = f"topic-{i:0{i % 5 + 1}d}"
        assert r["topic"] == topic
        assert r["partitions"] == len(topic)


async def test_request_nowait_callbacks_all_fire() -> None:
    async with conn_pair(LookupService()) as (client, _server):
        got: dict[str, Any] = {}
        done = trio.Event()

        def cb(result: Any, error: BaseException | None) -> None:
            assert error is None
            got[result["topic"]] = result
            if len(got) == 100:
                done.set()

        ids = [client.request_nowait("lookup", {"topic": f"t{i}"}, cb) for i in range(100)]
        assert len(set(ids)) == 100 and 0 not in ids
        with trio.fail_after(TIMEOUT):
            await done.wait()
        assert set(got) == {f"t{i}" for i in range(100)}


async def test_typed_error_travels() -> None:
    async with conn_pair(LookupService()) as (client, server):
        with trio.fail_after(TIMEOUT), pytest.raises(SegmentNotFound) as info:
            await client.request("createProducer", {"producerId": 42, "topic": "t"})
        assert info.value.message == "segment 42 is gone"
        assert info.value.wire_code == SegmentNotFound.code
        # the connection is still usable
        with trio.fail_after(TIMEOUT):
            assert (await client.request("lookup", {"topic": "t"}))["topic"] == "t"
        assert not server.closed


async def test_handler_crash_becomes_an_error_answer() -> None:
    async with conn_pair(LookupService()) as (client, _server):
        with trio.fail_after(TIMEOUT), pytest.raises(PigeonError, match="boom"):
            await client.request("closeProducer", {"producerId": 1})
        with trio.fail_after(TIMEOUT):
            assert (await client.request("lookup", {"topic": "t"}))["topic"] == "t"


async def test_unserved_message_type_gets_unknown_message_type() -> None:
    async with conn_pair(LookupService()) as (client, server):
        with trio.fail_after(TIMEOUT), pytest.raises(UnknownMessageType, match="subscribe"):
            await client.request("subscribe", {"consumerId": 1, "topic": "t"})
        with trio.fail_after(TIMEOUT):
            assert (await client.request("lookup", {"topic": "t"}))["topic"] == "t"
        assert not server.closed and not client.closed


async def test_unknown_union_member_gets_unknown_message_type() -> None:
    """A newer peer sends a message kind this schema does not know: that request gets
    UnknownMessageType and the connection keeps working."""
    a, b = trio.testing.memory_stream_pair()
    server = Connection(b, BrokerFrame, handler=LookupService(), name="server")
    message = bytearray(build_message(BrokerFrame, 5, "ping", None))
    # root struct data section: requestId (word 0), then the union discriminant (u16)
    struct.pack_into("<H", message, 24, 999)
    decoder = FrameDecoder()

    async def next_frame() -> tuple[int, str, Any]:
        while True:
            for frame in decoder.frames():
                with BrokerFrame.from_bytes(frame) as msg:
                    kind = msg.which()
                    return msg.requestId, kind, msg.error.code if kind == "error" else None
            decoder.feed(await a.receive_some(65536))

    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        with trio.fail_after(TIMEOUT):
            await a.send_all(struct.pack("<I", len(message)) + message)
            assert await next_frame() == (5, "error", UnknownMessageType.code)
            await a.send_all(raw_frame("lookup", {"topic": "t"}, 6))
            assert await next_frame() == (6, "lookupResult", None)
        assert not server.closed
        nursery.cancel_scope.cancel()


async def test_wrong_answer_kind_is_a_protocol_error() -> None:
    async with conn_pair(LookupService()) as (client, _server):
        with trio.fail_after(TIMEOUT), pytest.raises(ProtocolError, match="lookupResult"):
            await client.request("lookup", {"topic": "t"}, expect="connected")


async def test_server_push_reaches_client_handler() -> None:
    recorder = Recorder()
    async with conn_pair(LookupService(), recorder) as (_client, server):
        server.send_nowait(
            "message",
            {"consumerId": 77, "entries": [{"segmentId": 1, "entryId": 2, "size": 5}]},
            payload=b"hello",
        )
        with trio.fail_after(TIMEOUT):
            await recorder.got_push.wait()
        assert recorder.pushes == [(0, 77, b"hello")]


async def test_push_without_handler_method_does_not_break_connection() -> None:
    async with conn_pair(LookupService(), Recorder()) as (client, server):
        server.send_nowait("closedByBroker", {"producerId": 1, "reason": "x"})
        with trio.fail_after(TIMEOUT):
            assert (await client.request("lookup", {"topic": "t"}))["topic"] == "t"


async def test_payload_round_trip_large_and_small() -> None:
    service = LookupService()
    async with conn_pair(service) as (client, _server):
        for size in (0, 1, 1000, 300_000):
            payload = bytes(range(256)) * (size // 256) + b"z" * (size % 256)

            def extract(body: Any, p: memoryview) -> tuple[int, bytes]:
                return body.entryId, bytes(p)

            with trio.fail_after(TIMEOUT):
                entry_id, echoed = await client.request(
                    "send",
                    {"producerId": 3},
                    payload=payload,
                    expect="sendReceipt",
                    extract=extract,
                )
            assert entry_id == size
            assert echoed == payload


async def test_peer_dies_mid_call_fails_pending_requests() -> None:
    service = LookupService()
    service.never_answer = True
    a, b = trio.testing.memory_stream_pair()
    client = Connection(a, BrokerFrame, name="client")
    server = Connection(b, BrokerFrame, handler=service, name="server")
    errors: list[BaseException] = []

    async def call(i: int) -> None:
        try:
            await client.request("lookup", {"topic": f"t{i}"})
        except ConnectionClosed as exc:
            errors.append(exc)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            async with trio.open_nursery() as server_nursery:
                await server_nursery.start(server.run)
                for i in range(5):
                    nursery.start_soon(call, i)
                await service.got_request.wait()
                server_nursery.cancel_scope.cancel()  # the server dies
    assert len(errors) == 5
    assert client.closed
    with pytest.raises(ConnectionClosed):
        await client.request("lookup", {"topic": "late"})


async def test_stream_broken_while_writing_fails_pending_requests() -> None:
    a, b = trio.testing.memory_stream_pair()
    client = Connection(a, BrokerFrame, name="client")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            await b.aclose()  # peer closes before we even write
            with pytest.raises(ConnectionClosed):
                await client.request("lookup", {"topic": "t"})


async def test_close_flushes_queued_frames() -> None:
    recorder = Recorder()
    async with conn_pair(LookupService(), recorder) as (client, server):
        for i in range(10):
            server.send_nowait("message", {"consumerId": i})
        server.close()
        with trio.fail_after(TIMEOUT):
            await client.closed_event.wait()
    assert [p[1] for p in recorder.pushes] == list(range(10))


async def test_write_coalescing_few_send_all_calls() -> None:
    a, b = trio.testing.memory_stream_pair()
    counting = CountingStream(a)
    server_service = LookupService()
    client = Connection(counting, BrokerFrame, name="client")
    server = Connection(b, BrokerFrame, handler=server_service, name="server")
    got: list[str] = []
    done = trio.Event()

    def cb(result: Any, error: BaseException | None) -> None:
        got.append(result["topic"])
        if len(got) == 500:
            done.set()

    # queue 500 small frames before the writer task has run at all
    for i in range(500):
        client.request_nowait("lookup", {"topic": f"t{i}"}, cb)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        await nursery.start(client.run)
        with trio.fail_after(TIMEOUT):
            await done.wait()
        nursery.cancel_scope.cancel()
    assert sorted(got) == sorted(f"t{i}" for i in range(500))
    assert len(counting.sends) <= 3, counting.sends
    assert sum(counting.sends) > 500 * 40


async def test_large_payload_is_not_joined_with_small_frames() -> None:
    a, b = trio.testing.memory_stream_pair()
    counting = CountingStream(a)
    client = Connection(counting, BookieFrame, name="client")
    big = b"x" * 200_000
    client.send_nowait("ping")
    client.send_nowait("addEntry", {"segmentId": 1, "entryId": 0}, payload=big)
    decoder = FrameDecoder()
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        frames: list[bytes] = []
        with trio.fail_after(TIMEOUT):
            while len(frames) < 2:
                decoder.feed(await b.receive_some(1 << 20))
                frames.extend(decoder.frames())
        nursery.cancel_scope.cancel()
    # the big payload went out as its own write, not copied into a joined buffer
    assert 200_000 in counting.sends
    assert frames[1][capnp_message_size(frames[1]) :] == big


def _socket_stream_pair(
    monkeypatch: pytest.MonkeyPatch, max_send: int | None = None
) -> tuple[trio.SocketStream, Any, list[Any]]:
    """A TCP-like stream pair whose sending end records the buffers of each vectored
    write, the writer task's (``sendmsg``) and a frame's written at once (``writev``), and
    writes at most ``max_send`` bytes per call, as a full socket buffer does."""
    a, b = trio.socket.socketpair()
    calls: list[Any] = []
    real = a.sendmsg

    def cut(buffers: list[Any]) -> list[Any]:
        calls.append(list(buffers))
        if max_send is not None:
            return [memoryview(b"".join(bytes(x) for x in buffers))[:max_send]]
        return buffers

    async def sendmsg(buffers: list[Any]) -> int:
        return await real(cut(buffers))

    real_writev = _connection._writev
    assert real_writev is not None

    def writev(fd: int, buffers: list[Any]) -> int:
        if fd != a.fileno():
            return real_writev(fd, buffers)
        return real_writev(fd, cut(buffers))

    a.sendmsg = sendmsg  # type: ignore[method-assign]
    monkeypatch.setattr(_connection, "_writev", writev)
    return trio.SocketStream(a), trio.SocketStream(b), calls


async def _receive_frames(stream: trio.abc.Stream, n: int) -> list[bytes | bytearray]:
    decoder = FrameDecoder()
    frames: list[bytes | bytearray] = []
    with trio.fail_after(TIMEOUT):
        while len(frames) < n:
            decoder.feed(await stream.receive_some(1 << 20))
            frames.extend(decoder.frames())
    return frames


async def test_tcp_frame_goes_out_in_one_vectored_write_without_copying_its_payload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, calls = _socket_stream_pair(monkeypatch)
    client = Connection(a, BookieFrame, name="client")
    payload = memoryview(b"p" * 1000)
    client.send_nowait("addEntry", {"segmentId": 1, "entryId": 0}, payload=payload)
    async with b, trio.open_nursery() as nursery:
        await nursery.start(client.run)
        (frame,) = await _receive_frames(b, 1)
        nursery.cancel_scope.cancel()
    # one call for the length prefix + message and the payload, which is not copied
    assert len(calls) == 1
    assert len(calls[0]) == 2 and calls[0][1] is payload
    assert frame[capnp_message_size(frame) :] == payload


async def test_tcp_partial_vectored_writes_resume_where_they_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, calls = _socket_stream_pair(monkeypatch, max_send=1000)
    client = Connection(a, BookieFrame, name="client")
    payloads = [bytes([i]) * (i * 700) for i in range(1, 8)]
    for i, payload in enumerate(payloads):
        client.send_nowait("addEntry", {"segmentId": 1, "entryId": i}, payload=payload)
    async with b, trio.open_nursery() as nursery:
        await nursery.start(client.run)
        frames = await _receive_frames(b, len(payloads))
        nursery.cancel_scope.cancel()
    assert [f[capnp_message_size(f) :] for f in frames] == payloads
    assert len(calls) > len(payloads)  # the writes were cut, and resumed


async def test_tcp_frame_queued_while_idle_leaves_before_the_writer_task_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a request's hop costs no trip through the scheduler: here the writer task never
    # even starts, and the frame reaches the peer
    a, b, calls = _socket_stream_pair(monkeypatch)
    client = Connection(a, BookieFrame, name="client")
    client.send_nowait("addEntry", {"segmentId": 1, "entryId": 0}, payload=b"now")
    async with a, b:
        (frame,) = await _receive_frames(b, 1)
    assert frame[capnp_message_size(frame) :] == b"now"
    assert len(calls) == 1


async def test_tcp_frames_of_one_burst_go_out_together_after_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, calls = _socket_stream_pair(monkeypatch)
    client = Connection(a, BookieFrame, name="client")
    async with b, trio.open_nursery() as nursery:
        await nursery.start(client.run)
        for i in range(10):
            client.send_nowait("addEntry", {"segmentId": 1, "entryId": i}, payload=bytes([i]))
        frames = await _receive_frames(b, 10)
        nursery.cancel_scope.cancel()
    assert [f[capnp_message_size(f) :] for f in frames] == [bytes([i]) for i in range(10)]
    # the first at once, the nine queued behind it in the writer's one write
    assert [len(c) for c in calls] == [2, 18]


async def test_tcp_frames_of_a_batch_go_out_in_one_write_at_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frames sent in a batch (a reader's dispatch, or frame_batch) on an idle TCP
    connection: one vectored write for them all at the batch's end, the writer task not
    woken (here it never runs)."""
    a, b, calls = _socket_stream_pair(monkeypatch)
    client = Connection(a, BookieFrame, name="client")
    with _connection.frame_batch():
        for i in range(10):
            client.send_nowait("addEntry", {"segmentId": 1, "entryId": i}, payload=bytes([i]))
        assert calls == []  # nothing written while the batch runs
    assert [len(c) for c in calls] == [20] and client.outgoing_bytes == 0
    async with a, b:
        frames = await _receive_frames(b, 10)
    assert [f[capnp_message_size(f) :] for f in frames] == [bytes([i]) for i in range(10)]


async def test_tcp_frames_of_a_batch_the_socket_did_not_take_go_to_the_writer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, calls = _socket_stream_pair(monkeypatch, max_send=500)
    client = Connection(a, BookieFrame, name="client")
    payloads = [bytes([i]) * 300 for i in range(6)]
    async with b, trio.open_nursery() as nursery:
        await nursery.start(client.run)
        with _connection.frame_batch():
            for i, payload in enumerate(payloads):
                client.send_nowait("addEntry", {"segmentId": 1, "entryId": i}, payload=payload)
        assert len(calls) == 1 and client.outgoing_bytes > 0  # the rest: the writer's
        frames = await _receive_frames(b, len(payloads))
        nursery.cancel_scope.cancel()
    assert [f[capnp_message_size(f) :] for f in frames] == payloads


async def test_tcp_frames_keep_their_order_while_the_writer_is_cut_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, _calls = _socket_stream_pair(monkeypatch, max_send=500)
    client = Connection(a, BookieFrame, name="client")
    payloads = [bytes([i]) * 900 for i in range(8)]
    async with b, trio.open_nursery() as nursery:
        await nursery.start(client.run)
        for i, payload in enumerate(payloads):
            client.send_nowait("addEntry", {"segmentId": 1, "entryId": i}, payload=payload)
            if i % 3 == 0:
                await trio.lowlevel.checkpoint()  # the writer is between two cut writes
        frames = await _receive_frames(b, len(payloads))
        nursery.cancel_scope.cancel()
    assert [f[capnp_message_size(f) :] for f in frames] == payloads


async def test_tcp_payload_of_several_buffers_goes_out_unjoined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a batch of entries, each its own object: the frame carries them back to back, and
    # the vectored write is handed the very objects (nothing joined them on the way)
    a, b, calls = _socket_stream_pair(monkeypatch)
    client = Connection(a, BookieFrame, name="client")
    entries = [b"first", memoryview(b"second" * 100), bytearray(b"third")]
    client.send_nowait("addEntry", {"segmentId": 1, "entryId": 0}, payload=entries)
    async with b, trio.open_nursery() as nursery:
        await nursery.start(client.run)
        (frame,) = await _receive_frames(b, 1)
        nursery.cancel_scope.cancel()
    assert len(calls) == 1 and len(calls[0]) == 4
    assert all(sent is entry for sent, entry in zip(calls[0][1:], entries, strict=True))
    assert frame[capnp_message_size(frame) :] == b"".join(entries)


async def test_large_frames_over_tcp_are_received_straight_into_their_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Frames of 3 MB and 1 MB between small ones, both ways over a real socket pair: the
    # rest of each large frame is read into its own buffer, byte for byte.
    received_into: list[int] = []
    real = _connection._receive_socket_into

    async def counting(sock: Any, space: memoryview, wait_first: bool) -> int:
        n = await real(sock, space, wait_first)
        received_into.append(n)
        return n

    monkeypatch.setattr(_connection, "_receive_socket_into", counting)
    a, b = trio.socket.socketpair()
    client = Connection(trio.SocketStream(a), BrokerFrame, name="client")
    server = Connection(trio.SocketStream(b), BrokerFrame, handler=LookupService(), name="server")

    def extract(body: Any, p: memoryview) -> tuple[int, bytes]:
        return body.entryId, bytes(p)

    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        await nursery.start(client.run)
        for size in (3_000_000, 10, 1_000_000, 70_000, 0, 3_000_001):
            payload = bytes((i * 7 + size) & 0xFF for i in range(256)) * (size // 256)
            payload += b"t" * (size % 256)
            with trio.fail_after(TIMEOUT):
                entry_id, echoed = await client.request(
                    "send", {"producerId": 3}, payload=payload, expect="sendReceipt",
                    extract=extract,
                )  # fmt: skip
            assert entry_id == size and echoed == payload
        nursery.cancel_scope.cancel()
    assert sum(received_into) > 3_000_000  # the direct path carried the large frames

"""Bad input on the wire, case by case: a malformed body gets a typed answer and one log
line, a bug of ours gets a typed internal error and a traceback, and a client that
dialled the wrong port (HTTP, TLS, Kafka, a bookie's port, an HTTP port) is told so."""

from __future__ import annotations

import logging
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import capnp  # type: ignore[import-untyped]
import pytest
import trio
import trio.testing
from test_connection import summary

from pigeon.core._connection import TLS_REFUSAL_ALERT
from pigeon.core._framing import (
    FrameDecoder,
    build_message,
    encode_frame,
    sniff_foreign_protocol,
)
from pigeon.core._memnet import MemoryNetwork
from pigeon.core._rpc import Connection, Request, connect_tcp, serve_tcp
from pigeon.core._schema import BodyChecker, BookieFrame, BrokerFrame, body_checker
from pigeon.core.errors import (
    CorruptFrame,
    InternalError,
    InvalidArgument,
    MalformedRequest,
    ProtocolError,
    ProtocolVersionMismatch,
    Timeout,
)

TIMEOUT = 5.0


def _frame(kind: str, fields: Any, request_id: int, frame_type: Any = BrokerFrame) -> bytes:
    message = build_message(frame_type, request_id, kind, fields)
    return b"".join(bytes(p) for p in encode_frame(message))


def _subscribe(sub_type: int) -> bytes:
    """A subscribe frame whose subType holds the raw value ``sub_type``."""
    good = build_message(
        BrokerFrame, 7, "subscribe", {"consumerId": 1, "topic": "t", "subscription": "s"}
    )
    marked = build_message(
        BrokerFrame,
        7,
        "subscribe",
        {"consumerId": 1, "topic": "t", "subscription": "s", "subType": "keyShared"},
    )
    (at,) = [i for i in range(len(good)) if good[i] != marked[i]]
    data = bytearray(marked)
    struct.pack_into("<H", data, at, sub_type)
    return struct.pack("<I", len(data)) + bytes(data)


class Service:
    def __init__(self) -> None:
        self.subscribed: list[str] = []

    def on_subscribe(self, conn: Connection, req: Request) -> None:
        self.subscribed.append(str(req.body.subType))
        conn.respond(req.request_id, "subscribed", {"topic": str(req.body.topic)})

    def on_lookup(self, conn: Connection, req: Request) -> None:
        topic = str(req.body.topic)
        if topic == "bug":
            raise KeyError("missing")  # a bug of ours
        conn.respond(req.request_id, "lookupResult", {"topic": topic})


async def _answers(stream: trio.abc.Stream, count: int) -> list[tuple[int, str, Any]]:
    decoder = FrameDecoder()
    out: list[tuple[int, str, Any]] = []
    with trio.fail_after(TIMEOUT):
        while len(out) < count:
            data = await stream.receive_some(65536)
            assert data, f"connection closed after {out}"
            decoder.feed(data)
            out.extend(map(summary, decoder.frames()))
    return out


@asynccontextmanager
async def served(service: Any) -> AsyncIterator[trio.abc.Stream]:
    client, server_stream = trio.testing.memory_stream_pair()
    server = Connection(server_stream, BrokerFrame, handler=service, name="srv", serving=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        yield client
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ malformed bodies


async def test_unknown_enum_value_is_a_malformed_request_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = Service()
    async with served(service) as client:
        await client.send_all(_subscribe(9))
        await client.send_all(_frame("lookup", {"topic": "after"}, 8))
        answers = await _answers(client, 2)
    (rid, kind, (code, message)), after = answers
    assert (rid, kind, code) == (7, "error", MalformedRequest.code)
    assert message == "malformed subscribe: subType: enum value 9 is unknown to this node"
    assert issubclass(MalformedRequest, InvalidArgument) and not MalformedRequest.retriable
    assert service.subscribed == []  # the handler never ran
    assert after == (8, "lookupResult", None)  # and the connection still serves
    lines = [r for r in caplog.records if r.name == "pigeon.core._rpc"]
    assert len(lines) == 1
    assert lines[0].levelno == logging.WARNING and lines[0].exc_info is None
    assert "kind=subscribe" in lines[0].getMessage() and "subType" in lines[0].getMessage()


async def test_known_enum_values_still_pass() -> None:
    service = Service()
    async with served(service) as client:
        await client.send_all(_subscribe(3))
        assert (await _answers(client, 1))[0][1] == "subscribed"
    assert service.subscribed == ["keyShared"]


async def test_text_that_is_not_utf8_names_the_field() -> None:
    frame = bytearray(_frame("lookup", {"topic": "abc"}, 3))
    at = frame.index(b"abc")
    frame[at] = 0xFF
    async with served(Service()) as client:
        await client.send_all(bytes(frame))
        [(_rid, _kind, (code, message))] = await _answers(client, 1)
    assert code == MalformedRequest.code
    assert message == "malformed lookup: topic: text is not valid UTF-8"


async def test_a_bug_in_a_handler_is_a_typed_internal_error_with_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with served(Service()) as client:
        await client.send_all(_frame("lookup", {"topic": "bug"}, 4))
        await client.send_all(_frame("lookup", {"topic": "fine"}, 5))
        (_rid, _kind, (code, message)), after = await _answers(client, 2)
    assert code == InternalError.code
    assert "KeyError" in message and "lookup" in message
    assert after == (5, "lookupResult", None)
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.exc_info is not None


async def test_malformed_error_answer_fails_only_that_request() -> None:
    a, b = trio.testing.memory_stream_pair()
    client = Connection(a, BrokerFrame, name="client")
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        results: list[Any] = []
        both = trio.Event()

        def record(value: Any) -> None:
            results.append(value)
            if len(results) == 2:
                both.set()

        client.request_nowait("lookup", {"topic": "t"}, lambda r, e: record(e))
        client.request_nowait("lookup", {"topic": "u"}, lambda r, e: record(r))
        bad = bytearray(build_message(BrokerFrame, 1, "error", {"code": 300, "message": "xyz"}))
        bad[bad.index(b"xyz")] = 0xFE
        await b.send_all(struct.pack("<I", len(bad)) + bytes(bad))
        await b.send_all(_frame("lookupResult", {"topic": "u"}, 2))
        with trio.fail_after(TIMEOUT):
            await both.wait()
        assert isinstance(results[0], CorruptFrame) and "UTF-8" in results[0].message
        assert results[1]["topic"] == "u"
        assert not client.closed
        nursery.cancel_scope.cancel()


def test_checker_reads_every_kind_of_field(tmp_path: Path) -> None:
    """Lists of enums and of lists, groups, unions: the generic paths of BodyChecker."""
    schema_file = tmp_path / "fuzz.capnp"
    schema_file.write_text(
        """@0xd1a2b3c4d5e6f708;
enum Color { red @0; green @1; }
struct Inner { name @0 :Text; colors @1 :List(Color); }
struct Body {
  inners @0 :List(Inner);
  nested @1 :List(List(Text));
  grp :group { label @2 :Text; }
  union { a @3 :Text; b @4 :Inner; }
}
struct Root { requestId @0 :UInt64; union { body @1 :Body; ping @2 :Void; } }
"""
    )
    module = capnp.load(str(schema_file))
    checker = BodyChecker(module.Root)
    fields = {
        "inners": [{"name": "n", "colors": ["green", "red"]}],
        "nested": [["x", "yz"], []],
        "grp": {"label": "g"},
        "b": {"name": "in", "colors": ["red"]},
    }
    good = build_message(module.Root, 1, "body", fields)
    with module.Root.from_bytes(good) as msg:
        assert checker.body(msg, "body").grp.label == "g"

    def bad(original: bytes, replacement: bytes) -> str:
        data = bytearray(good)
        at = data.index(original)
        data[at : at + len(replacement)] = replacement
        with module.Root.from_bytes(bytes(data)) as msg, pytest.raises(MalformedRequest) as exc:
            checker.body(msg, "body")
        return str(exc.value)

    assert bad(b"yz", b"\xff\xfe").endswith("nested[0][1]: text is not valid UTF-8")
    assert bad(b"in\x00", b"\xc3\x00").startswith("malformed body: b.name:")
    assert bad(b"g\x00", b"\xff").endswith("grp.label: text is not valid UTF-8")
    # the first list of colours holds green (1), red (0) as u16: make green 7
    other = build_message(
        module.Root, 1, "body", {**fields, "inners": [{"name": "n", "colors": ["red", "red"]}]}
    )
    (at,) = [i for i in range(len(good)) if good[i] != other[i]]
    data = bytearray(good)
    data[at] = 7
    with module.Root.from_bytes(bytes(data)) as msg, pytest.raises(MalformedRequest) as exc:
        checker.body(msg, "body")
    assert "inners[0].colors[0]: enum value 7" in str(exc.value)


def test_checkers_are_shared_and_cover_both_protocols() -> None:
    assert body_checker(BrokerFrame) is body_checker(BrokerFrame)
    for frame_type in (BrokerFrame, BookieFrame):
        message = build_message(frame_type, 1, "ping", None)
        with frame_type.from_bytes(message) as msg:
            assert body_checker(frame_type).body(msg, "ping") is None


# ------------------------------------------------------------------ wrong ports


@asynccontextmanager
async def tcp_server(frame_type: Any) -> AsyncIterator[tuple[trio.Nursery, tuple[str, int]]]:
    async with trio.open_nursery() as nursery:
        address = await nursery.start(
            lambda task_status: serve_tcp(
                Service(), frame_type, server_name="srv", task_status=task_status
            )
        )
        yield nursery, address
        nursery.cancel_scope.cancel()


async def _raw_exchange(address: tuple[str, int], data: bytes) -> bytes:
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(data)
    out = b""
    with trio.fail_after(TIMEOUT):
        while chunk := await stream.receive_some(65536):
            out += chunk
    await stream.aclose()
    return out


@pytest.mark.parametrize(("frame_type", "role"), [(BrokerFrame, "broker"), (BookieFrame, "bookie")])
async def test_http_client_on_a_native_port_gets_a_readable_400(
    caplog: pytest.LogCaptureFixture, frame_type: Any, role: str
) -> None:
    async with tcp_server(frame_type) as (_nursery, address):
        answer = await _raw_exchange(address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert f"PigeonMQ {role} protocol".encode() in body
    assert f"Content-Length: {len(body)}".encode() in head
    [line] = [r for r in caplog.records if r.name == "pigeon.core._rpc"]
    assert line.levelno == logging.WARNING and "HTTP request" in line.getMessage()


@pytest.mark.parametrize(
    ("data", "named", "answer"),
    [
        # a TLS client is answered a fatal protocol_version alert: it fails at once
        (
            bytes.fromhex("16030100a5010000a10303") + b"\0" * 40,
            "TLS handshake",
            TLS_REFUSAL_ALERT,
        ),
        # closed: nothing a Kafka client could parse
        (
            struct.pack(">ihhih", 19, 18, 3, 1, 6) + b"client" + b"\0",
            "Kafka request (api key 18)",
            b"",
        ),
    ],
    ids=["tls", "kafka"],
)
async def test_other_protocols_are_named_in_one_line_and_closed(
    caplog: pytest.LogCaptureFixture, data: bytes, named: str, answer: bytes
) -> None:
    assert sniff_foreign_protocol(data) is not None
    async with tcp_server(BrokerFrame) as (_nursery, address):
        assert await _raw_exchange(address, data) == answer
    [line] = [r for r in caplog.records if r.name == "pigeon.core._rpc"]
    assert line.levelno == logging.WARNING and named in line.getMessage()
    assert line.exc_info is None


@pytest.mark.parametrize(
    ("client", "server", "expected"),
    [
        (BrokerFrame, BookieFrame, "is a PigeonMQ bookie port, not a broker port"),
        (BookieFrame, BrokerFrame, "is a PigeonMQ broker port, not a bookie port"),
    ],
)
async def test_client_of_the_other_node_kind_is_refused_at_the_handshake(
    client: Any, server: Any, expected: str
) -> None:
    async with tcp_server(server) as (nursery, (host, port)):
        with trio.fail_after(TIMEOUT), pytest.raises(ProtocolError) as exc:
            await connect_tcp(host, port, client, nursery)
    assert expected in str(exc.value)
    assert str(exc.value).startswith(f"{host}:{port}: ")


async def test_same_kind_handshake_still_works() -> None:
    async with tcp_server(BookieFrame) as (nursery, (host, port)):
        with trio.fail_after(TIMEOUT):
            conn, info = await connect_tcp(host, port, BookieFrame, nursery)
        assert info["frameType"] == "BookieFrame"
        conn.close()


async def test_native_client_on_an_http_port_that_answers() -> None:
    async def http_server(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, http_server, 0)
        port = listeners[0].socket.getsockname()[1]
        with trio.fail_after(TIMEOUT), pytest.raises(ProtocolError) as exc:
            await connect_tcp("127.0.0.1", port, BrokerFrame, nursery)
        nursery.cancel_scope.cancel()
    assert "answered with an HTTP response" in str(exc.value)
    assert "admin" in str(exc.value)


async def test_native_client_on_a_silent_port_times_out_with_a_clear_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryNetwork()

    async def silent(stream: trio.abc.Stream) -> None:
        await trio.sleep_forever()  # e.g. an HTTP server waiting for a request line

    with network.installed():
        async with trio.open_nursery() as nursery:
            network.listen("127.0.0.1", 8080, silent, nursery)
            with pytest.raises(Timeout) as exc:
                await connect_tcp("127.0.0.1", 8080, BrokerFrame, nursery, connect_timeout=3)
            nursery.cancel_scope.cancel()
    assert "did not answer the PigeonMQ handshake within 3s" in str(exc.value)
    assert "broker port" in str(exc.value)


async def test_native_client_on_an_admin_port_is_told_the_service_url_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # an HTTP server waits for a request line, so it never answers the connect frame; the
    # client asks it over HTTP after 1 s of silence and names the port to use instead
    network = MemoryNetwork()
    health = (
        b'{"status":"ok","checks":{},"brokers":[{"service_url":"pigeon://127.0.0.1:6650",'
        b'"http_url":"http://127.0.0.1:8080"}]}'
    )

    async def admin(stream: trio.abc.Stream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            data += chunk
        if not data.startswith(b"GET "):
            await trio.sleep_forever()
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(health), health)
        )
        await stream.aclose()

    with network.installed():
        async with trio.open_nursery() as nursery:
            network.listen("127.0.0.1", 8080, admin, nursery)
            start = trio.current_time()
            with pytest.raises(ProtocolError) as exc:
                await connect_tcp("127.0.0.1", 8080, BrokerFrame, nursery, connect_timeout=10)
            nursery.cancel_scope.cancel()
    assert trio.current_time() - start < 3  # not the 10 s connect timeout
    assert "port 8080 is a PigeonMQ broker's admin HTTP port" in str(exc.value)
    assert "use pigeon://127.0.0.1:6650" in str(exc.value)


def test_sniffing_does_not_mistake_pigeon_frames() -> None:
    for frame_type in (BrokerFrame, BookieFrame):
        for kind in frame_type.schema.union_fields:
            message = build_message(frame_type, 1, kind, {} if kind not in ("ok", "ping") else None)
            assert sniff_foreign_protocol(struct.pack("<I", len(message)) + message) is None


# ------------------------------------------------------------------ handshake


async def _handshake_exchange(frames: list[bytes]) -> tuple[list[tuple[int, str, Any]], bool]:
    """Frames sent to a fresh serve_tcp connection: what came back, and whether it closed."""
    async with tcp_server(BrokerFrame) as (_nursery, address):
        stream = await trio.open_tcp_stream(*address)
        for frame in frames:
            await stream.send_all(frame)
        decoder = FrameDecoder()
        out: list[tuple[int, str, Any]] = []
        closed = False
        with trio.move_on_after(1.0):
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    closed = True
                    break
                decoder.feed(data)
                for request_id, kind, error in map(summary, decoder.frames()):
                    out.append((request_id, kind, error and error[0]))
        await stream.aclose()
    return out, closed


CONNECT = {"protocolVersion": 1, "clientName": "c", "frameType": "BrokerFrame"}


async def test_a_second_connect_is_refused_and_the_connection_kept() -> None:
    frames = [
        _frame("connect", CONNECT, 1),
        _frame("connect", CONNECT, 2),
        _frame("lookup", {"topic": "t"}, 3),
    ]
    out, closed = await _handshake_exchange(frames)
    assert out == [
        (1, "connected", None),
        (2, "error", ProtocolError.code),
        (3, "lookupResult", None),
    ]
    assert not closed


async def test_a_refused_handshake_without_request_id_is_told_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    out, closed = await _handshake_exchange(
        [_frame("connect", {**CONNECT, "protocolVersion": 0}, 0)]
    )
    assert out == [(0, "error", ProtocolVersionMismatch.code)]
    assert closed
    [line] = [r for r in caplog.records if r.name == "pigeon.core._rpc"]
    assert line.levelno == logging.WARNING and "protocol version 0" in line.getMessage()


async def test_an_error_answer_survives_unread_input_from_the_peer() -> None:
    """The refused peer had pipelined more bytes: closing must not reset the connection
    (and lose the error) before the peer read it."""
    junk = _frame("lookup", {"topic": "x" * 60_000}, 2) * 8
    out, closed = await _handshake_exchange([_frame("lookup", {"topic": "t"}, 1) + junk])
    assert out == [(1, "error", ProtocolError.code)]
    assert closed


def _first_malformed(message: bytes, kind: str, field: str) -> bytes:
    """The first one-bit flip of ``message`` whose frame decodes but whose ``field`` does
    not (found by trying them in order: deterministic)."""
    for at in range(8, len(message)):
        for bit in range(8):
            data = bytearray(message)
            data[at] ^= 1 << bit
            try:
                with BrokerFrame.from_bytes(bytes(data)) as msg:
                    if msg.which() != kind:
                        continue
                    bad = body_checker(BrokerFrame).check(msg, kind)
            except Exception:
                continue
            if bad is not None and f": {field}" in bad.message:
                return bytes(data)
    raise AssertionError("no such flip")


async def test_a_client_classifies_a_malformed_push_when_its_handler_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Clients read pushes lazily (no up-front check); a handler failing on a malformed
    push still gives one WARNING line, not a traceback, and the connection lives on."""
    seen: list[int] = []
    got = trio.Event()

    class Pushes:
        def on_message(self, conn: Connection, req: Request) -> None:
            seen.extend(e.entryId for e in req.body.entries)
            got.set()

    a, b = trio.testing.memory_stream_pair()
    client = Connection(a, BrokerFrame, handler=Pushes(), name="client")
    push = {"consumerId": 1, "entries": [{"segmentId": 1, "entryId": 5, "ackedIndexes": [1]}]}
    good = build_message(BrokerFrame, 0, "message", push)
    bad = _first_malformed(good, "message", "entries")
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await b.send_all(struct.pack("<I", len(bad)) + bytes(bad))
        await b.send_all(struct.pack("<I", len(good)) + good)
        with trio.fail_after(TIMEOUT):
            await got.wait()
        nursery.cancel_scope.cancel()
    assert seen == [5]
    lines = [r for r in caplog.records if r.name == "pigeon.core._rpc"]
    assert [r.levelno for r in lines] == [logging.WARNING]
    assert lines[0].exc_info is None and "malformed request" in lines[0].getMessage()

"""Fuzzing a real bookie (served over loopback from a background thread) with bit-flipped
valid requests of every kind it serves, random bytes and truncated frames.

Every answer must be a valid answer or a typed error, never an internal one; no ERROR
line is logged; after each mutated frame the same connection still answers a valid
``segmentInfo`` unless it was closed with an error first (or the mutated length prefix
left the bookie waiting for bytes).  The entries of a segment written before the fuzz are
all read back, byte for byte, after it: the fuzzed requests aim at other segments, whose
ids are far (in bits) from the protected one, so that no few bit flips reach it.

``PIGEON_FUZZ_EXAMPLES=500`` for a longer, randomized run (default: 60, derandomized).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import trio
from hypothesis import strategies as st

from pigeon.bookie import BookieConfig, BookieServer
from pigeon.core._framing import (
    FrameDecoder,
    build_message,
    capnp_message_size,
    encode_frame,
    sniff_foreign_protocol,
)
from pigeon.core._schema import PROTOCOL_VERSION, BookieFrame
from pigeon.core.errors import InternalError, PigeonError

FUZZ_EXAMPLES = os.environ.get("PIGEON_FUZZ_EXAMPLES")
FUZZ = hypothesis.settings(
    max_examples=int(FUZZ_EXAMPLES or 60),
    deadline=None,
    derandomize=FUZZ_EXAMPLES is None,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)
GIB = 1 << 30
PROTECTED = 0x5A5A5A5A  # many bits away from every id below
READ, FENCE, DELETE, ADD = 0x1100, 0x2200, 0x4400, 0x8800
PROBE_ID = 2**62 + 0x5A5A5A5A5A
ANSWERS = {"connected", "error", "ok", "addResponse", "readResponse", "segmentState"}


def entry(segment_id: int, entry_id: int) -> bytes:
    return f"entry {segment_id}:{entry_id} ".encode() * 8


#: a valid request of every kind the bookie serves; (kind, fields, payload)
REQUESTS: list[tuple[str, dict[str, Any] | None, bytes | None]] = [
    ("ping", None, None),
    ("connect", {"protocolVersion": PROTOCOL_VERSION, "clientName": "again"}, None),
    ("addEntry", {"segmentId": ADD, "entryId": 0, "lac": -1}, entry(ADD, 0)),
    (
        "addEntry",
        {"segmentId": READ, "entryId": 1, "lac": 0, "resend": True},
        entry(READ, 1),
    ),
    (
        "addEntry",
        {"segmentId": READ, "entryId": 2, "lac": 1, "recovery": True},
        entry(READ, 2),
    ),
    (
        "readEntries",
        {"segmentId": READ, "firstEntryId": 0, "lastEntryId": 3, "maxBytes": 0, "maxCount": 0},
        None,
    ),
    ("readLac", {"segmentId": READ}, None),
    ("segmentInfo", {"segmentId": READ}, None),
    ("fence", {"segmentId": FENCE}, None),
    ("deleteSegment", {"segmentId": DELETE}, None),
]


def test_every_request_kind_is_fuzzed() -> None:
    served = set(BookieFrame.schema.union_fields) - ANSWERS
    assert {kind for kind, _f, _p in REQUESTS} == served


def _frame(kind: str, fields: Any, request_id: int, payload: bytes | None = None) -> bytes:
    message = build_message(BookieFrame, request_id, kind, fields)
    return b"".join(bytes(p) for p in encode_frame(message, payload))


class RawConnection:
    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.decoder = FrameDecoder()
        self.frames: list[tuple[int, str, int | None, Any]] = []
        self.closed = False

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _receive(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return
        self.decoder.feed(data)
        for frame in self.decoder.frames():
            size = capnp_message_size(frame)
            with BookieFrame.from_bytes(frame[:size]) as msg:
                kind = msg.which()
                code = msg.error.code if kind == "error" else None
                body = msg.readResponse.to_dict() if kind == "readResponse" else None
                self.frames.append((msg.requestId, kind, code, (body, frame[size:])))

    def wait_for(self, request_id: int, timeout: float = 10.0) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while True:
            for frame in self.frames:
                if frame[0] == request_id:
                    return frame
            left = deadline - time.monotonic()
            if self.closed or left <= 0:
                raise TimeoutError(f"no answer to {request_id}: {self.frames}")
            self._receive(left)

    def request(self, kind: str, fields: Any, request_id: int, payload: Any = None) -> Any:
        self.send(_frame(kind, fields, request_id, payload))
        answer = self.wait_for(request_id)
        assert answer[1] != "error", (kind, answer)
        return answer

    def connect(self) -> None:
        fields = {"protocolVersion": PROTOCOL_VERSION, "clientName": "fz"}
        self.request("connect", {**fields, "frameType": "BookieFrame"}, 1)
        self.frames.clear()


class BookieThread:
    """A bookie in its own trio run on a background thread (sync tests talk to it)."""

    def __init__(self, data_dir: Path) -> None:
        self.config = BookieConfig(data_dir=str(data_dir), port=0, fsync="never")
        self.server: BookieServer | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fuzz-bookie", daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by start()/stop()
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self.server = BookieServer(self.config)
        self.server.disk_usage = lambda: (100 * GIB, 50 * GIB)  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            self._cancel = nursery.cancel_scope
            await nursery.start(self.server.run)
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()

    def start(self) -> BookieThread:
        self._thread.start()
        assert self._ready.wait(30), "bookie did not start"
        assert self._error is None, self._error
        return self

    def stop(self) -> None:
        if self._token is not None and self._cancel is not None:
            trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
        self._thread.join(30)
        assert not self._thread.is_alive()
        assert self._error is None, self._error

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        host, port = self.server.advertised.rsplit(":", 1)
        return host, int(port)


class ErrorLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)


@pytest.fixture(scope="module")
def bookie(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BookieThread]:
    server = BookieThread(tmp_path_factory.mktemp("fuzz-bookie")).start()
    try:
        conn = RawConnection(server.address)
        conn.connect()
        for eid in range(10):
            fields = {"segmentId": PROTECTED, "entryId": eid, "lac": eid - 1}
            conn.request("addEntry", fields, 10 + eid, entry(PROTECTED, eid))
        for eid in range(3):
            fields = {"segmentId": READ, "entryId": eid, "lac": eid - 1}
            conn.request("addEntry", fields, 30 + eid, entry(READ, eid))
        conn.close()
        yield server
    finally:
        server.stop()


@pytest.fixture
def error_lines() -> Iterator[ErrorLines]:
    handler = ErrorLines()
    logger = logging.getLogger("pigeon")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def check_protected(bookie: BookieThread) -> None:
    conn = RawConnection(bookie.address)
    try:
        conn.connect()
        fields = {"segmentId": PROTECTED, "firstEntryId": 0, "lastEntryId": 9}
        _rid, _kind, _code, (body, payload) = conn.request("readEntries", fields, 5)
        sizes = [e["size"] for e in body["entries"]]
        assert [e["entryId"] for e in body["entries"]] == list(range(10))
        got, at = [], 0
        for size in sizes:
            got.append(payload[at : at + size])
            at += size
        assert got == [entry(PROTECTED, eid) for eid in range(10)]
        state = conn.request("segmentInfo", {"segmentId": PROTECTED}, 6)
        assert state[1] == "segmentState"
    finally:
        conn.close()


def exchange(bookie: BookieThread, data: bytes) -> None:
    conn = RawConnection(bookie.address)
    try:
        conn.connect()
        conn.send(data)
        probe_frame = _frame("segmentInfo", {"segmentId": READ}, PROBE_ID)
        waits = server_waits(data + probe_frame)
        if not conn.closed:
            try:
                conn.send(probe_frame)
            except OSError:
                conn.closed = True
        try:
            probe = conn.wait_for(PROBE_ID, timeout=0.05 if waits else 10.0)
        except TimeoutError:
            probe = None
        for request_id, kind, code, _body in conn.frames:
            assert kind in ANSWERS, kind
            if kind == "error":
                assert code in PigeonError._by_code, f"untyped error code {code}"
                assert code != InternalError.code, f"internal error answering {request_id}"
        if probe is not None:
            assert probe[1] == "segmentState", probe
        elif conn.closed:
            said_why = any(kind == "error" for _rid, kind, _c, _b in conn.frames)
            assert said_why or sniff_foreign_protocol(data) is not None, conn.frames
        else:  # neither answered nor closed: only while a frame is incomplete
            assert waits, f"probe unanswered: {conn.frames}"
    finally:
        conn.close()


def server_waits(data: bytes) -> bool:
    """Whether a server framing ``data`` is left waiting for the rest of a frame (a
    mutated length prefix promised more bytes than were sent)."""
    decoder = FrameDecoder()
    decoder.feed(data)
    try:
        for _frame_bytes in decoder.frames():
            pass
    except PigeonError:
        return False  # it refuses the stream instead
    return decoder.buffered > 0


@st.composite
def flipped_requests(draw: st.DrawFn, *, keep_prefix: bool) -> bytes:
    kind, fields, payload = draw(st.sampled_from(REQUESTS))
    frame = bytearray(_frame(kind, fields, draw(st.integers(2**16, 2**20)), payload))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(4 if keep_prefix else 0, len(frame) - 1))
        frame[at] ^= 1 << draw(st.integers(0, 7))
    return bytes(frame)


def test_bit_flipped_requests_of_every_kind(bookie: BookieThread, error_lines: ErrorLines) -> None:
    @FUZZ
    @hypothesis.given(data=flipped_requests(keep_prefix=True))
    def run(data: bytes) -> None:
        exchange(bookie, data)

    run()
    assert not error_lines.records, [r.getMessage() for r in error_lines.records]
    check_protected(bookie)


def test_bit_flips_anywhere_random_bytes_and_truncated_frames(
    bookie: BookieThread, error_lines: ErrorLines
) -> None:
    @st.composite
    def truncated(draw: st.DrawFn) -> bytes:
        kind, fields, payload = draw(st.sampled_from(REQUESTS))
        frame = _frame(kind, fields, draw(st.integers(2**16, 2**20)), payload)
        cut = draw(st.integers(5, len(frame) - 1))
        if draw(st.booleans()):
            return struct.pack("<I", cut - 4) + frame[4:cut]
        return frame[:cut]

    junk = st.binary(min_size=1, max_size=200)
    framed_junk = junk.map(lambda b: struct.pack("<I", len(b)) + b)

    @FUZZ
    @hypothesis.given(data=flipped_requests(keep_prefix=False) | truncated() | junk | framed_junk)
    def run(data: bytes) -> None:
        exchange(bookie, data)

    run()
    assert not error_lines.records, [r.getMessage() for r in error_lines.records]
    check_protected(bookie)

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

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from pigeon.bookie import BookieConfig, BookieServer
from pigeon.core._schema import PROTOCOL_VERSION, BookieFrame
from pigeon.core.testing import fuzz

FUZZ = fuzz.fuzz_settings("PIGEON_FUZZ_EXAMPLES", 60)
GIB = 1 << 30
PROTECTED = 0x5A5A5A5A  # many bits away from every id below
READ, FENCE, DELETE, ADD = 0x1100, 0x2200, 0x4400, 0x8800
PROBE_ID = 2**62 + 0x5A5A5A5A5A
ANSWERS = {"connected", "error", "ok", "addResponse", "readResponse", "segmentState"}


def entry(segment_id: int, entry_id: int) -> bytes:
    return f"entry {segment_id}:{entry_id} ".encode() * 8


#: a valid request of every kind the bookie serves; (kind, fields, payload)
REQUESTS: list[fuzz.Request] = [
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


def _read_body(msg: Any, payload: bytes) -> Any:
    """What a test keeps of a frame: a readResponse's body and payload."""
    return (msg.readResponse.to_dict() if msg.which() == "readResponse" else None, payload)


def connect(address: tuple[str, int]) -> fuzz.RawConnection:
    """A raw connection to the bookie, past its handshake."""
    conn = fuzz.RawConnection(address, BookieFrame, _read_body)
    fields = {"protocolVersion": PROTOCOL_VERSION, "clientName": "fz"}
    conn.request("connect", {**fields, "frameType": "BookieFrame"}, 1)
    conn.frames.clear()
    return conn


class BookieThread(fuzz.ServerThread):
    """A bookie in its own trio run on a background thread (sync tests talk to it)."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__("fuzz-bookie")
        self.config = BookieConfig(data_dir=str(data_dir), port=0, fsync="never")
        self.server: BookieServer | None = None

    async def serve(self, nursery: trio.Nursery) -> None:
        self.server = BookieServer(self.config)
        self.server.disk_usage = lambda: (100 * GIB, 50 * GIB)  # type: ignore[method-assign]
        await nursery.start(self.server.run)

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        host, port = self.server.advertised.rsplit(":", 1)
        return host, int(port)


@pytest.fixture(scope="module")
def bookie(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BookieThread]:
    server = BookieThread(tmp_path_factory.mktemp("fuzz-bookie")).start()
    try:
        conn = connect(server.address)
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


def check_protected(bookie: BookieThread) -> None:
    conn = connect(bookie.address)
    try:
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
    conn = connect(bookie.address)
    try:
        probe = ("segmentInfo", {"segmentId": READ})
        fuzz.check_exchange(
            conn, data, probe, PROBE_ID, answers=ANSWERS, probe_answer="segmentState"
        )
    finally:
        conn.close()


def test_bit_flipped_requests_of_every_kind(
    bookie: BookieThread, error_lines: fuzz.ErrorLines
) -> None:
    hostile = fuzz.flipped_frames(BookieFrame, REQUESTS, keep_prefix=True)
    fuzz.run_fuzz(FUZZ, hostile, functools.partial(exchange, bookie))
    error_lines.assert_none()
    check_protected(bookie)


def test_bit_flips_anywhere_random_bytes_and_truncated_frames(
    bookie: BookieThread, error_lines: fuzz.ErrorLines
) -> None:
    fuzz.run_fuzz(
        FUZZ, fuzz.hostile_bytes(BookieFrame, REQUESTS), functools.partial(exchange, bookie)
    )
    error_lines.assert_none()
    check_protected(bookie)

"""Test helpers for a bookie's files and for talking to a bookie.

* :func:`segment_file`, :func:`record_starts` and :func:`flip_payload_byte` damage a
  bookie's files on purpose, as a lost sector or a bad disk would: where a segment's data
  file is, where each entry's record starts in it (a record's payload begins
  :data:`RECORD_HEADER_SIZE` bytes later), and flipping one bit of one entry's payload.
  :class:`pigeon.core.testing.ReplicationPolicyContract` uses them to check that reads
  pass over a damaged copy and repair it; the file layout is :mod:`pigeon.bookie._segment`.
* :func:`tear_tail` and :func:`corrupt_entry` are the damage
  :class:`pigeon.core.testing.LedgerStorageContract` asks of the ``segment-files``
  backend: a crash in the middle of an append, a flipped bit in one stored payload.
* :func:`pipelined_adds` sends many adds at once on one connection of a
  :class:`~pigeon.core.replication.BookieClient` and collects each outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from pigeon.bookie._segment import (
    FILE_HEADER_SIZE,
    REC,
    RECORD_HEADER_SIZE,
    encode_record_header,
    scan_records,
)
from pigeon.core.replication import BookieClient

__all__ = [
    "RECORD_HEADER_SIZE",
    "corrupt_entry",
    "flip_payload_byte",
    "pipelined_adds",
    "record_starts",
    "segment_file",
    "tear_tail",
]


def segment_file(data_dir: Path, segment_id: int) -> Path:
    """The data file of a segment in a bookie's data directory."""
    return data_dir / "segments" / f"{segment_id:016x}.log"


def record_starts(path: Path) -> dict[int, int]:
    """Where each entry's record starts in the segment data file ``path`` (the segment
    id is its name)."""
    data = path.read_bytes()
    segment_id = int(path.stem, 16)
    return {
        eid: pos
        for kind, eid, pos, *_ in scan_records(
            lambda at, n: data[at : at + n], segment_id, FILE_HEADER_SIZE, len(data), 0
        )
        if kind == REC
    }


def flip_payload_byte(path: Path, entry_id: int, segment_id: int) -> None:
    """Flip one bit in the payload of entry ``entry_id`` in a bookie's data file."""
    data = bytearray(path.read_bytes())
    for kind, eid, pos, _size, _lac, _payload, _ok in scan_records(
        lambda at, n: bytes(data[at : at + n]), segment_id, FILE_HEADER_SIZE, len(data), 0
    ):
        if kind == REC and eid == entry_id:
            data[pos + RECORD_HEADER_SIZE] ^= 0x40
            path.write_bytes(data)
            return
    raise AssertionError(f"entry {entry_id} is not in {path}")


def tear_tail(data_dir: Path) -> None:
    """Leave every segment of a stopped bookie's ``data_dir`` as a crash in the middle
    of one more append does: after its last record, the intact header of the next
    entry and part of its payload (written, never fsynced nor acknowledged)."""
    for path in sorted((data_dir / "segments").glob("*.log")):
        starts = record_starts(path)
        entry_id = max(starts, default=-1) + 1
        payload = bytes(range(256)) * 8
        with path.open("ab") as f:
            f.write(encode_record_header(int(path.stem, 16), entry_id, -1, payload))
            f.write(payload[: len(payload) // 3])


def corrupt_entry(data_dir: Path, segment_id: int, entry_id: int) -> None:
    """Flip one bit in the payload of an entry a stopped bookie stores in ``data_dir``."""
    flip_payload_byte(segment_file(data_dir, segment_id), entry_id, segment_id)


async def pipelined_adds(
    client: BookieClient,
    address: str,
    segment_id: int,
    ids: list[int],
    payload: Callable[[int, int], bytes],
    *,
    lac: int | None = None,
) -> dict[int, BaseException | None]:
    """Send the add of every id of ``ids`` at once on one connection to the bookie at
    ``address`` (``payload(segment_id, entry_id)`` the bytes; last add confirmed ``lac``,
    or the entry before each); the outcome of each, ``None`` where it was stored."""
    conn = await client.connection(address)
    results: dict[int, BaseException | None] = {}
    done = trio.Event()
    for eid in ids:

        def callback(result: Any, error: BaseException | None, eid: int = eid) -> None:
            results[eid] = error
            if len(results) == len(ids):
                done.set()

        entry_lac = eid - 1 if lac is None else lac
        client.add_entry_nowait(
            conn, segment_id, eid, entry_lac, payload(segment_id, eid), callback
        )
    await done.wait()
    return results

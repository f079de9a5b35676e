"""Test helpers for a bookie's files and for talking to a bookie.

* :func:`segment_file`, :func:`record_starts` and :func:`flip_payload_byte` damage a
  bookie's files on purpose, as a lost sector or a bad disk would: where a segment's data
  file is, where each entry's record starts in it (a record's payload begins
  :data:`RECORD_HEADER_SIZE` bytes later), and flipping one bit of one entry's payload.
  :class:`pigeon.core.testing.ReplicationPolicyContract` uses them to check that reads
  pass over a damaged copy and repair it; the file layout is :mod:`pigeon.bookie._segment`.
* :func:`pipelined_adds` sends many adds at once on one connection of a
  :class:`~pigeon.core.replication.BookieClient` and collects each outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from pigeon.bookie._segment import FILE_HEADER_SIZE, REC, RECORD_HEADER_SIZE, scan_records
from pigeon.core.replication import BookieClient

__all__ = [
    "RECORD_HEADER_SIZE",
    "flip_payload_byte",
    "pipelined_adds",
    "record_starts",
    "segment_file",
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

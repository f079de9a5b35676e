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
* :func:`make_journal_storage`, :func:`tear_journal_tail` and
  :func:`corrupt_journal_entry`: the ``journal`` ledger storage in a directory, a torn
  last journal record, a damaged entry-log record (for
  :class:`pigeon.core.testing.LedgerStorageContract`).
* :func:`pipelined_adds` sends many adds at once on one connection of a
  :class:`~pigeon.core.replication.BookieClient` and collects each outcome.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import trio

from pigeon.bookie._journal import JournalStore
from pigeon.bookie._journal_format import FILE_HEADER_SIZE as JOURNAL_HEADER_SIZE
from pigeon.bookie._journal_format import encode_entry_header, scan_journal
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
    "corrupt_journal_entry",
    "make_journal_storage",
    "tear_journal_append",
    "tear_journal_tail",
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


def make_journal_storage(path: Path, **options: Any) -> JournalStore:
    """A journal store with its journal in ``path/journal`` and its entry logs and
    index in ``path/ledgers``.  ``checkpoint_on_close=False``: stop like a crash after
    the last fsync (no checkpoint: the next start replays the journal)."""
    checkpoint_on_close = options.pop("checkpoint_on_close", True)
    store = JournalStore(path / "journal", path / "ledgers", **options)
    store._checkpoint_on_close = checkpoint_on_close
    return store


def tear_journal_tail(path: Path) -> None:
    """Tear the journal's last record (half of it written), or when the journal holds
    none after its checkpoint, append half a record: a write the crash interrupted."""
    last = sorted((path / "journal").glob("*.txn"))[-1]
    fd = os.open(last, os.O_RDWR)
    try:
        end = os.fstat(fd).st_size
        records = [
            r
            for r in scan_journal(lambda pos, n: os.pread(fd, n, pos), JOURNAL_HEADER_SIZE, end)
            if not isinstance(r, int)
        ]
        if records:
            os.ftruncate(fd, records[-1].pos + records[-1].size // 2)
        else:
            data = b"torn" * 100
            os.pwrite(fd, (encode_entry_header(1, 0, -1, data) + data)[:100], end)
    finally:
        os.close(fd)


def tear_journal_append(path: Path) -> None:
    """Leave the journal as a crash in the middle of one more add does: after its last
    record, part of the record of an entry beyond it (written, never fsynced nor
    acknowledged) -- the damage :class:`pigeon.core.testing.LedgerStorageContract` asks
    for (:func:`tear_journal_tail` tears the last record itself)."""
    last = sorted((path / "journal").glob("*.txn"))[-1]
    fd = os.open(last, os.O_RDWR)
    try:
        end = os.fstat(fd).st_size
        records = [
            r
            for r in scan_journal(lambda pos, n: os.pread(fd, n, pos), JOURNAL_HEADER_SIZE, end)
            if not isinstance(r, int)
        ]
        segment, entry = (
            (records[-1].segment_id, records[-1].entry_id + 1) if records else (1, 1 << 40)
        )
        data = bytes(range(256)) * 8
        os.pwrite(fd, (encode_entry_header(segment, entry, -1, data) + data)[: 36 + 500], end)
    finally:
        os.close(fd)


def corrupt_journal_entry(path: Path, segment_id: int, entry_id: int) -> None:
    """Flip a byte of the entry's record in its entry log (the store must be stopped,
    after a checkpoint: the copy the index points at is the one damaged)."""
    env = lmdb.open(str(path / "ledgers" / "index"), max_dbs=4, subdir=True, readonly=True)
    try:
        db = env.open_db(b"entries", create=False)
        with env.begin(db=db) as txn:
            raw = txn.get(segment_id.to_bytes(8, "big") + entry_id.to_bytes(8, "big"))
    finally:
        env.close()
    assert raw is not None, f"segment={segment_id} entry={entry_id} is not indexed"
    log = int.from_bytes(raw[0:8], "little")
    offset = int.from_bytes(raw[8:16], "little")
    length = int.from_bytes(raw[16:20], "little")
    victim = offset + (RECORD_HEADER_SIZE if length > RECORD_HEADER_SIZE else 10)
    (log_path,) = (path / "ledgers").glob(f"{log:016x}.log")
    with open(log_path, "r+b") as f:
        f.seek(victim)
        byte = f.read(1)
        f.seek(victim)
        f.write(bytes([byte[0] ^ 0xFF]))

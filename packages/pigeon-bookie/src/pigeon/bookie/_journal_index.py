"""The index of the ``journal`` ledger storage, in LMDB.

Why LMDB (the ``lmdb`` package): one small, mature C library (OpenLDAP's), a B+tree in
one memory-mapped file; a read is a lookup in the page cache without a system call or a
copy into a cache of our own, and a committed write transaction survives a crash (copy
on write, two meta pages: no log to replay, no repair).  RocksDB (``rocksdict``, ~30 MB)
would add compaction threads and tuning for a write rate the index never sees: the
store writes the index once per checkpoint, in one transaction, never per add.

Every method but :meth:`LedgerIndex.locate` blocks on the disk: the store calls them in
a worker thread, one writer at a time (its index lock).  :meth:`~LedgerIndex.locate`
reads a snapshot and runs in the trio thread.

Databases (keys big-endian so that they sort numerically, values little-endian)::

    entries   u64 segment id, u64 entry id -> u64 log id, u64 offset, u32 record length
    segments  u64 segment id -> i64 next entry id, i64 lac, u8 fenced, u64 size bytes,
              f64 time of the last add or fence (wall clock)
    logs      u64 entry log id -> u64 live bytes (records the index points at)
    meta      b"checkpoint" -> u64 journal sequence number, u64 offset: every record of
              the journal before it is in the entry logs (fsynced) and in this index
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple

import lmdb

from pigeon.core.errors import StorageError

__all__ = ["LedgerIndex", "Loc", "SegmentRecord"]

_KEY: Final = struct.Struct(">QQ")
_SEG_KEY: Final = struct.Struct(">Q")
_LOC: Final = struct.Struct("<QQI")
_SEG: Final = struct.Struct("<qqBQd")
_U64: Final = struct.Struct("<Q")
_CHECKPOINT: Final = struct.Struct("<QQ")
_RECORD_HEADER_SIZE: Final = 40


class Loc(NamedTuple):
    """Where an entry record is: entry log, offset, length (header included)."""

    log: int
    offset: int
    length: int


@dataclass(slots=True)
class SegmentRecord:
    """The state of a segment as the index keeps it."""

    next_id: int
    lac: int
    fenced: bool
    size_bytes: int
    touched_wall: float


class LedgerIndex:
    """The LMDB environment under ``path`` (created if missing)."""

    def __init__(self, path: Path, *, map_size: int = 1 << 38) -> None:
        path.mkdir(parents=True, exist_ok=True)
        try:
            self._env = lmdb.open(
                str(path), map_size=map_size, max_dbs=4, subdir=True, readahead=False
            )
        except lmdb.Error as exc:
            raise StorageError(f"cannot open the index {path}: {exc}")
        self._entries = self._env.open_db(b"entries")
        self._segments = self._env.open_db(b"segments")
        self._logs = self._env.open_db(b"logs")
        self._meta = self._env.open_db(b"meta")

    def close(self) -> None:
        self._env.close()

    def disk_usage(self) -> int:
        info = self._env.info()
        return int((info["last_pgno"] + 1) * self._env.stat()["psize"])

    # ------------------------------------------------------------------ loading

    def checkpoint(self) -> tuple[int, int] | None:
        with self._env.begin(db=self._meta) as txn:
            raw = txn.get(b"checkpoint")
        return None if raw is None else _CHECKPOINT.unpack(raw)

    def load_segments(self) -> dict[int, SegmentRecord]:
        out: dict[int, SegmentRecord] = {}
        with self._env.begin(db=self._segments) as txn:
            for key, value in txn.cursor():
                next_id, lac, fenced, size, touched = _SEG.unpack(value)
                out[_SEG_KEY.unpack(key)[0]] = SegmentRecord(
                    next_id, lac, bool(fenced), size, touched
                )
        return out

    def load_live(self) -> dict[int, int]:
        """Live bytes of every entry log the index points into."""
        with self._env.begin(db=self._logs) as txn:
            return {_SEG_KEY.unpack(k)[0]: _U64.unpack(v)[0] for k, v in txn.cursor()}

    # ------------------------------------------------------------------ reads

    def locate(
        self, segment_id: int, first: int, last: int, max_bytes: int
    ) -> tuple[dict[int, Loc], int]:
        """``(locations, stop)``: where the indexed entries ``first..stop`` of the
        segment are; ``stop`` is ``last``, or lower where their payloads passed
        ``max_bytes``."""
        out: dict[int, Loc] = {}
        total = 0
        with self._env.begin(db=self._entries, buffers=True) as txn:
            cur = txn.cursor()
            if not cur.set_range(_KEY.pack(segment_id, first)):
                return out, last
            for key, value in cur:
                sid, eid = _KEY.unpack(key)
                if sid != segment_id or eid > last:
                    break
                loc = Loc._make(_LOC.unpack(value))
                out[eid] = loc
                total += loc.length - _RECORD_HEADER_SIZE
                if total > max_bytes:
                    return out, eid
        return out, last

    def positions_in(self, logs: set[int]) -> list[tuple[bytes, Loc]]:
        """Every ``(key, location)`` of the index pointing into ``logs`` (a full scan:
        compaction only)."""
        out: list[tuple[bytes, Loc]] = []
        with self._env.begin(db=self._entries) as txn:
            for key, value in txn.cursor():
                log = _U64.unpack_from(value)[0]
                if log in logs:
                    out.append((key, Loc._make(_LOC.unpack(value))))
        out.sort(key=lambda kv: (kv[1].log, kv[1].offset))
        return out

    # ------------------------------------------------------------------ writes

    def commit(
        self,
        *,
        entries: Iterable[tuple[int, int, Loc]],
        states: dict[int, SegmentRecord],
        deleted: Iterable[int] = (),
        checkpoint: tuple[int, int] | None = None,
    ) -> None:
        """One durable transaction: segments ``deleted`` dropped first, then the
        ``entries`` put (superseding older copies), ``states`` written and the
        journal position recorded."""
        with self._env.begin(write=True) as txn:
            live: dict[int, int] = {}
            for segment_id in deleted:
                self._drop_segment(txn, segment_id, live)
            for segment_id, entry_id, loc in entries:
                old = txn.replace(
                    _KEY.pack(segment_id, entry_id), _LOC.pack(*loc), db=self._entries
                )
                live[loc.log] = live.get(loc.log, 0) + loc.length
                if old is not None:
                    old_log, _off, old_len = _LOC.unpack(old)
                    live[old_log] = live.get(old_log, 0) - old_len
            for segment_id, s in states.items():
                value = _SEG.pack(s.next_id, s.lac, s.fenced, s.size_bytes, s.touched_wall)
                txn.put(_SEG_KEY.pack(segment_id), value, db=self._segments)
            self._add_live(txn, live)
            if checkpoint is not None:
                txn.put(b"checkpoint", _CHECKPOINT.pack(*checkpoint), db=self._meta)

    def delete_segment(self, segment_id: int) -> None:
        """Drop the segment's entries and state (one durable transaction)."""
        with self._env.begin(write=True) as txn:
            live: dict[int, int] = {}
            self._drop_segment(txn, segment_id, live)
            self._add_live(txn, live)

    def _drop_segment(self, txn: lmdb.Transaction, segment_id: int, live: dict[int, int]) -> None:
        txn.delete(_SEG_KEY.pack(segment_id), db=self._segments)
        cur = txn.cursor(db=self._entries)
        if not cur.set_range(_KEY.pack(segment_id, 0)):
            return
        while True:
            key = cur.key()
            if not key or _KEY.unpack(key)[0] != segment_id:
                return
            log, _off, length = _LOC.unpack(cur.value())
            live[log] = live.get(log, 0) - length
            if not cur.delete():  # moves to the next record
                return

    def _add_live(self, txn: lmdb.Transaction, delta: dict[int, int]) -> None:
        for log, d in delta.items():
            if not d:
                continue
            key = _SEG_KEY.pack(log)
            raw = txn.get(key, db=self._logs)
            now = max(0, (_U64.unpack(raw)[0] if raw is not None else 0) + d)
            txn.put(key, _U64.pack(now), db=self._logs)

    def move(self, moves: list[tuple[bytes, Loc, Loc]], dropped: Iterable[int]) -> int:
        """Compaction: repoint each ``(key, old, new)`` still at ``old``, forget the
        entry logs ``dropped``; returns the entries moved (one durable transaction)."""
        moved = 0
        with self._env.begin(write=True) as txn:
            live: dict[int, int] = {}
            for key, old, new in moves:
                raw = txn.get(key, db=self._entries)
                if raw is None or Loc._make(_LOC.unpack(raw)) != old:
                    continue  # deleted or repaired meanwhile
                txn.put(key, _LOC.pack(*new), db=self._entries)
                live[new.log] = live.get(new.log, 0) + new.length
                moved += 1
            for log in dropped:
                txn.delete(_SEG_KEY.pack(log), db=self._logs)
            self._add_live(txn, live)
        return moved

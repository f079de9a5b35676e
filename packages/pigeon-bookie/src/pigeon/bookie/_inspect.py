"""Offline inspection of a bookie's data directory (``pigeon bookie inspect``).

Reads every file of every segment and checks every checksum, without changing a byte
(no truncation, no index rebuild: what a starting store would do is only reported).

Locking: the inspection holds a *shared* ``flock`` on ``LOCK`` while it reads.  A
running store holds it exclusively, so inspecting a directory in use fails at once
(:class:`DataDirLocked`) instead of reporting a half-written record as damage; and a
bookie started during an inspection refuses to start ("in use") rather than change
files being read.

What counts as corruption (:attr:`SegmentReport.corrupt`): a record whose payload or
header fails its crc *followed by* a verified record (bit rot or an overwrite: a crash
never leaves that), a damaged file header, a damaged meta file.  A torn tail (bytes
after the last verified record: a write cut short by a crash, or garbage appended) is
reported but is not corruption: the store truncates it at start, and under
``fsync="always"`` no acknowledged entry is there.  Index problems are warnings: the
index is derived data that the store checks and rebuilds.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pigeon.bookie._index import (
    INDEX_HEADER_SIZE,
    INDEX_RECORD_SIZE,
    decode_checkpoints,
    encode_index_header,
)
from pigeon.bookie._segment import (
    FILE_HEADER_SIZE,
    TAIL,
    decode_meta,
    encode_file_header,
    scan_records,
)
from pigeon.core.errors import DataDirLocked, StorageError

__all__ = ["DataDirLocked", "InspectReport", "SegmentReport", "inspect_data_dir"]

_STORE_FORMAT = b"pigeon-segment-store 1\n"
#: damaged entry ids listed per segment at most (the counts are always complete)
_MAX_LISTED = 100


@dataclass
class SegmentReport:
    segment_id: int
    #: verified entries (damaged ones not counted)
    entries: int = 0
    first_entry_id: int = -1
    last_entry_id: int = -1  #: of the last verified record
    lac: int = -1
    fenced: bool = False
    #: "none" (never fenced), "ok" or "damaged" (a store takes it as fenced)
    meta: str = "none"
    data_bytes: int = 0
    index_bytes: int = 0
    meta_bytes: int = 0
    file_header_ok: bool = True
    #: entries whose payload failed its crc, followed by verified records
    damaged_entries: list[int] = field(default_factory=list)
    damaged_count: int = 0
    #: entry id ranges that may have been lost with damaged record headers
    lost_ranges: list[tuple[int, int]] = field(default_factory=list)
    #: bytes after the last verified record (the store truncates them at start)
    torn_tail_bytes: int = 0
    #: "ok", "missing", "damaged" (rebuilt at start) or "stale checkpoints"
    index: str = "ok"
    warnings: list[str] = field(default_factory=list)

    @property
    def corrupt(self) -> bool:
        return bool(
            self.damaged_count
            or self.lost_ranges
            or not self.file_header_ok
            or self.meta == "damaged"
        )

    @property
    def size_bytes(self) -> int:
        return self.data_bytes + self.index_bytes + self.meta_bytes

    @property
    def status(self) -> str:
        if self.corrupt:
            parts = []
            if self.damaged_count:
                shown = ",".join(map(str, self.damaged_entries[:5]))
                more = "..." if self.damaged_count > 5 else ""
                parts.append(f"{self.damaged_count} damaged ({shown}{more})")
            if self.lost_ranges:
                shown = ",".join(
                    f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in self.lost_ranges[:3]
                )
                parts.append(f"lost {shown}")
            if not self.file_header_ok:
                parts.append("bad file header")
            if self.meta == "damaged":
                parts.append("bad meta")
            return "CORRUPT: " + "; ".join(parts)
        if self.entries == 0 and self.meta == "none":
            return "empty (removed at start)"
        if self.torn_tail_bytes:
            return f"torn tail ({self.torn_tail_bytes} bytes, truncated at start)"
        return "ok"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["segment"] = f"{self.segment_id:016x}"
        out["lost_ranges"] = [list(r) for r in self.lost_ranges]
        out["corrupt"] = self.corrupt
        out["status"] = self.status
        out["size_bytes"] = self.size_bytes
        return out


@dataclass
class InspectReport:
    data_dir: str
    segments: list[SegmentReport] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def corrupt(self) -> bool:
        return any(s.corrupt for s in self.segments)

    def to_json(self) -> dict[str, Any]:
        return {
            "data_dir": self.data_dir,
            "corrupt": self.corrupt,
            "segments": [s.to_json() for s in self.segments],
            "totals": {
                "segments": len(self.segments),
                "entries": sum(s.entries for s in self.segments),
                "bytes": sum(s.size_bytes for s in self.segments),
                "corrupt_segments": sum(s.corrupt for s in self.segments),
            },
            "warnings": self.warnings,
        }


def _format_name(fmt: Path) -> str:
    """The first line of a FORMAT file, printable and short, for an error message."""
    head = fmt.read_bytes()[:80].split(b"\n", 1)[0]
    return repr(head.decode("ascii", "replace"))


def inspect_data_dir(
    data_dir: str | os.PathLike[str], *, segment: int | None = None
) -> InspectReport:
    """Inspect every segment (or one) of a data directory that no store is using.

    Raises :class:`DataDirLocked` if a store runs on it, StorageError if it is not a
    segment store's directory.
    """
    root = Path(data_dir)
    seg_dir = root / "segments"
    fmt = root / "FORMAT"
    if fmt.exists() and fmt.read_bytes() != _STORE_FORMAT:
        raise StorageError(
            f"{root} holds another ledger storage ({_format_name(fmt)}), not segment-files:"
            " inspect reads segment-files data directories only"
        )
    if not seg_dir.is_dir():
        raise StorageError(f"{root} is not a segment-files data directory (no segments/)")
    report = InspectReport(str(root))
    try:
        lock_fd = os.open(root / "LOCK", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        lock_fd = -1
        report.warnings.append("no LOCK file: no store ever ran on this directory")
    try:
        if lock_fd >= 0:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise DataDirLocked(
                        f"{root} is in use by a running bookie (LOCK is held): stop it first"
                    ) from None
                raise
        kinds: dict[int, set[str]] = {}
        for entry in sorted(os.scandir(seg_dir), key=lambda e: e.name):
            stem, dot, suffix = entry.name.partition(".")
            try:
                segment_id = int(stem, 16) if len(stem) == 16 and dot else -1
            except ValueError:
                segment_id = -1
            if segment_id < 0 or suffix not in ("log", "idx", "meta", "meta.tmp"):
                report.warnings.append(f"unknown file {entry.name}")
                continue
            kinds.setdefault(segment_id, set()).add(suffix)
        for segment_id, found in sorted(kinds.items()):
            if segment is not None and segment_id != segment:
                continue
            if "log" not in found:
                report.warnings.append(
                    f"segment {segment_id:016x}: {', '.join(sorted(found))} without a data"
                    " file (an interrupted delete; removed at start)"
                )
                continue
            report.segments.append(inspect_segment(seg_dir, segment_id))
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
    return report


def _pread(fd: int, pos: int, n: int) -> bytes:
    return os.pread(fd, n, pos)


def inspect_segment(seg_dir: Path, segment_id: int) -> SegmentReport:
    """Check every record of one segment's data file, its index and its meta file."""
    name = f"{segment_id:016x}"
    rep = SegmentReport(segment_id)
    meta_path = seg_dir / f"{name}.meta"
    meta_lac = -1
    if meta_path.exists():
        buf = meta_path.read_bytes()
        rep.meta_bytes = len(buf)
        meta = decode_meta(buf, segment_id)
        if meta is None:
            rep.meta, rep.fenced = "damaged", True
        else:
            rep.meta = "ok"
            rep.fenced, meta_lac = meta
    checkpoints: dict[int, int] = {}  # position -> entry id
    idx_path = seg_dir / f"{name}.idx"
    if idx_path.exists():
        raw = idx_path.read_bytes()
        rep.index_bytes = len(raw)
        if raw[:INDEX_HEADER_SIZE] != encode_index_header(segment_id):
            rep.index = "damaged"
        else:
            body = raw[INDEX_HEADER_SIZE:]
            if len(body) % INDEX_RECORD_SIZE:
                rep.index = "stale checkpoints"
            ids, positions = decode_checkpoints(body)
            checkpoints = dict(zip(positions, ids, strict=True))
    else:
        rep.index = "missing"

    fd = os.open(seg_dir / f"{name}.log", os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        rep.data_bytes = size
        if size < FILE_HEADER_SIZE:
            rep.torn_tail_bytes = size
            rep.file_header_ok = size == 0  # an empty file is a create cut short
            return rep
        rep.file_header_ok = os.pread(fd, FILE_HEADER_SIZE, 0) == encode_file_header(segment_id)
        # damage seen since the last verified record: it is corruption only if a
        # verified record follows (else it belongs to the torn tail)
        pending_bad: list[int] = []
        pending_lost: list[tuple[int, int]] = []
        matched = 0
        prev_id, prev_end = -1, FILE_HEADER_SIZE
        ok_end, lac = FILE_HEADER_SIZE, -1
        for kind, entry_id, pos, rsize, rlac, _payload, ok in scan_records(
            functools.partial(_pread, fd), segment_id, FILE_HEADER_SIZE, size, 0, chunk=1 << 20
        ):
            if kind == TAIL:
                break
            if pos != prev_end and entry_id > prev_id + 1:
                pending_lost.append((prev_id + 1, entry_id - 1))
            prev_id, prev_end = entry_id, pos + rsize
            if checkpoints.get(pos) == entry_id:
                matched += 1
            if not ok:
                pending_bad.append(entry_id)
                continue
            rep.damaged_count += len(pending_bad)
            room = _MAX_LISTED - len(rep.damaged_entries)
            rep.damaged_entries.extend(pending_bad[: max(room, 0)])
            rep.lost_ranges.extend(pending_lost)
            pending_bad.clear()
            pending_lost.clear()
            rep.entries += 1
            if rep.first_entry_id < 0:
                rep.first_entry_id = entry_id
            rep.last_entry_id = entry_id
            ok_end = pos + rsize
            lac = max(lac, rlac)
        rep.torn_tail_bytes = size - ok_end
        rep.lac = max(lac, meta_lac)
        if rep.index == "ok" and matched < len(checkpoints):
            rep.index = "stale checkpoints"
        if rep.index != "ok":
            rep.warnings.append(f"index {rep.index}: rebuilt or trimmed at start")
    finally:
        os.close(fd)
    return rep


def format_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_table(report: InspectReport) -> str:
    """The report as a fixed-width text table with a summary line."""
    header = ("SEGMENT", "ENTRIES", "FIRST", "LAST", "LAC", "FENCED", "SIZE", "STATUS")
    rows = [header]
    for s in report.segments:
        rows.append(
            (
                f"{s.segment_id:016x}",
                str(s.entries),
                str(s.first_entry_id),
                str(s.last_entry_id),
                str(s.lac),
                "yes" if s.fenced else "no",
                format_size(s.size_bytes),
                s.status,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in rows
    ]
    corrupt = sum(s.corrupt for s in report.segments)
    lines.append(
        f"{len(report.segments)} segments, {sum(s.entries for s in report.segments)} entries,"
        f" {format_size(sum(s.size_bytes for s in report.segments))};"
        f" {corrupt} corrupt" + ("" if corrupt else " (all checksums verified)")
    )
    for s in report.segments:
        for w in s.warnings:
            lines.append(f"warning: segment {s.segment_id:016x}: {w}")
    for w in report.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)

"""What the store makes of a data file's records: recovery's tail scan, the entries
of a read, and where an entry to repair lies.

Like :mod:`pigeon.bookie._segment` (the byte layout and the record scanner these build
on), nothing here opens a file: every function reads through a ``read(pos, n)``
callable.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from pigeon.bookie._segment import (
    REC,
    RECORD_HEADER_SIZE,
    TAIL,
    IdRanges,
    ReadFn,
    parse_record_header,
    scan_records,
)

__all__ = [
    "Located",
    "TailScan",
    "collect_entries",
    "dense_positions",
    "locate_record",
    "scan_tail",
]


@dataclass
class TailScan:
    """What recovery learnt from scanning a data file from a checkpoint to its end."""

    base: int  #: entry id of ``starts[0]``
    next_id: int  #: one past the last entry kept
    end: int  #: end of the last verified record: the file is truncated here
    lac: int  #: max lac of the verified records (-1 if none)
    #: where each entry id ``base..next_id - 1`` starts; an id not stored (skipped, or
    #: lost with damage) gets the position of the next record: a zero-length span
    starts: array[int] = field(default_factory=lambda: array("q"))
    #: entries kept that cannot be returned: bad payload crc, or lost with damage
    corrupt: IdRanges = field(default_factory=IdRanges)
    #: checkpoints ``(entry_id, pos)`` found after the starting one
    checkpoints: list[tuple[int, int]] = field(default_factory=list)
    damaged_at: int = -1  #: where the scan stopped trusting the file (-1: at its end)
    records: int = 0  #: records kept (verified or damaged-but-followed)
    #: bytes after ``end`` (the torn tail, dropped)
    torn_bytes: int = 0
    #: ids of the records with an intact header in the torn tail (dropped with it)
    torn_ids: list[int] = field(default_factory=list)
    #: of those, the records that end inside the file (whole, with a bad payload crc):
    #: damage rather than a write cut short
    torn_whole: int = 0
    #: highest lac found in an intact header of the torn tail (-1: none): the writer
    #: had confirmed entries up to it, so a torn tail above it lost confirmed entries
    torn_lac: int = -1

    def torn_summary(self) -> str:
        """The dropped records as text for a log line, e.g. ``196..199 (4 records)``."""
        ids = self.torn_ids
        if not ids:
            return "none with an intact header"
        span = str(ids[0]) if len(ids) == 1 else f"{ids[0]}..{ids[-1]}"
        text = f"{span} ({len(ids)} record{'s' if len(ids) != 1 else ''}"
        if self.torn_whole:
            text += f", {self.torn_whole} whole but failing their checksum"
        return text + ")"


def dense_positions(
    ids: Sequence[int], positions: Sequence[int], base: int, next_id: int
) -> array[int]:
    """Start positions of every entry id ``base..next_id - 1``, from the records
    ``(ids[k], positions[k])`` (ids increasing; the last is ``next_id - 1``): an id with
    no record gets the position of the next record."""
    starts: array[int] = array("q")
    cur = base
    for k in range(bisect_left(ids, base), len(ids)):
        eid = ids[k]
        if eid >= next_id:
            break
        n = eid - cur + 1
        if n == 1:
            starts.append(positions[k])
        else:
            starts.extend(array("q", [positions[k]]) * n)
        cur = eid + 1
    return starts


def scan_tail(
    read: ReadFn,
    segment_id: int,
    start: int,
    start_id: int,
    file_end: int,
    *,
    interval: int,
    last_checkpoint: int,
    max_dense: int = 1 << 62,
) -> TailScan:
    """Recovery scan: every record of ``[start, file_end)`` is verified.

    Everything after the last record whose payload verifies is a torn tail (writes that
    never completed) and is dropped.  A damaged record *followed by* verified ones is
    kept as a corrupt entry (bit rot): its successors remain readable and are never
    truncated.  Where the scan had to resynchronise over damaged bytes, the ids between
    the records on either side may have been stored there: they are corrupt too.
    ``starts`` covers at most the last ``max_dense`` ids (older ones are found through
    the sparse index).  A new checkpoint is taken at each record starting ``interval``
    bytes or more after the previous one, exactly as the append path does.
    """
    ids: array[int] = array("q")
    positions: array[int] = array("q")
    corrupt = IdRanges()
    checkpoints: list[tuple[int, int]] = []
    prev_id, prev_end = start_id - 1, start
    kept = 0
    ok_next, ok_end, lac = start_id, start, -1
    damaged_at = -1
    lacs: array[int] = array("q")
    tail_id = tail_lac = -1
    for kind, entry_id, pos, size, rlac, _payload, ok in scan_records(
        read, segment_id, start, file_end, start_id
    ):
        if kind == TAIL:
            damaged_at = pos
            tail_id, tail_lac = entry_id, rlac
            break
        lacs.append(rlac)
        if pos != prev_end:  # resynchronised over damage: ids in between may be lost
            corrupt.add_range(prev_id + 1, entry_id - 1)
        ids.append(entry_id)
        positions.append(pos)
        prev_id, prev_end = entry_id, pos + size
        if pos - last_checkpoint >= interval:
            checkpoints.append((entry_id, pos))
            last_checkpoint = pos
        if ok:
            kept = len(ids)
            ok_next, ok_end = entry_id + 1, pos + size
            lac = max(lac, rlac)
        else:
            corrupt.add(entry_id)
    torn_ids = list(ids[kept:])
    torn_whole = len(torn_ids)
    torn_lac = max(lacs[kept:], default=-1)
    if tail_id >= 0:  # a record with an intact header running past the end of the file
        torn_ids.append(tail_id)
        torn_lac = max(torn_lac, tail_lac)
    del ids[kept:]
    del positions[kept:]
    base = max(start_id, ok_next - max_dense)
    return TailScan(
        base=base,
        next_id=ok_next,
        end=ok_end,
        lac=lac,
        starts=dense_positions(ids, positions, base, ok_next),
        corrupt=corrupt.below(ok_next),
        checkpoints=[c for c in checkpoints if c[0] < ok_next],
        damaged_at=damaged_at,
        records=kept,
        torn_bytes=file_end - ok_end,
        torn_ids=torn_ids,
        torn_whole=torn_whole,
        torn_lac=torn_lac,
    )


def collect_entries(
    read: ReadFn,
    segment_id: int,
    start: int,
    start_id: int,
    end: int,
    first: int,
    last: int,
    *,
    max_bytes: int,
    max_count: int,
    chunk: int = 128 << 10,
    exact_start: bool = True,
) -> tuple[list[tuple[int, bytes]], int, bool]:
    """Read the stored entries of ``first..last``, scanning from the record at ``start``
    (entry id ``start_id``, or the first id stored after it).

    Returns ``(entries, corrupt_id, start_ok)``:

    - ``entries``: verified entries in id order, the first of them ``first``; ids the
      file does not hold (gaps) are skipped.  The read stops before ``max_bytes`` of
      payload would be exceeded (but returns at least one entry), at ``max_count``
      entries, after ``last``, and before an entry that is damaged or that may have
      been lost with damaged bytes.
    - ``corrupt_id``: ``first`` when nothing is returned because ``first`` is damaged
      or may have been lost with damage; else -1.  ``([], -1, True)`` means ``first``
      is not stored (a later entry follows the one before it, undamaged).
    - ``start_ok``: whether a valid record was found at ``start`` (False means the
      caller's position was wrong; nothing else is then returned).  With
      ``exact_start=False`` a damaged record at ``start`` is skipped like any other.
    """
    out: list[tuple[int, bytes]] = []
    nbytes = 0
    want = first
    started = False
    prev_end = start
    for kind, entry_id, pos, size, _lac, payload, ok in scan_records(
        read, segment_id, start, end, start_id, verify_from=first, chunk=chunk
    ):
        if not started:
            if exact_start and (kind != REC or pos != start):
                return [], -1, False
            started = True
        if kind == TAIL:
            break
        resynced = pos != prev_end
        prev_end = pos + size
        if entry_id < want:
            continue
        if entry_id > want:
            if resynced:  # ids want..entry_id - 1 may have been lost with the damage
                break
            if not out:
                return [], -1, True  # ``first`` is not stored
            if entry_id > last:
                return out, -1, True
            want = entry_id  # skip ids this file does not hold
        if not ok or payload is None:
            break
        if out and nbytes + len(payload) > max_bytes:
            return out, -1, True
        out.append((entry_id, payload))
        nbytes += len(payload)
        want = entry_id + 1
        if want > last or len(out) >= max_count or nbytes >= max_bytes:
            return out, -1, True
    if not started and exact_start:  # nothing at all at ``start``
        return [], -1, False
    return out, (-1 if out or want > last else want), True


@dataclass(frozen=True, slots=True)
class Located:
    """Where an entry id is in a data file (:func:`locate_record`).

    ``kind == "record"``: a record with an intact header for the id starts at ``pos``
    (``size`` bytes in all; ``payload_crc`` and ``lac`` are its header's, ``ok`` tells
    whether its payload verifies).  ``kind == "lost"``: the damaged bytes
    ``[pos, pos + size)`` lie between two trustworthy points and may have held the ids
    ``lo..hi`` (the id looked for among them); ``trusted`` tells that ``pos`` is the end
    of an intact record (or the start of the records), not just where a scan began.
    """

    kind: str
    pos: int
    size: int
    lo: int = -1
    hi: int = -1
    payload_crc: int = 0
    lac: int = -1
    ok: bool = False
    trusted: bool = False


def locate_record(
    read: ReadFn,
    segment_id: int,
    start: int,
    start_id: int,
    end: int,
    entry_id: int,
    *,
    start_trusted: bool = False,
    chunk: int = 128 << 10,
) -> Located | None:
    """Find entry ``entry_id`` scanning ``[start, end)`` from the record of ``start_id``
    (or the first id stored after it); None when the file does not hold it (an id the
    writer skipped, or past the end).  ``start_trusted``: ``start`` is known to be
    where a record starts (the first record of the file, a verified checkpoint)."""
    prev_id, prev_end = start_id - 1, start
    parsed_one = False
    for kind, eid, pos, size, lac, _payload, ok in scan_records(
        read, segment_id, start, end, start_id, verify_from=entry_id, chunk=chunk
    ):
        if kind == TAIL:
            return None
        resynced = pos != prev_end
        if eid == entry_id:
            h = parse_record_header(read(pos, RECORD_HEADER_SIZE), 0)
            assert h is not None  # scan_records only yields records with intact headers
            return Located("record", pos, size, eid, eid, h[4], lac, ok, True)
        if eid > entry_id:
            if resynced and prev_id < entry_id:
                return Located(
                    "lost",
                    prev_end,
                    pos - prev_end,
                    prev_id + 1,
                    eid - 1,
                    trusted=parsed_one or start_trusted,
                )
            return None
        prev_id, prev_end = eid, pos + size
        parsed_one = True
    return None

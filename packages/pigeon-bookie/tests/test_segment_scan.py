"""Recovery's tail scan, collecting a read's entries and locating an entry to repair
(pigeon.bookie._segment_scan), on data files built in memory."""

from __future__ import annotations

import functools
import itertools
from typing import Any

from test_segment import SEG, build, payload, reader

from pigeon.bookie._segment import (
    FILE_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    crc32c,
    encode_file_header,
    encode_record_header,
)
from pigeon.bookie._segment_scan import collect_entries, locate_record, scan_tail


def collect(
    data: bytes | bytearray, first: int, last: int, **kw: Any
) -> tuple[list[int], int, bool]:
    """:func:`collect_entries` over ``data`` from its first record: the ids read (their
    payloads checked), the corrupt id, and whether the start was right."""
    kw.setdefault("max_bytes", 1 << 20)
    kw.setdefault("max_count", 1000)
    out, corrupt, ok = collect_entries(
        reader(data), SEG, FILE_HEADER_SIZE, 0, len(data), first, last, **kw
    )
    assert all(p == payload(i) for i, p in out)
    return [i for i, _ in out], corrupt, ok


def build_with_gaps(ids: list[int]) -> tuple[bytearray, dict[int, int]]:
    """A data file with entries ``ids`` (ids skip), and where each record starts."""
    data = bytearray(encode_file_header(SEG))
    where = {}
    for i in ids:
        where[i] = len(data)
        data += encode_record_header(SEG, i, i - 1, payload(i)) + payload(i)
    return data, where


def test_scan_tail_truncates_after_last_good_record() -> None:
    data, starts = build(8)
    torn = bytes(data) + encode_record_header(SEG, 8, 7, b"z" * 100) + b"z" * 10
    scan = scan_tail(
        reader(torn), SEG, FILE_HEADER_SIZE, 0, len(torn), interval=200, last_checkpoint=16
    )
    assert scan.next_id == 8
    assert scan.end == len(data)
    assert list(scan.starts) == starts
    assert scan.lac == 6
    assert not scan.corrupt
    assert all(b - a >= 200 for (_, a), (_, b) in itertools.pairwise(scan.checkpoints))
    assert scan.damaged_at == len(data)


def test_scan_tail_drops_bad_crc_at_the_end_but_keeps_it_in_the_middle() -> None:
    data, starts = build(8)
    last = bytearray(data)
    last[-1] ^= 0x55
    scan = scan_tail(
        reader(last), SEG, FILE_HEADER_SIZE, 0, len(last), interval=1 << 20, last_checkpoint=16
    )
    assert scan.next_id == 7
    assert scan.end == starts[7]
    middle = bytearray(data)
    middle[starts[3] + RECORD_HEADER_SIZE] ^= 0x55
    assert payload(3)
    scan = scan_tail(
        reader(middle), SEG, FILE_HEADER_SIZE, 0, len(middle), interval=1 << 20, last_checkpoint=16
    )
    assert scan.next_id == 8
    assert scan.end == len(middle)
    assert scan.corrupt == {3}


def test_scan_tail_hole_for_lost_header() -> None:
    data, starts = build(8)
    data[starts[3] : starts[3] + 4] = b"\0\0\0\0"
    scan = scan_tail(
        reader(data), SEG, FILE_HEADER_SIZE, 0, len(data), interval=1 << 20, last_checkpoint=16
    )
    assert scan.next_id == 8
    assert scan.corrupt == {3}
    assert scan.starts[3] == scan.starts[4] == starts[4]


def test_collect_entries_limits() -> None:
    data, starts = build(40)
    read = reader(data)
    end = len(data)

    assert collect(data, 0, 39)[0] == list(range(40))
    assert collect(data, 5, 9)[0] == [5, 6, 7, 8, 9]
    assert collect(data, 5, 100)[0] == list(range(5, 40))
    assert collect(data, 5, 39, max_count=3)[0] == [5, 6, 7]
    assert collect(data, 5, 39, max_bytes=1)[0] == [5]  # always one entry
    sizes = [len(payload(i)) for i in range(40)]
    assert collect(data, 0, 39, max_bytes=sizes[0] + sizes[1])[0] == [0, 1]
    # starting at a known position
    out, corrupt, ok = collect_entries(
        read, SEG, starts[10], 10, end, 12, 13, max_bytes=1 << 20, max_count=10
    )
    assert [i for i, _ in out] == [12, 13] and corrupt == -1 and ok
    # a wrong position
    out, corrupt, ok = collect_entries(
        read, SEG, starts[10] + 1, 10, end, 12, 13, max_bytes=1 << 20, max_count=10
    )
    assert (out, ok) == ([], False)


def test_collect_entries_stops_before_damage() -> None:
    data, starts = build(10)
    assert payload(5)
    data[starts[5] + RECORD_HEADER_SIZE] ^= 1
    assert collect(data, 0, 9) == ([0, 1, 2, 3, 4], -1, True)
    assert collect(data, 5, 9) == ([], 5, True)
    assert collect(data, 6, 9) == ([6, 7, 8, 9], -1, True)


def test_collect_entries_resyncs_over_lost_header() -> None:
    data, starts = build(10)
    data[starts[0] : starts[0] + 40] = bytes(40)
    assert collect(data, 0, 9) == ([], -1, False)  # exact start required by default
    assert collect(data, 0, 9, exact_start=False) == ([], 0, True)
    assert collect(data, 3, 9, exact_start=False)[0] == list(range(3, 10))


def test_scan_tail_names_what_the_torn_tail_held() -> None:
    data, starts = build(8)
    torn = bytes(data[: starts[6] + RECORD_HEADER_SIZE + 1])  # 6 torn, 7 gone
    scan = scan_tail(
        reader(torn), SEG, FILE_HEADER_SIZE, 0, len(torn), interval=1 << 20, last_checkpoint=16
    )
    assert scan.next_id == 6
    assert scan.torn_bytes == RECORD_HEADER_SIZE + 1
    assert (scan.torn_ids, scan.torn_lac) == ([6], 5)
    assert scan.torn_summary() == "6 (1 record)"
    bad_crc = bytearray(data)
    bad_crc[starts[6] + RECORD_HEADER_SIZE] ^= 1 if payload(6) else 0
    bad_crc[-1] ^= 1  # entries 6 and 7 fail their crc: both torn
    scan = scan_tail(
        reader(bad_crc),
        SEG,
        FILE_HEADER_SIZE,
        0,
        len(bad_crc),
        interval=1 << 20,
        last_checkpoint=16,
    )
    assert scan.torn_ids == ([6, 7] if payload(6) else [7])
    clean = scan_tail(
        reader(data), SEG, FILE_HEADER_SIZE, 0, len(data), interval=1 << 20, last_checkpoint=16
    )
    assert (clean.torn_bytes, clean.torn_ids, clean.torn_summary()) == (
        0,
        [],
        "none with an intact header",
    )


def test_locate_record() -> None:
    data, starts = build(10)
    data[starts[3] + RECORD_HEADER_SIZE] ^= 0xFF if payload(3) else 0
    data[starts[6] + 9] ^= 0x01  # entry 6's header
    read = reader(data)
    end = len(data)
    found = locate_record(read, SEG, FILE_HEADER_SIZE, 0, end, 3, start_trusted=True)
    assert found is not None and found.kind == "record" and found.pos == starts[3]
    assert found.ok == (not payload(3))
    assert found.payload_crc == crc32c(payload(3))
    lost = locate_record(read, SEG, FILE_HEADER_SIZE, 0, end, 6, start_trusted=True)
    assert lost is not None and lost.kind == "lost"
    assert (lost.pos, lost.size, lost.lo, lost.hi, lost.trusted) == (
        starts[6],
        starts[7] - starts[6],
        6,
        6,
        True,
    )
    # a scan starting at the damage itself cannot vouch for where the damage begins
    at = locate_record(read, SEG, starts[6], 6, end, 6)
    assert at is not None and at.kind == "lost" and not at.trusted
    assert locate_record(read, SEG, FILE_HEADER_SIZE, 0, end, 10) is None
    skipping = bytearray(encode_file_header(SEG))
    for i in (0, 2):
        skipping += encode_record_header(SEG, i, -1, b"x") + b"x"
    assert locate_record(reader(skipping), SEG, FILE_HEADER_SIZE, 0, len(skipping), 1) is None


def test_scan_tail_with_gaps() -> None:
    ids = [3, 4, 9, 10, 11, 40]
    data, where = build_with_gaps(ids)
    scan = scan_tail(
        reader(data), SEG, FILE_HEADER_SIZE, 0, len(data), interval=1, last_checkpoint=16
    )
    assert scan.next_id == 41 and scan.records == 6 and not scan.corrupt
    assert scan.base == 0 and len(scan.starts) == 41
    for i in range(41):  # skipped ids point at the next record: a zero-length span
        nxt = min(j for j in ids if j >= i)
        assert scan.starts[i] == where[nxt]
    # bounded dense positions
    scan = scan_tail(
        reader(data),
        SEG,
        FILE_HEADER_SIZE,
        0,
        len(data),
        interval=1,
        last_checkpoint=16,
        max_dense=5,
    )
    assert scan.base == 36 and list(scan.starts) == [where[40]] * 5
    # damage over entry 10's header: 10 lost; 5..8 are plain gaps, not corrupt
    data[where[10] + 1] ^= 1
    scan = scan_tail(
        reader(data), SEG, FILE_HEADER_SIZE, 0, len(data), interval=1, last_checkpoint=16
    )
    assert scan.corrupt == {10}
    assert scan.next_id == 41


def test_collect_entries_with_gaps() -> None:
    ids = [0, 2, 3, 7, 8, 20]
    data, where = build_with_gaps(ids)

    collect_all = functools.partial(collect, data, exact_start=False)
    assert collect_all(0, 100) == (ids, -1, True)
    assert collect_all(2, 7) == ([2, 3, 7], -1, True)
    assert collect_all(1, 7) == ([], -1, True)  # not stored
    assert collect_all(9, 19) == ([], -1, True)
    assert collect_all(3, 100, max_count=2) == ([3, 7], -1, True)
    # a damaged header: the ids it may have covered are corrupt, not skipped
    data[where[7] + 2] ^= 1
    assert collect_all(2, 100) == ([2, 3], -1, True)
    assert collect_all(4, 100) == ([], 4, True)
    assert collect_all(8, 100) == ([8, 20], -1, True)

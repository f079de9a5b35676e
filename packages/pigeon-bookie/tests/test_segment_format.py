"""The record format, the scanner and the sparse index, without any file."""

from __future__ import annotations

import itertools
import random
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pigeon.bookie._index import (
    SparseIndex,
    decode_checkpoints,
    encode_checkpoints,
    encode_index_header,
)
from pigeon.bookie._segment import (
    FILE_HEADER_SIZE,
    META_SIZE,
    REC,
    RECORD_HEADER_SIZE,
    TAIL,
    IdRanges,
    ReadFn,
    crc32c,
    decode_meta,
    encode_file_header,
    encode_meta,
    encode_record_header,
    parse_record_header,
    scan_records,
)
from pigeon.bookie._segment_scan import collect_entries, locate_record, scan_tail

SEG = 0xABCDEF


def payload(entry_id: int, size: int | None = None) -> bytes:
    rng = random.Random(entry_id)
    return rng.randbytes(rng.randrange(0, 300) if size is None else size)


def build(n: int, *, segment_id: int = SEG, lac_lag: int = 1) -> tuple[bytearray, list[int]]:
    """A data file with entries 0..n-1, and where each record starts."""
    data = bytearray(encode_file_header(segment_id))
    starts = []
    for i in range(n):
        p = payload(i)
        starts.append(len(data))
        data += encode_record_header(segment_id, i, i - lac_lag, p) + p
    return data, starts


def reader(data: bytes | bytearray) -> ReadFn:
    frozen = bytes(data)

    def read(pos: int, n: int) -> bytes:
        return frozen[pos : pos + n]

    return read


def test_header_layout() -> None:
    p = b"hello"
    h = encode_record_header(7, 9, 8, p)
    assert len(h) == RECORD_HEADER_SIZE == 40
    assert h[:4] == b"\xd7PGR"
    assert int.from_bytes(h[4:8], "little") == 5
    assert int.from_bytes(h[8:16], "little") == 7
    assert int.from_bytes(h[16:24], "little") == 9
    assert int.from_bytes(h[24:32], "little", signed=True) == 8
    assert int.from_bytes(h[32:36], "little") == crc32c(p)
    assert int.from_bytes(h[36:40], "little") == crc32c(h[:36])
    assert parse_record_header(h, 0) == (5, 7, 9, 8, crc32c(p))
    assert encode_file_header(7) == b"PGNLOG\x00\x01" + (7).to_bytes(8, "little")
    assert len(encode_file_header(7)) == FILE_HEADER_SIZE


@pytest.mark.parametrize("byte", range(40))
def test_any_header_byte_flip_is_detected(byte: int) -> None:
    h = bytearray(encode_record_header(7, 9, 8, b"x"))
    h[byte] ^= 0x10
    assert parse_record_header(bytes(h), 0) is None


def test_meta_round_trip_and_damage() -> None:
    m = encode_meta(5, fenced=True, lac=41)
    assert len(m) == META_SIZE
    assert decode_meta(m, 5) == (True, 41)
    assert decode_meta(encode_meta(5, fenced=False, lac=-1), 5) == (False, -1)
    assert decode_meta(m, 6) is None
    assert decode_meta(m[:-1], 5) is None
    bad = bytearray(m)
    bad[17] ^= 1
    assert decode_meta(bytes(bad), 5) is None


def test_scan_clean_file() -> None:
    data, starts = build(50)
    events = list(scan_records(reader(data), SEG, FILE_HEADER_SIZE, len(data), 0))
    assert [e[0] for e in events] == [REC] * 50
    assert [e[1] for e in events] == list(range(50))
    assert [e[2] for e in events] == starts
    assert all(e[6] and e[5] == payload(e[1]) for e in events)
    assert [e[4] for e in events] == [i - 1 for i in range(50)]


@pytest.mark.parametrize("chunk", [40, 97, 1 << 10, 1 << 20])
def test_scan_window_sizes(chunk: int) -> None:
    data, _ = build(30)
    events = list(scan_records(reader(data), SEG, FILE_HEADER_SIZE, len(data), 0, chunk=chunk))
    assert [e[1] for e in events] == list(range(30))
    assert all(e[5] == payload(e[1]) for e in events)


def test_scan_skips_payloads_below_verify_from() -> None:
    data, _ = build(10)
    events = list(scan_records(reader(data), SEG, FILE_HEADER_SIZE, len(data), 0, verify_from=6))
    assert [e[5] is None for e in events] == [True] * 6 + [False] * 4


def test_scan_payload_flip_reports_not_ok_and_goes_on() -> None:
    data, starts = build(10)
    data[starts[4] + RECORD_HEADER_SIZE] ^= 0xFF if len(payload(4)) else 0
    events = list(scan_records(reader(data), SEG, FILE_HEADER_SIZE, len(data), 0))
    assert [e[1] for e in events] == list(range(10))
    assert [e[6] for e in events] == [i != 4 or not payload(4) for i in range(10)]


def test_scan_resyncs_after_damaged_header() -> None:
    data, starts = build(10)
    data[starts[4] + 10] ^= 0x01  # inside entry 4's header
    events = list(scan_records(reader(data), SEG, FILE_HEADER_SIZE, len(data), 0))
    assert [e[1] for e in events] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert all(e[6] for e in events)


def test_scan_torn_tail() -> None:
    data, starts = build(5)
    cut = starts[4] + RECORD_HEADER_SIZE + 1
    events = list(scan_records(reader(data[:cut]), SEG, FILE_HEADER_SIZE, cut, 0))
    assert [e[0] for e in events] == [REC] * 4 + [TAIL]
    assert events[-1][2] == starts[4]


def test_scan_ignores_records_of_other_segments() -> None:
    data, _ = build(3)
    other, _ = build(3, segment_id=SEG + 1)
    data += other[FILE_HEADER_SIZE:]
    events = list(scan_records(reader(data), SEG, FILE_HEADER_SIZE, len(data), 0))
    assert [e[1] for e in events[:-1]] == [0, 1, 2]
    assert events[-1][0] == TAIL


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

    def collect(first: int, last: int, **kw: int) -> tuple[list[int], int, bool]:
        out, corrupt, ok = collect_entries(
            read,
            SEG,
            FILE_HEADER_SIZE,
            0,
            end,
            first,
            last,
            max_bytes=kw.get("max_bytes", 1 << 20),
            max_count=kw.get("max_count", 1000),
        )
        assert all(p == payload(i) for i, p in out)
        return [i for i, _ in out], corrupt, ok

    assert collect(0, 39)[0] == list(range(40))
    assert collect(5, 9)[0] == [5, 6, 7, 8, 9]
    assert collect(5, 100)[0] == list(range(5, 40))
    assert collect(5, 39, max_count=3)[0] == [5, 6, 7]
    assert collect(5, 39, max_bytes=1)[0] == [5]  # always one entry
    sizes = [len(payload(i)) for i in range(40)]
    assert collect(0, 39, max_bytes=sizes[0] + sizes[1])[0] == [0, 1]
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
    read = reader(data)

    def collect(first: int) -> tuple[list[int], int]:
        out, corrupt, ok = collect_entries(
            read, SEG, FILE_HEADER_SIZE, 0, len(data), first, 9, max_bytes=1 << 20, max_count=99
        )
        assert ok
        return [i for i, _ in out], corrupt

    assert collect(0) == ([0, 1, 2, 3, 4], -1)
    assert collect(5) == ([], 5)
    assert collect(6) == ([6, 7, 8, 9], -1)


def test_collect_entries_resyncs_over_lost_header() -> None:
    data, starts = build(10)
    data[starts[0] : starts[0] + 40] = bytes(40)
    read = reader(data)
    out, corrupt, ok = collect_entries(
        read, SEG, FILE_HEADER_SIZE, 0, len(data), 0, 9, max_bytes=1 << 20, max_count=99
    )
    assert (out, corrupt, ok) == ([], -1, False)  # exact start required by default
    out, corrupt, ok = collect_entries(
        read,
        SEG,
        FILE_HEADER_SIZE,
        0,
        len(data),
        0,
        9,
        max_bytes=1 << 20,
        max_count=99,
        exact_start=False,
    )
    assert (out, corrupt, ok) == ([], 0, True)
    out, corrupt, ok = collect_entries(
        read,
        SEG,
        FILE_HEADER_SIZE,
        0,
        len(data),
        3,
        9,
        max_bytes=1 << 20,
        max_count=99,
        exact_start=False,
    )
    assert [i for i, _ in out] == list(range(3, 10))


def test_checkpoint_encoding() -> None:
    points = [(5, 1000), (9, 70000), (2**40, 2**50)]
    raw = encode_checkpoints(points)
    assert len(raw) == 48
    assert raw[:16] == (5).to_bytes(8, "little") + (1000).to_bytes(8, "little")
    ids, pos = decode_checkpoints(raw + b"\x01\x02")  # partial record ignored
    assert list(zip(ids, pos, strict=True)) == points
    assert encode_index_header(3) == b"PGNIDX\x00\x01" + (3).to_bytes(8, "little")


def test_sparse_index_lookup_and_damage() -> None:
    idx = SparseIndex(array("q", [10, 20, 30]), array("q", [100, 200, 300]))
    assert idx.lookup(0) == (0, FILE_HEADER_SIZE)
    assert idx.lookup(9) == (0, FILE_HEADER_SIZE)
    assert idx.lookup(10) == (10, 100)
    assert idx.lookup(25) == (20, 200)
    assert idx.lookup(10**9) == (30, 300)
    idx.discard(20)
    assert idx.lookup(25) == (10, 100)
    idx.discard(0)  # the implicit first checkpoint stays
    assert idx.lookup(5) == (0, FILE_HEADER_SIZE)
    idx.append(40, 400)
    idx.append(35, 500)  # not increasing: ignored
    assert idx.lookup(45) == (40, 400)
    # a damaged (non increasing) list keeps its increasing subsequence
    bad = SparseIndex(array("q", [10, 5, 20, 30]), array("q", [100, 900, 200, 150]))
    assert list(bad.ids) == [0, 10, 20]
    assert list(bad.positions) == [FILE_HEADER_SIZE, 100, 200]


@given(st.lists(st.tuples(st.integers(17, 40), st.integers(1, 12)), max_size=9))
def test_damaged_index_keeps_the_longest_consistent_run(points: list[tuple[int, int]]) -> None:
    pairs = sorted(set(points))
    idx = SparseIndex(array("q", [i for _, i in points]), array("q", [p for p, _ in points]))
    kept = list(zip(idx.ids[1:], idx.positions[1:], strict=True))
    assert all(a[0] < b[0] and a[1] < b[1] for a, b in itertools.pairwise(kept))
    assert set((p, i) for i, p in kept) <= set(pairs)
    best = 0
    for mask in range(1 << len(pairs)):
        chosen = [pairs[k] for k in range(len(pairs)) if mask >> k & 1]
        if all(a[0] < b[0] and a[1] < b[1] for a, b in itertools.pairwise(chosen)):
            best = max(best, len(chosen))
    assert len(kept) == best


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


def test_id_ranges_discard() -> None:
    ids = IdRanges([1, 2, 3, 7, 8])
    ids.discard(2)
    ids.discard(7)
    ids.discard(100)
    assert ids == {1, 3, 8}
    assert str(ids) == "1,3,8"
    ids.discard(1)
    ids.discard(3)
    ids.discard(8)
    assert not ids

"""The record format, the record scanner and id ranges (pigeon.bookie._segment),
without any file."""

from __future__ import annotations

import random

import pytest

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
from pigeon.bookie._segment_scan import dense_positions

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


def test_id_ranges() -> None:
    r = IdRanges([5, 1, 2, 3])
    r.add_range(10, 1_000_000_000)
    r.add_range(4, 4)  # joins 1..5
    assert r.ranges() == [(1, 5), (10, 1_000_000_000)]
    assert 3 in r and 7 not in r and 999_999_999 in r and 0 not in r
    assert len(r) == 5 + 1_000_000_000 - 9
    assert r.below(12).ranges() == [(1, 5), (10, 11)]
    assert IdRanges([1, 2]) == {1, 2} and IdRanges() == set() and not IdRanges()
    r.add_range(6, 9)
    assert r.ranges() == [(1, 1_000_000_000)]
    assert list(dense_positions([2, 5], [100, 200], 0, 6)) == [100, 100, 100, 200, 200, 200]

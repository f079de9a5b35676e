"""``pigeon bookie inspect DATA_DIR``: a report of a stopped bookie's segments."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import trio
from click.testing import CliRunner, Result

from pigeon.bookie import SegmentStore, inspect_data_dir
from pigeon.bookie._segment import RECORD_HEADER_SIZE, encode_record_header
from pigeon.core._cli import make_cli
from pigeon.core.errors import StorageError


def inspect(path: Path, *args: str) -> Result:
    return CliRunner().invoke(make_cli(), ["bookie", "inspect", str(path), *args])


def payload(segment_id: int, entry_id: int) -> bytes:
    return bytes([segment_id, entry_id % 256]) * 300


async def write(path: Path) -> dict[int, int]:
    """Three segments: 1 (10 entries), 2 (striped, fenced), 3 (starts at entry 1000).
    Returns where entry 5 of segment 1 starts in its data file."""
    store = SegmentStore(path, index_interval_bytes=1000)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        for i in range(10):
            await store.add_entry(1, i, payload(1, i), lac=i - 1)
        for i in (0, 1, 3, 4, 6, 7):
            await store.add_entry(2, i, payload(2, i), lac=max(i - 2, -1))
        await store.fence(2)
        for i in range(1000, 1004):
            await store.add_entry(3, i, payload(3, i))
        where = {i: store._segments[1].starts[i] for i in range(10)}
        nursery.cancel_scope.cancel()
    return where


def digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def log_of(path: Path, segment_id: int) -> Path:
    return path / "segments" / f"{segment_id:016x}.log"


async def test_healthy_data_dir(tmp_path: Path) -> None:
    await write(tmp_path)
    before = digest(tmp_path)
    result = inspect(tmp_path)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:3] == ["SEGMENT", "ENTRIES", "FIRST"]
    assert lines[1].split()[:7] == ["0000000000000001", "10", "0", "9", "8", "no", "6.3"]
    assert lines[2].split()[:6] == ["0000000000000002", "6", "0", "7", "5", "yes"]
    assert lines[3].split()[:5] == ["0000000000000003", "4", "1000", "1003", "-1"]
    assert "3 segments, 20 entries" in result.output and "0 corrupt" in result.output
    result = inspect(tmp_path, "--json")
    assert result.exit_code == 0
    report = json.loads(result.output)
    assert not report["corrupt"] and report["totals"]["entries"] == 20
    seg2 = report["segments"][1]
    assert seg2["segment"] == "0000000000000002" and seg2["fenced"] and seg2["meta"] == "ok"
    assert seg2["status"] == "ok" and seg2["index"] == "ok"
    one = inspect(tmp_path, "--json", "--segment", "3")
    assert [s["segment_id"] for s in json.loads(one.output)["segments"]] == [3]
    assert digest(tmp_path) == before  # inspecting changes nothing


async def test_torn_tail_is_reported_not_counted_as_corruption(tmp_path: Path) -> None:
    await write(tmp_path)
    p = payload(1, 10)
    with log_of(tmp_path, 1).open("ab") as f:  # a crash in the middle of an append
        f.write(encode_record_header(1, 10, 9, p) + p[:100])
    before = digest(tmp_path)
    result = inspect(tmp_path, "--json")
    assert result.exit_code == 0, result.output
    seg1 = json.loads(result.output)["segments"][0]
    assert seg1["torn_tail_bytes"] == RECORD_HEADER_SIZE + 100 and seg1["last_entry_id"] == 9
    assert "torn tail" in seg1["status"]
    assert digest(tmp_path) == before  # reported, not truncated


@pytest.mark.parametrize("damage", ["payload", "header", "meta", "garbage"])
async def test_corruption_exits_1(tmp_path: Path, damage: str) -> None:
    where = await write(tmp_path)
    log = log_of(tmp_path, 1)
    data = bytearray(log.read_bytes())
    if damage == "payload":
        data[where[5] + RECORD_HEADER_SIZE + 7] ^= 0x10
    elif damage == "header":
        data[where[5] + 20] ^= 0x01
    elif damage == "garbage":  # a block overwritten: entries 4..6 gone
        data[where[4] + 3 : where[7] - 3] = b"\xa5" * (where[7] - where[4] - 6)
    log.write_bytes(data)
    if damage == "meta":
        meta = tmp_path / "segments" / f"{2:016x}.meta"
        raw = bytearray(meta.read_bytes())
        raw[20] ^= 1
        meta.write_bytes(raw)
    result = inspect(tmp_path)
    assert result.exit_code == 1, result.output
    assert "CORRUPT" in result.output
    report = inspect_data_dir(tmp_path)
    bad = {s.segment_id: s for s in report.segments if s.corrupt}
    if damage == "payload":
        assert bad[1].damaged_entries == [5] and bad[1].entries == 9
    elif damage == "header":
        assert bad[1].lost_ranges == [(5, 5)] and bad[1].last_entry_id == 9
    elif damage == "garbage":
        assert bad[1].lost_ranges == [(4, 6)] and bad[1].entries == 7
    else:
        assert list(bad) == [2] and bad[2].meta == "damaged" and bad[2].fenced


async def test_a_running_bookie_is_not_inspected(tmp_path: Path) -> None:
    await write(tmp_path)
    store = SegmentStore(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        result = inspect(tmp_path)
        assert result.exit_code == 2
        assert "in use by a running bookie" in result.output
        nursery.cancel_scope.cancel()
    assert inspect(tmp_path).exit_code == 0


def test_not_a_data_dir(tmp_path: Path) -> None:
    result = inspect(tmp_path)
    assert result.exit_code == 2 and "not a segment-files data directory" in result.output


async def test_a_data_dir_of_another_ledger_storage(tmp_path: Path) -> None:
    """A bookie that ran another backend (``ledger_storage``) left its FORMAT: inspect
    says so in one line, and a segment-files store refuses the directory too."""
    (tmp_path / "FORMAT").write_bytes(b"pigeon-journal 1\n")
    (tmp_path / "journal").mkdir()
    result = inspect(tmp_path)
    assert result.exit_code == 2
    [line] = result.output.strip().splitlines()
    assert "another ledger storage ('pigeon-journal 1')" in line
    assert "segment-files" in line
    store = SegmentStore(tmp_path)
    with pytest.raises(StorageError, match="another ledger storage"):
        await store.run()
    assert (tmp_path / "FORMAT").read_bytes() == b"pigeon-journal 1\n"

"""Test helpers that damage a bookie's files on purpose, as a lost sector or a bad disk
would: where a segment's data file is, and flipping one bit of one entry's payload.

:class:`pigeon.core.testing.ReplicationPolicyContract` uses them to check that reads
pass over a damaged copy and repair it; the file layout is :mod:`pigeon.bookie._segment`.
"""

from __future__ import annotations

from pathlib import Path

from pigeon.bookie._segment import FILE_HEADER_SIZE, REC, RECORD_HEADER_SIZE, scan_records

__all__ = ["flip_payload_byte", "segment_file"]


def segment_file(data_dir: Path, segment_id: int) -> Path:
    """The data file of a segment in a bookie's data directory."""
    return data_dir / "segments" / f"{segment_id:016x}.log"


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

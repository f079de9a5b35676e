"""The ledger's metadata document across broker versions: a segment field this version
does not know (written by a newer broker in a rolling upgrade) is kept, not refused."""

from __future__ import annotations

from pigeon.broker._ledger_state import SegmentInfo


def test_unknown_segment_fields_are_kept_and_written_back() -> None:
    doc = {"id": 3, "first_offset": 10, "ensemble": ["b1:3181"], "entries": 2, "future": [1]}
    info = SegmentInfo.from_doc(doc)
    assert (info.id, info.first_offset, info.entries) == (3, 10, 2)
    info.entries = 5
    out = info.to_doc()
    assert out["future"] == [1] and out["entries"] == 5
    assert "unknown_fields" not in out
    assert SegmentInfo.from_doc(out) == info

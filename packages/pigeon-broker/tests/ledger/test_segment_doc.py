"""The ledger's metadata document across broker versions: a segment field this version
does not know (written by a newer broker in a rolling upgrade) is kept, not refused."""

from __future__ import annotations

import json

from ledger_fakes import ledger_world, settle

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


async def test_a_save_after_a_conflict_keeps_what_a_newer_auditor_wrote() -> None:
    """Rolling upgrade: a newer auditor adds fields this version does not know to a closed
    segment (and to the document) between two saves of the owner.  The owner's save
    meets the conflict, merges, and must write those fields back as stored, not the
    stale copy it loaded."""
    async with ledger_world() as world:
        store = world.store
        first = await world.open()
        world.append(first, 0)
        world.writer.store(0)
        await settle()
        await first.close()  # its segment closed; a newer broker takes the ledger
        ledger = await world.open()
        closed = ledger.segments[0]
        assert closed.state == "closed"
        # the newer auditor rewrites the closed segment (compare-and-set at its version)
        stat = await store.get(ledger.path)
        doc = json.loads(stat.value)
        doc["segments"][0]["placement"] = {"rack": "new"}
        doc["tiers"] = ["hot"]
        await store.set(ledger.path, json.dumps(doc).encode(), version=stat.version)
        await ledger._save()  # the owner's next save: a conflict, merged
        saved = json.loads((await store.get(ledger.path)).value)
        (seg,) = [s for s in saved["segments"] if s["id"] == closed.id]
        assert seg["placement"] == {"rack": "new"}
        assert saved["tiers"] == ["hot"]
        # and the next owner still sees them
        again = await world.open()
        assert again.segments[0].unknown_fields == {"placement": {"rack": "new"}}

"""The ledger's read path: confirmed entries (from the cache or the bookies), damaged
runs, and seeking by offset or publish time."""

from __future__ import annotations

import bisect

from pigeon.broker._cursor import RangeSet
from pigeon.broker._ledger_state import (
    DamagedRun,
    Entry,
    LedgerState,
    Position,
    SegmentInfo,
    log,
)
from pigeon.core.batch import unpack_entry_header
from pigeon.core.errors import (
    CorruptEntry,
    EntryNotFound,
    OffloadError,
    SegmentNotFound,
    ServiceUnavailable,
)

__all__ = ["LedgerReads"]

#: damaged entries read one by one looking for the end of a damaged run, before the
#: search gallops (a run that long is a whole damaged region)
DAMAGE_PROBES = 4096
#: entries a binary search (seek by offset or time) reads past a damaged one
NEAR_PROBES = 64
#: the errors with which a policy says no replica holds an entry intact
_UNREADABLE = (CorruptEntry, EntryNotFound, SegmentNotFound)


class LedgerReads(LedgerState):
    """Reading a ledger's confirmed entries."""

    async def read(
        self, pos: Position, *, max_entries: int = 100, max_bytes: int | None = None
    ) -> list[Entry]:
        """Confirmed entries from ``pos`` on, within one segment; [] at the end."""
        max_bytes = max_bytes or self.config.read_batch_bytes
        npos = self.normalize(pos)
        if npos is None:
            return []
        seg_id, entry_id = npos
        index = self._index[seg_id]
        seg = self.segments[index]
        last = min(seg.last_entry_id, entry_id + max_entries - 1)
        out: list[Entry] = []
        total = 0
        eid = entry_id
        while eid <= last and total < max_bytes:
            data = self.cache.get((seg.id, eid))
            if data is None:
                break
            out.append(self._entry(seg, eid, data))
            total += len(data)
            eid += 1
        if not out and seg.offload is not None:
            offloaded = await self._read_offloaded(seg, entry_id, last, max_bytes)
            if offloaded is not None:
                return offloaded
        if not out:
            ensemble, fragment_end = seg.ensemble_for(entry_id)
            if fragment_end >= 0:
                last = min(last, fragment_end - 1)
            try:
                raw = await self.policy.read(
                    seg.id,
                    ensemble,
                    entry_id,
                    last,
                    max_bytes=max_bytes,
                    max_count=max_entries,
                    write_quorum=seg.write_quorum or None,
                    # copies found damaged are repaired, unless a writer still appends
                    repair=seg.state == "closed",
                )
            except _UNREADABLE as exc:
                raise CorruptEntry(
                    f"topic {self.topic} segment {seg.id} entry {entry_id} is on no replica"
                    f" intact: {exc}"
                ) from None
            if not raw:
                raise CorruptEntry(
                    f"topic {self.topic} segment {seg.id} entry {entry_id} is on no replica"
                )
            for eid2, data in raw:
                out.append(self._entry(seg, eid2, data))
        return out

    async def _read_offloaded(
        self, seg: SegmentInfo, first: int, last: int, max_bytes: int
    ) -> list[Entry] | None:
        """Entries of an offloaded segment from the offloader; None: read the bookies
        instead (they still hold the segment and the offloader failed or is off)."""
        if self.offloader is None:
            if seg.bookies_deleted:
                raise ServiceUnavailable(
                    f"topic {self.topic} segment {seg.id} is offloaded"
                    f" ({seg.offload.get('driver') if seg.offload else '?'}) and this broker"
                    " has no offloader: set managed_ledger_offload_driver"
                )
            return None
        try:
            raw = await self.offloader.read(seg.offload, first, last, max_bytes=max_bytes)
        except OffloadError as exc:
            if seg.bookies_deleted:
                raise
            log.warning(
                "offloaded read failed topic=%s segment=%s error=%s; reading the bookies",
                self.topic,
                seg.id,
                exc,
            )
            return None
        except (CorruptEntry, EntryNotFound) as exc:
            if seg.bookies_deleted:
                raise CorruptEntry(
                    f"topic {self.topic} segment {seg.id} entry {first} is not intact in"
                    f" the offloaded copy: {exc}"
                ) from None
            log.error(
                "offloaded copy damaged topic=%s segment=%s error=%s; reading the bookies",
                self.topic,
                seg.id,
                exc,
            )
            return None
        return [self._entry(seg, eid, data) for eid, data in raw]

    # Damaged entries: an entry the metadata says is stored that no replica holds
    # intact makes ``read`` raise CorruptEntry.  ``skip_damaged`` finds where the run of
    # such entries ends, so that readers can go on past it (subscriptions do, or stop,
    # per their corrupt-entry policy); the runs found are remembered and counted.

    @property
    def corrupt_entries(self) -> int:
        """Entries found on no replica intact since the ledger was opened."""
        return sum(r.count_in(0, 1 << 63) for r in self._damaged.values())

    @property
    def damaged_runs(self) -> list[DamagedRun]:
        return list(self._damaged_runs)

    def _record_damage(self, run: DamagedRun) -> bool:
        """Remember ``run``; False if it was known already."""
        ids = self._damaged.setdefault(run.segment_id, RangeSet())
        new = ids.count_in(run.first_entry, run.last_entry + 1) < run.entries
        ids.add(run.first_entry, run.last_entry + 1)
        if new:
            self._damaged_runs.append(run)
        return new

    def known_damage(self, pos: Position) -> DamagedRun | None:
        """The damaged run found earlier that holds ``pos``, if any."""
        for run in self._damaged_runs:
            if run.segment_id == pos[0] and run.first_entry <= pos[1] <= run.last_entry:
                return run
        return None

    async def skip_damaged(self, pos: Position) -> DamagedRun:
        """The run of damaged entries that starts at ``pos`` (where ``read`` raised
        CorruptEntry) and where reading goes on after it.

        Reads forward one entry at a time (a run past the last entry any replica of the
        segment stores is the rest of the segment at once), galloping after
        ``DAMAGE_PROBES`` damaged entries.  Raises a retriable error when bookies do not
        answer (the run's end cannot be known yet).
        """
        npos = self.normalize(pos) or pos
        known = self.known_damage(npos)
        if known is not None:
            return known
        seg_id, first = npos
        index = self._index.get(seg_id)
        if index is None:
            raise EntryNotFound(f"topic {self.topic} has no segment {seg_id}")
        seg = self.segments[index]
        ensemble, fragment_end = seg.ensemble_for(first)
        # the bookies know nothing of a segment whose copies they deleted (offloaded)
        stored = None if seg.bookies_deleted else getattr(self.policy, "stored_last_entry", None)
        after: Entry | None = None
        k = seg.last_entry_id + 1
        if stored is None or fragment_end >= 0 or int(await stored(seg.id, ensemble)) >= first:
            end = seg.last_entry_id
            k, step, probes, bad = first + 1, 1, 0, first  # bad: last entry seen damaged
            while k <= end:
                try:
                    after = await self.read_one((seg.id, k))
                    break
                except CorruptEntry:
                    bad = k
                probes += 1
                if probes >= DAMAGE_PROBES:
                    step *= 2  # a whole damaged region: gallop
                k = k + step if k + step <= end or k == end else end
            if after is not None and after.entry_id > bad + 1:
                after = await self._first_readable(seg, bad + 1, after)
            k = after.entry_id if after is not None else end + 1
        if after is not None:
            end_offset = after.first_offset
        elif index + 1 < len(self.segments):
            end_offset = self.segments[index + 1].first_offset
        else:
            end_offset = self.next_offset
        run = DamagedRun(seg.id, first, k - 1, (seg.id, k), end_offset)
        if self._record_damage(run):
            log.error(
                "damaged entries topic=%s segment=%s entries=%s..%s (%s) are on no replica"
                " intact; readers go on at entry %s (offset %s)",
                self.topic,
                seg.id,
                run.first_entry,
                run.last_entry,
                run.entries,
                k,
                end_offset,
            )
        return run

    async def _first_readable(self, seg: SegmentInfo, lo: int, found: Entry) -> Entry:
        """After galloping: the first readable entry in ``lo..found`` (binary search,
        taking the damage as one stretch)."""
        hi = found.entry_id
        best = found
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                best = await self.read_one((seg.id, mid))
                hi = mid
            except CorruptEntry:
                lo = mid + 1
        return best if best.entry_id == lo else found

    async def _read_near(self, seg: SegmentInfo, k: int, hi: int) -> Entry | None:
        """Entry ``k``, or the first readable one after it up to ``hi`` (a few tried)."""
        for j in range(k, min(hi, k + NEAR_PROBES) + 1):
            try:
                return await self.read_one((seg.id, j))
            except CorruptEntry:
                continue
        return None

    def _entry(self, seg: SegmentInfo, entry_id: int, data: bytes | memoryview) -> Entry:
        header = unpack_entry_header(data)
        return Entry(
            seg.id,
            entry_id,
            (seg.id, entry_id),
            data,
            header.num_messages,
            header.first_offset,
            header.publish_time,
            header.deliver_at,
        )

    async def read_one(self, pos: Position) -> Entry:
        entries = await self.read(pos, max_entries=1)
        if not entries or entries[0].position != pos:
            raise EntryNotFound(f"no entry at {pos}")
        return entries[0]

    async def position_for_offset(self, offset: int) -> Position:
        """Position of the entry holding ``offset`` (the end position if past the end)."""
        if not self.segments or offset >= self.next_offset:
            return self.end_position()
        firsts = [s.first_offset for s in self.segments]
        index = max(bisect.bisect_right(firsts, offset) - 1, 0)
        seg = self.segments[index]
        if seg.last_entry_id < 0 or offset < seg.first_offset:
            return (seg.id, 0)
        lo, hi = 0, seg.last_entry_id
        while lo < hi:  # last entry whose first offset <= offset
            mid = (lo + hi + 1) // 2
            # a damaged entry is passed over: at worst an earlier position is returned
            entry = await self._read_near(seg, mid, hi)
            if entry is not None and entry.first_offset <= offset:
                lo = entry.entry_id
            else:
                hi = mid - 1
        return (seg.id, lo)

    async def position_for_time(self, timestamp_ms: int) -> Position:
        """First entry published at or after ``timestamp_ms``."""
        for seg in self.segments:
            if seg.last_entry_id < 0 or seg.last_publish_time < timestamp_ms:
                continue
            lo, hi = 0, seg.last_entry_id
            while lo < hi:
                mid = (lo + hi) // 2
                # a damaged entry is passed over: at worst an earlier position is returned
                entry = await self._read_near(seg, mid, hi)
                if entry is None or entry.publish_time >= timestamp_ms:
                    hi = mid
                else:
                    lo = entry.entry_id + 1
            return (seg.id, lo)
        return self.end_position()

    async def _last_readable(self, seg: SegmentInfo) -> Entry | None:
        """The last entry of ``seg`` some replica holds intact (None: no entry is)."""
        top = seg.last_entry_id
        stored = None if seg.bookies_deleted else getattr(self.policy, "stored_last_entry", None)
        if stored is not None and seg.ensemble_for(top)[1] < 0:
            ensemble = seg.ensemble_for(top)[0]
            top = min(top, int(await stored(seg.id, ensemble)))
        k, step, probes = top, 1, 0
        while k >= 0:
            try:
                return await self.read_one((seg.id, k))
            except CorruptEntry:
                pass
            probes += 1
            if probes > NEAR_PROBES:
                step *= 2  # a long damaged stretch: gallop back
            k -= step
        return None

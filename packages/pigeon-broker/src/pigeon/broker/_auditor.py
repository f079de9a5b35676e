"""Auto-recovery: an elected auditor re-replicates what a lost bookie held.

Every broker runs an :class:`Auditor`; a leader election in the metadata store
(``/pigeon/auditor``) lets exactly one of them work. Each pass it compares the bookies
registered now with the ensembles of every *closed* segment (open ones are handled by
their writer's ensemble change). A bookie missing for longer than the grace period (the
original design's "permissible downtime", so a bookie that restarts quickly is not copied
needlessly) is replaced: the entries it held are read from surviving replicas, written
to a bookie outside the ensemble chosen by load and free space, and the fragment's
ensemble is updated in the ledger's metadata (compare-and-set, merged by the owner).
The number of under-replicated fragments is logged and reported in the broker's stats.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import trio

from pigeon.broker._ledger_state import SegmentInfo
from pigeon.core.errors import BadVersion, PigeonError
from pigeon.core.metadata import lead_forever
from pigeon.core.paths import AUDITOR_PATH, BOOKIES_PATH, LEDGERS_PATH

__all__ = ["Auditor", "read_bookies"]

log = logging.getLogger(__name__)


async def read_bookies(store: Any) -> dict[str, dict[str, Any]]:
    """The registered bookies and the document each registered (``{}`` when it is empty
    or not JSON: the bookie is registered all the same)."""
    found: dict[str, dict[str, Any]] = {}
    for name in await store.children(BOOKIES_PATH):
        stat = await store.get(f"{BOOKIES_PATH}/{name}")
        if stat is not None:
            try:
                found[name] = json.loads(stat.value) if stat.value else {}
            except ValueError:
                found[name] = {}
    return found


class Auditor:
    def __init__(
        self,
        service: Any,
        *,
        grace_period_s: float = 30.0,
        interval_s: float = 5.0,
    ) -> None:
        self.service = service
        self.store = service.store
        self.grace_period_s = grace_period_s
        self.interval_s = interval_s
        self.under_replicated = 0
        self.replicated_fragments = 0
        self.is_leader = False
        self._missing_since: dict[str, float] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await lead_forever(
            self.store,
            AUDITOR_PATH,
            self.service.service_url,
            self._lead,
            task_status=task_status,
        )

    async def _lead(self) -> None:
        self.is_leader = True
        log.info("auditor elected broker=%s", self.service.service_url)
        try:
            while True:
                try:
                    await self.check_once()
                except PigeonError as exc:
                    log.warning("audit pass failed error=%s", exc)
                await trio.sleep(self.interval_s)
        finally:
            self.is_leader = False

    # ------------------------------------------------------------------ one pass

    async def _ledger_paths(self) -> list[str]:
        paths: list[str] = []
        for domain in await self.store.children(LEDGERS_PATH):
            for tenant in await self.store.children(f"{LEDGERS_PATH}/{domain}"):
                for ns in await self.store.children(f"{LEDGERS_PATH}/{domain}/{tenant}"):
                    base = f"{LEDGERS_PATH}/{domain}/{tenant}/{ns}"
                    paths.extend(f"{base}/{t}" for t in await self.store.children(base))
        return paths

    async def check_once(self) -> int:
        """One audit pass; returns the under-replicated fragments left."""
        bookies = await read_bookies(self.store)
        now = trio.current_time()
        alive = set(bookies)
        for address in list(self._missing_since):
            if address in alive:
                del self._missing_since[address]
        under = 0
        for path in await self._ledger_paths():
            stat = await self.store.get(path)
            if stat is None:
                continue
            segments = [SegmentInfo.from_doc(s) for s in json.loads(stat.value).get("segments", [])]
            for seg in segments:
                if seg.state != "closed" or seg.last_entry_id < 0 or seg.bookies_deleted:
                    continue  # open, empty, or only offloaded: nothing on bookies
                for first, end, ensemble in _fragments(seg):
                    for index, address in enumerate(ensemble):
                        if address in alive:
                            continue
                        since = self._missing_since.setdefault(address, now)
                        under += 1
                        if now - since < self.grace_period_s:
                            continue
                        if await self._replicate(path, seg, first, end, ensemble, index, bookies):
                            under -= 1
        if under != self.under_replicated:
            log.info("under-replicated fragments=%s", under)
        self.under_replicated = under
        return under

    async def _replicate(
        self,
        path: str,
        seg: SegmentInfo,
        first: int,
        end: int,
        ensemble: list[str],
        index: int,
        bookies: dict[str, dict[str, Any]],
    ) -> bool:
        lost = ensemble[index]
        candidates = [
            (info.get("segments", 0), -int(info.get("free_disk", 0) or 0), address)
            for address, info in bookies.items()
            if address not in ensemble and not info.get("read_only")
        ]
        if not candidates:
            log.warning("no bookie to re-replicate segment=%s lost=%s", seg.id, lost)
            return False
        target = min(candidates)[2]
        policy = self.service.policy
        client = policy.client
        e = len(ensemble)
        qw = min(seg.write_quorum or policy.write_quorum, e)
        survivors = [a for a in ensemble if a != lost]
        copied = 0
        entry = first
        while entry < end:
            held = qw == e or index in [(entry + k) % e for k in range(qw)]
            if not held:
                entry += 1
                continue
            got = await policy.read(seg.id, [*survivors, lost], entry, entry, write_quorum=e)
            for eid, data in got:
                await client.add_entry(target, seg.id, eid, -1, data)
                copied += 1
            entry += 1
        await self._record(path, seg.id, first, index, target)
        self.replicated_fragments += 1
        log.info(
            "re-replicated segment=%s entries=%s..%s lost=%s to=%s copied=%s",
            seg.id,
            first,
            end - 1,
            lost,
            target,
            copied,
        )
        return True

    async def _record(
        self, path: str, segment_id: int, first: int, index: int, target: str
    ) -> None:
        """Replace the lost bookie in that fragment's ensemble (compare-and-set)."""
        for _attempt in range(10):
            stat = await self.store.get(path)
            if stat is None:
                return
            doc = json.loads(stat.value)
            for s in doc.get("segments", []):
                if s["id"] != segment_id:
                    continue
                info = SegmentInfo.from_doc(s)
                if not info.fragments:
                    info.ensemble[index] = target
                elif first == 0:
                    info.initial_ensemble[index] = target
                else:
                    for frag in info.fragments:
                        if frag[0] == first:
                            frag[1][index] = target
                    info.ensemble = list(info.fragments[-1][1])
                s.update(
                    ensemble=info.ensemble,
                    fragments=info.fragments,
                    initial_ensemble=info.initial_ensemble,
                )
            try:
                await self.store.set(path, json.dumps(doc).encode(), version=stat.version)
                return
            except BadVersion:
                continue


def _fragments(seg: SegmentInfo) -> list[tuple[int, int, list[str]]]:
    """(first entry, end entry exclusive, ensemble) of each fragment of a closed segment."""
    out = []
    starts = [0] + [f[0] for f in seg.fragments]
    ensembles = [seg.initial_ensemble or seg.ensemble] + [f[1] for f in seg.fragments]
    if not seg.fragments:
        ensembles = [seg.ensemble]
        starts = [0]
    for i, (first, ensemble) in enumerate(zip(starts, ensembles, strict=True)):
        end = starts[i + 1] if i + 1 < len(starts) else seg.last_entry_id + 1
        if end > first:
            out.append((first, end, list(ensemble)))
    return out

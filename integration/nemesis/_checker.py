"""The history checker: what a nemesis run's history says about PigeonMQ's promises.

:func:`check` reads a :class:`~._history.History` and returns a :class:`Report`.  Its
``violations`` name every broken safety property (DESIGN §13):

(a) **lost** — acknowledged, but missing from the final read of the topic from the
    earliest position;
(b) **order** — one producer's messages out of sequence order within a partition of the
    log (positions ordered by offset);
(c) **duplicates** — a message stored at more than one position (de-duplication is on);
(d) **undelivered** — an acknowledged message that a durable subscription (or a reader
    open for the whole run) never received, within the bounded drain;
(e) **detached** — a subscription whose consumers were not all attached at the end, or
    whose backlog did not drain;
(f) **wrong receipts** — an acknowledgement naming a position that does not hold the
    message: it is stored elsewhere, or it is lost and the position holds another message
    (a receipt that names no position at all is counted, not failed: de-duplication may
    answer a resend so when it no longer remembers the original; a lost one shows up as (a)).

(g) **redelivered after a receipt** — a message delivered to a subscription again after
    its consumer got an ack receipt for it (``ack_receipt_enabled``: the ack was stored in
    the cursor, so no fault may bring the message back).

The figures (acknowledged, lost, duplicates, unexpected, faults by kind, write
unavailability) are what ``docs/reliability.md`` tabulates.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from ._history import Fault, History, MsgId, Position, Send

__all__ = ["Report", "check", "gaps", "longest_gap", "longest_overlapping"]

#: Examples kept per violation in the report.
EXAMPLES = 5


@dataclass
class Report:
    sent: int = 0
    acknowledged: int = 0
    failed: int = 0
    pending: int = 0  # neither acknowledged nor failed when the run ended
    lost: int = 0
    #: acknowledged, missing, in a topic whose final read could not finish
    unverified: int = 0
    duplicates: int = 0  # extra stored copies
    unexpected: int = 0  # read but never sent
    reordered: int = 0
    #: failed or pending sends found in the log anyway (allowed: outcome unknown)
    indeterminate_stored: int = 0
    receipts_without_position: int = 0
    wrong_receipts: int = 0
    #: messages whose ack got a receipt, and those delivered again after it (g)
    ack_receipts: int = 0
    redelivered_after_receipt: int = 0
    #: acks with receipts that failed (AckNotPersisted, allowed: redelivered)
    acks_not_persisted: int = 0
    undelivered: dict[str, int] = field(default_factory=dict)
    redelivered: dict[str, int] = field(default_factory=dict)
    detached: dict[str, str] = field(default_factory=dict)
    #: subscription -> longest stretch of samples with fewer consumers than opened (s)
    detached_longest: dict[str, float] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    crashes: int = 0
    restart_failures: int = 0
    longest_unavailable: float = 0.0
    longest_unavailable_by_topic: dict[str, float] = field(default_factory=dict)
    #: per fault: "kind target at" -> longest gap between acks while it lasted and after
    unavailable_after_fault: dict[str, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def figures(self) -> dict[str, Any]:
        """The numbers a run appends to the results file."""
        return {
            "sent": self.sent,
            "acknowledged": self.acknowledged,
            "failed": self.failed,
            "pending": self.pending,
            "lost": self.lost,
            "unverified": self.unverified,
            "duplicates": self.duplicates,
            "unexpected": self.unexpected,
            "reordered": self.reordered,
            "undelivered": sum(self.undelivered.values()),
            "detached": sorted(self.detached),
            "longest_detached_s": max(self.detached_longest.values(), default=0.0),
            "wrong_receipts": self.wrong_receipts,
            "receipts_without_position": self.receipts_without_position,
            "ack_receipts": self.ack_receipts,
            "redelivered_after_receipt": self.redelivered_after_receipt,
            "acks_not_persisted": self.acks_not_persisted,
            "faults": dict(self.faults),
            "crashes": self.crashes,
            "restart_failures": self.restart_failures,
            "longest_unavailable_s": round(self.longest_unavailable, 2),
            "longest_unavailable_after_fault_s": round(
                max(self.unavailable_after_fault.values(), default=0.0), 2
            ),
            "violations": len(self.violations),
        }

    def summary(self) -> str:
        faults = ",".join(f"{k}:{v}" for k, v in sorted(self.faults.items())) or "none"
        return (
            f"acked={self.acknowledged} lost={self.lost} unverified={self.unverified} "
            f"duplicates={self.duplicates} "
            f"unexpected={self.unexpected} reordered={self.reordered} "
            f"undelivered={sum(self.undelivered.values())} detached={len(self.detached)} "
            f"failed={self.failed} pending={self.pending} faults={faults} "
            f"crashes={self.crashes} longest_unavailable={self.longest_unavailable:.1f}s "
            f"ack_receipts={self.ack_receipts} after_receipt={self.redelivered_after_receipt}"
        )


def _examples(items: Any) -> str:
    listed = sorted(items)[:EXAMPLES]
    return ", ".join(map(str, listed))


def gaps(times: list[float], start: float, end: float) -> list[tuple[float, float]]:
    """The intervals between consecutive (sorted) ``times`` inside ``[start, end]``,
    counting ``start`` and ``end`` as the outer bounds."""
    points = [start, *(t for t in times if start <= t <= end), end]
    return [(a, b) for a, b in itertools.pairwise(points) if b > a]


def longest_gap(times: list[float], start: float, end: float) -> float:
    """Longest interval inside ``[start, end]`` without any of the (sorted) ``times``."""
    return max((b - a for a, b in gaps(times, start, end)), default=0.0)


def longest_overlapping(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Longest of ``intervals`` that overlaps ``[start, end]`` (whole, not clipped)."""
    return max((b - a for a, b in intervals if b > start and a < end), default=0.0)


def check(history: History) -> Report:
    r = Report()
    sends: dict[MsgId, Send] = {}
    for s in history.sends:
        sends[s.id] = s
    acked = {i for i, s in sends.items() if s.acked is not None}
    r.sent = len(sends)
    r.acknowledged = len(acked)
    r.failed = sum(1 for s in sends.values() if s.acked is None and s.failed is not None)
    r.pending = sum(1 for s in sends.values() if s.acked is None and s.failed is None)

    _check_log(history, sends, acked, r)
    _check_deliveries(history, acked, r)
    _check_ack_receipts(history, r)
    _check_attach(history, r)
    _availability(history, r)
    r.faults = dict(Counter(f"{f.kind}-{f.target.split('-')[0]}" for f in history.faults))
    r.crashes = sum(1 for e in history.events if e.kind == "crash")
    r.restart_failures = sum(1 for e in history.events if e.kind == "restart-failed")
    return r


def _check_log(history: History, sends: dict[MsgId, Send], acked: set[MsgId], r: Report) -> None:
    stored: dict[MsgId, set[Position]] = defaultdict(set)
    unexpected: list[str] = []
    # partition log order: (topic, partition) -> [(offset, index, id)]
    partitions: dict[tuple[str, int], list[tuple[int, int, MsgId]]] = defaultdict(list)
    for rec in history.final_read:
        if rec.id is None or rec.id not in sends:
            unexpected.append(rec.raw or str(rec.id))
            continue
        if rec.position in stored[rec.id]:
            continue  # delivered twice by the final read itself: one stored copy
        stored[rec.id].add(rec.position)
        partitions[(rec.topic, rec.position[0])].append(
            (rec.offset if rec.offset >= 0 else rec.index, rec.index, rec.id)
        )

    unread = {
        t
        for t, status in history.final_read_status.items()
        if not status.startswith(("complete", "idle"))
    }
    missing = acked - stored.keys()
    lost = {i for i in missing if i[0] not in unread}
    unverified = missing - lost
    r.lost = len(lost)
    r.unverified = len(unverified)
    if lost:
        r.violations.append(
            f"(a) {len(lost)} acknowledged messages missing from the log, e.g. {_examples(lost)}"
        )
    for topic in sorted(unread):
        n = sum(1 for i in unverified if i[0] == topic)
        r.violations.append(
            f"(a) topic {topic} could not be read to its end after recovery "
            f"({history.final_read_status[topic]}): {n} acknowledged messages unverified"
        )
    dup = {i: len(p) - 1 for i, p in stored.items() if len(p) > 1}
    r.duplicates = sum(dup.values())
    if dup:
        r.violations.append(
            f"(c) {len(dup)} messages stored more than once ({r.duplicates} extra copies),"
            f" e.g. {_examples(dup)}"
        )
    r.unexpected = len(unexpected)
    if unexpected:
        r.violations.append(f"read but never sent: {len(unexpected)}, e.g. {unexpected[:3]}")
    r.indeterminate_stored = sum(1 for i in stored if i not in acked)

    reorders: list[str] = []
    for (topic, partition), entries in partitions.items():
        entries.sort()
        last: dict[str, int] = {}
        for _, _, (_, producer, seq) in entries:
            before = last.get(producer)
            if before is not None and seq < before:
                reorders.append(f"{topic}/{partition}/{producer}: {seq} after {before}")
            last[producer] = max(seq, before if before is not None else seq)
    r.reordered = len(reorders)
    if reorders:
        r.violations.append(
            f"(b) {len(reorders)} messages out of producer order, e.g. {reorders[:EXAMPLES]}"
        )

    holders: dict[tuple[int, int, int], list[tuple[int, MsgId]]] = defaultdict(list)
    for i, places in stored.items():
        for p in places:
            holders[p[1:]].append((p[0], i))
    wrong: list[str] = []
    for i in sorted(acked):
        s = sends[i]
        if s.position is None or s.position[1] < 0:
            r.receipts_without_position += 1
        elif i in stored:
            if not any(_same(s.position, p) for p in stored[i]):
                wrong.append(f"{i} receipt {s.position} stored at {sorted(stored[i])}")
        else:
            others = [
                o
                for part, o in holders.get(s.position[1:], [])
                if _same(s.position, (part, *s.position[1:]))
            ]
            if others:
                wrong.append(f"{i} (lost) receipt {s.position} holds {others[0]}")
    r.wrong_receipts = len(wrong)
    if wrong:
        r.violations.append(
            f"(f) {len(wrong)} receipts name a position not holding the message, e.g. {wrong[:3]}"
        )


def _same(receipt: Position, stored: Position) -> bool:
    """Receipt and read position agree (a partition of -1 on either side matches)."""
    if receipt[1:] != stored[1:]:
        return False
    return receipt[0] < 0 or stored[0] < 0 or receipt[0] == stored[0]


def _check_deliveries(history: History, acked: set[MsgId], r: Report) -> None:
    by_sub: dict[str, set[MsgId]] = defaultdict(set)
    seen: dict[str, Counter[tuple[MsgId, Position]]] = defaultdict(Counter)
    for d in history.deliveries:
        if d.id is None:
            continue
        by_sub[d.subscription].add(d.id)
        seen[d.subscription][(d.id, d.position)] += 1
    groups = [
        *((topic, sub) for topic, subs in history.subscriptions.items() for sub in subs),
        *((topic, rd) for topic, readers in history.readers.items() for rd in readers),
    ]
    for topic, sub in groups:
        want = {i for i in acked if i[0] == topic}
        missing = want - by_sub.get(sub, set())
        r.undelivered[sub] = len(missing)
        r.redelivered[sub] = sum(n - 1 for n in seen.get(sub, Counter()).values())
        if missing:
            r.violations.append(
                f"(d) {sub}: {len(missing)} acknowledged messages never delivered,"
                f" e.g. {_examples(missing)}"
            )


def _check_ack_receipts(history: History, r: Report) -> None:
    receipted: dict[tuple[str, MsgId], float] = {}
    for a in history.receipts:
        key = (a.subscription, a.id)
        receipted[key] = min(a.t, receipted.get(key, a.t))
    r.ack_receipts = len(receipted)
    r.acks_not_persisted = sum(1 for e in history.events if e.kind == "ack-not-persisted")
    again: dict[tuple[str, MsgId], float] = {}
    for d in history.deliveries:
        if d.id is None:
            continue
        t = receipted.get((d.subscription, d.id))
        if t is not None and d.t > t:
            again.setdefault((d.subscription, d.id), d.t)
    r.redelivered_after_receipt = len(again)
    if again:
        examples = [f"{sub} {i} receipt@{receipted[(sub, i)]:.1f}s" for sub, i in sorted(again)]
        r.violations.append(
            f"(g) {len(again)} messages delivered again after their ack got a receipt,"
            f" e.g. {examples[:EXAMPLES]}"
        )


def _check_attach(history: History, r: Report) -> None:
    since: dict[str, float] = {}
    for a in sorted(history.attach, key=lambda a: a.t):
        want = history.consumers_expected.get(a.subscription, 0)
        if a.consumers < want:
            start = since.setdefault(a.subscription, a.t)
            longest = max(r.detached_longest.get(a.subscription, 0.0), a.t - start)
            r.detached_longest[a.subscription] = round(longest, 1)
        else:
            since.pop(a.subscription, None)
    last: dict[str, Any] = {}
    end = history.drained_at if history.drained_at is not None else float("-inf")
    for a in history.attach:
        if a.t >= end:
            last[a.subscription] = a
    for sub, expected in history.consumers_expected.items():
        a = last.get(sub)
        if a is None:
            r.detached[sub] = "no report from the admin API at the end"
        elif a.consumers < expected:
            r.detached[sub] = (
                f"{a.consumers} of {expected} consumers attached at the end"
                + (f" (attached: {', '.join(a.names)})" if a.names else "")
                + f", short of consumers for {r.detached_longest.get(sub, 0.0):.0f}s"
            )
        elif a.backlog > 0:
            r.detached[sub] = f"backlog of {a.backlog} did not drain"
    for sub, why in sorted(r.detached.items()):
        r.violations.append(f"(e) {sub}: {why}")


def _availability(history: History, r: Report) -> None:
    end = history.production_stopped
    if end is None:
        end = max((s.invoked for s in history.sends), default=0.0)
    first = min((s.invoked for s in history.sends), default=0.0)
    by_topic: dict[str, list[float]] = defaultdict(list)
    for s in history.sends:
        if s.acked is not None:
            by_topic[s.topic].append(s.acked)
    for topic, times in sorted(by_topic.items()):
        r.longest_unavailable_by_topic[topic] = round(longest_gap(sorted(times), first, end), 2)
    # a topic's writes stopping is what a user notices, whatever the other topics do
    r.longest_unavailable = max(r.longest_unavailable_by_topic.values(), default=0.0)
    topic_gaps = [gaps(sorted(times), first, end) for times in by_topic.values()]
    faults = sorted((f for f in history.faults if f.started is not None), key=_started)
    for n, f in enumerate(faults):
        assert f.started is not None
        until = faults[n + 1].started if n + 1 < len(faults) else end
        assert until is not None
        key = f"{f.kind} {f.target} @{f.started:.1f}s"
        r.unavailable_after_fault[key] = round(
            max(
                (longest_overlapping(g, f.started, min(until, end)) for g in topic_gaps),
                default=0.0,
            ),
            2,
        )


def _started(f: Fault) -> float:
    return f.started or 0.0

"""Producer de-duplication as a plain state class (no I/O), after Pulsar's
``MessageDeduplication``.

Per producer name it keeps two sequence ids:

* **pushed** — the highest sequence id handed to the ledger (stored or still in flight);
* **persisted** — the highest sequence id whose entry the ledger confirmed stored.

A send whose last sequence id is at or below *persisted* is a duplicate: it is answered
with the receipt of the stored original (``(segment, entry, first offset)`` when the
original is among the producer's recent entries, else unknown).  A send at or below
*pushed* but above *persisted* is neither new nor known to be stored: its answer waits
for the in-flight original — the original's receipt when it is stored, the original's
error when it fails.  A component that cannot tell never answers "duplicate".

When an append fails, *pushed* falls back to *persisted* (the ledger fails every later
append of the topic too, in order), and the broker makes the producer re-attach, so the
client resends everything from its oldest pending batch in order.

Decisions use a batch's *last* sequence id (``first + count - 1``), so a batch is new,
in flight or stored as a whole.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from pigeon.core.errors import ServiceUnavailable

__all__ = ["Decision", "Deduplication", "Receipt", "RECENT_ENTRIES"]

#: (segment id, entry id, first offset) of a stored batch
Receipt = tuple[int, int, int]
#: ``waiter(receipt, error)``: the answer to a resend of an in-flight batch
Waiter = Callable[[Receipt | None, BaseException | None], None]

#: stored batches remembered per producer to answer duplicates with their position
RECENT_ENTRIES = 4096


class Decision(Enum):
    NEW = "new"  # append it, then call pushed() / persisted() / failed()
    DUPLICATE = "duplicate"  # stored already: answer with receipt()
    IN_FLIGHT = "in_flight"  # the original is being stored: wait() for its outcome


@dataclass(slots=True)
class _Flight:
    first: int
    last: int
    waiters: list[tuple[int, Waiter]] = field(default_factory=list)  # (resend's first, w)


@dataclass(slots=True)
class _Producer:
    pushed: int = -1
    persisted: int = -1
    in_flight: deque[_Flight] = field(default_factory=deque)
    # stored batches in sequence order: last sequence ids, and (first sequence id, receipt)
    recent_last: list[int] = field(default_factory=list)
    recent: list[tuple[int, Receipt]] = field(default_factory=list)


def _shifted(receipt: Receipt, orig_first: int, first: int) -> Receipt:
    """The receipt of a resend starting at ``first`` inside a batch from ``orig_first``."""
    seg, entry, offset = receipt
    return (seg, entry, offset + (first - orig_first) if offset >= 0 else offset)


class Deduplication:
    """The de-duplication state of one topic partition."""

    def __init__(self, *, recent_entries: int = RECENT_ENTRIES) -> None:
        self.recent_entries = recent_entries
        self._producers: dict[str, _Producer] = {}

    # ------------------------------------------------------------------ queries

    def _get(self, name: str) -> _Producer:
        p = self._producers.get(name)
        if p is None:
            p = self._producers[name] = _Producer()
        return p

    def pushed_sequence(self, name: str) -> int:
        p = self._producers.get(name)
        return p.pushed if p is not None else -1

    def next_sequence(self, name: str) -> int | None:
        """Where the producer's next new batch starts (after the last one pushed), or None
        when the partition knows nothing of it.  A producer whose every send failed is
        known: it starts again at sequence id 0, not wherever its next send says."""
        p = self._producers.get(name)
        return p.pushed + 1 if p is not None else None

    def persisted_sequence(self, name: str) -> int:
        p = self._producers.get(name)
        return p.persisted if p is not None else -1

    def persisted_map(self) -> dict[str, int]:
        """Producer name → highest persisted sequence id (what a snapshot records)."""
        return {n: p.persisted for n, p in self._producers.items() if p.persisted >= 0}

    def check(self, name: str, first: int, count: int) -> Decision:
        """What to do with a send of ``count`` messages from sequence id ``first`` on."""
        last = first + count - 1
        p = self._producers.get(name)
        if p is None:
            return Decision.NEW
        if last <= p.persisted:
            return Decision.DUPLICATE
        if last <= p.pushed:
            return Decision.IN_FLIGHT
        return Decision.NEW

    def receipt(self, name: str, first: int, count: int) -> Receipt | None:
        """The stored original of a duplicate, when it is still remembered."""
        p = self._producers.get(name)
        if p is None:
            return None
        last = first + count - 1
        i = bisect.bisect_left(p.recent_last, last)
        if i == len(p.recent_last):
            return None
        orig_first, receipt = p.recent[i]
        if not orig_first <= first <= p.recent_last[i]:
            return None  # the original was batched differently: no exact position
        return _shifted(receipt, orig_first, first)

    # ------------------------------------------------------------------ transitions

    def pushed(self, name: str, first: int, count: int) -> object:
        """A NEW batch was handed to the ledger; returns its flight (for ``failed``)."""
        p = self._get(name)
        last = first + count - 1
        p.pushed = max(p.pushed, last)
        flight = _Flight(first, last)
        p.in_flight.append(flight)
        return flight

    def wait(self, name: str, first: int, count: int, waiter: Waiter) -> None:
        """An IN_FLIGHT resend: ``waiter`` gets the original's outcome."""
        p = self._get(name)
        last = first + count - 1
        for flight in p.in_flight:
            if flight.last >= last:
                flight.waiters.append((first, waiter))
                return
        # Not in flight (check() would not have said IN_FLIGHT): answer what is known.
        if last <= p.persisted:
            waiter(self.receipt(name, first, count), None)
        else:
            waiter(None, ServiceUnavailable("the original send was not stored; resend it"))

    def persisted(self, name: str, first: int, count: int, receipt: Receipt) -> None:
        """The batch (pushed earlier, or found in the log on recovery) is stored."""
        p = self._get(name)
        last = first + count - 1
        p.persisted = max(p.persisted, last)
        p.pushed = max(p.pushed, last)
        self._remember(p, first, last, receipt)
        settled: list[tuple[_Flight, int, Waiter]] = []
        while p.in_flight and p.in_flight[0].last <= last:
            flight = p.in_flight.popleft()
            settled.extend((flight, f, w) for f, w in flight.waiters)
        for flight, resend_first, waiter in settled:
            if flight.last == last and resend_first >= first:
                waiter(_shifted(receipt, first, resend_first), None)
            else:
                # a resend batched differently (it starts in an earlier batch: no exact
                # position), or an older flight overtaken (not with in-order appends)
                waiter(self.receipt(name, resend_first, flight.last - resend_first + 1), None)

    def failed(
        self,
        name: str,
        first: int,
        count: int,
        error: BaseException,
        flight: object | None = None,
    ) -> None:
        """The batch was not stored: the producer must resend from it on.

        The ledger fails appends as a suffix (this one and every later one), so every
        flight of this producer from this batch on is settled with ``error``; earlier
        flights are still on their way and settle by themselves.

        ``flight`` (what ``pushed`` returned): when it is gone already (settled by the
        failure of an earlier flight), nothing changes -- a resend of the same sequence
        ids may be in flight by now, and this failure is not its.
        """
        p = self._get(name)
        if flight is not None and not any(f is flight for f in p.in_flight):
            return
        last = first + count - 1
        kept: deque[_Flight] = deque()
        waiters: list[Waiter] = []
        for flight in p.in_flight:
            if flight.last >= last:
                waiters.extend(w for _f, w in flight.waiters)
            else:
                kept.append(flight)
        p.in_flight = kept
        p.pushed = max(p.persisted, kept[-1].last if kept else -1)
        for waiter in waiters:
            waiter(None, error)

    def restore(self, persisted: dict[str, int]) -> None:
        """Start from a snapshot (producer name → persisted sequence id)."""
        for name, seq in persisted.items():
            p = self._get(name)
            p.persisted = max(p.persisted, int(seq))
            p.pushed = max(p.pushed, p.persisted)

    def replay(self, entries: Iterable[tuple[str, int, int, Receipt]]) -> None:
        """Entries found in the log after the snapshot: (producer, first, count, receipt)."""
        for name, first, count, receipt in entries:
            self.persisted(name, first, count, receipt)

    def remember_older(self, entries: Iterable[tuple[str, int, int, Receipt]]) -> None:
        """Entries found in the log *before* what was replayed (read to name the
        original of a duplicate): their positions are remembered, nothing else changes."""
        for name, first, count, receipt in entries:
            p = self._producers.get(name)
            if p is None:
                continue  # a producer nobody resends for (its sequence is not known)
            last = first + count - 1
            i = bisect.bisect_left(p.recent_last, last)
            if i < len(p.recent_last) and p.recent_last[i] == last:
                continue
            p.recent_last.insert(i, last)
            p.recent.insert(i, (first, receipt))

    def remembers_before(self, name: str, first: int) -> bool:
        """Is a batch of ``name`` ending before ``first`` remembered?  Then the batch from
        ``first`` on, if stored as one, is remembered too (sequence ids grow along the
        log), and reading further back cannot find it."""
        p = self._producers.get(name)
        return p is not None and bool(p.recent_last) and p.recent_last[0] < first

    # ------------------------------------------------------------------ internals

    def _remember(self, p: _Producer, first: int, last: int, receipt: Receipt) -> None:
        if p.recent_last and last <= p.recent_last[-1]:
            return  # kept in sequence order; an older batch stored again adds nothing
        p.recent_last.append(last)
        p.recent.append((first, receipt))
        if len(p.recent_last) > 2 * self.recent_entries:
            del p.recent_last[: self.recent_entries]
            del p.recent[: self.recent_entries]

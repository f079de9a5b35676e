"""Cursor state of a subscription, in partition-offset space, without I/O.

A cursor is the *mark-delete offset* ``M`` (every message with offset < M is acknowledged)
plus the set of individually acknowledged offsets at or above ``M``, kept as sorted,
disjoint half-open ranges.  Acks inside a batch are just offsets too, so partially
acknowledged batches need no special case.  The whole state serialises to a small JSON
document that the broker persists (throttled) in the metadata store.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator

__all__ = ["CursorState", "RangeSet"]


class RangeSet:
    """Sorted, disjoint, half-open integer ranges ``[start, end)``."""

    __slots__ = ("_ends", "_starts")

    def __init__(self, ranges: list[tuple[int, int]] | None = None) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for s, e in ranges or ():
            self.add(s, e)

    def __len__(self) -> int:
        return len(self._starts)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._starts, self._ends, strict=True))

    def ranges(self) -> list[tuple[int, int]]:
        return list(self)

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        starts, ends = self._starts, self._ends
        # first range that could touch [start, end): its end >= start
        i = bisect.bisect_left(ends, start)
        j = i
        while j < len(starts) and starts[j] <= end:
            start = min(start, starts[j])
            end = max(end, ends[j])
            j += 1
        starts[i:j] = [start]
        ends[i:j] = [end]

    def __contains__(self, x: int) -> bool:
        i = bisect.bisect_right(self._starts, x) - 1
        return i >= 0 and x < self._ends[i]

    def remove_below(self, x: int) -> None:
        """Forget everything below ``x``."""
        starts, ends = self._starts, self._ends
        i = bisect.bisect_right(ends, x)
        del starts[:i], ends[:i]
        if starts and starts[0] < x:
            starts[0] = x

    def first(self) -> tuple[int, int] | None:
        return (self._starts[0], self._ends[0]) if self._starts else None

    def pop_first(self) -> None:
        del self._starts[0], self._ends[0]

    def count_in(self, start: int, end: int) -> int:
        total = 0
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while i < len(self._starts) and self._starts[i] < end:
            total += max(0, min(end, self._ends[i]) - max(start, self._starts[i]))
            i += 1
        return total

    def members_in(self, start: int, end: int) -> list[int]:
        out: list[int] = []
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while i < len(self._starts) and self._starts[i] < end:
            out.extend(range(max(start, self._starts[i]), min(end, self._ends[i])))
            i += 1
        return out


class CursorState:
    """Mark-delete offset plus individually acknowledged ranges above it, and the type
    of the subscription (``sub_type``: the one its last consumer asked for; None in a
    cursor stored before the type was, or by the Kafka front door), so a subscription
    without consumers shows the type it had across a restart."""

    __slots__ = ("acked", "mark_delete", "sub_type")

    def __init__(
        self,
        mark_delete: int = 0,
        acked: list[tuple[int, int]] | None = None,
        *,
        sub_type: str | None = None,
    ) -> None:
        self.mark_delete = mark_delete
        self.sub_type = sub_type
        self.acked = RangeSet(acked)
        self.acked.remove_below(mark_delete)
        self._advance()

    def _advance(self) -> None:
        first = self.acked.first()
        while first is not None and first[0] <= self.mark_delete:
            self.mark_delete = max(self.mark_delete, first[1])
            self.acked.pop_first()
            first = self.acked.first()

    def ack(self, offset: int) -> None:
        if offset >= self.mark_delete:
            self.acked.add(offset, offset + 1)
            self._advance()

    def ack_range(self, start: int, end: int) -> None:
        if end > self.mark_delete:
            self.acked.add(max(start, self.mark_delete), end)
            self._advance()

    def ack_cumulative(self, offset: int) -> None:
        """Acknowledge every offset up to and including ``offset``."""
        if offset + 1 > self.mark_delete:
            self.mark_delete = offset + 1
            self.acked.remove_below(self.mark_delete)
            self._advance()

    def reset(self, mark_delete: int) -> None:
        """Move the cursor (seek): everything below is acked, nothing above."""
        self.mark_delete = mark_delete
        self.acked = RangeSet()

    def is_acked(self, offset: int) -> bool:
        return offset < self.mark_delete or offset in self.acked

    def all_acked(self, first: int, count: int) -> bool:
        end = first + count
        if end <= self.mark_delete:
            return True
        start = max(first, self.mark_delete)
        return self.acked.count_in(start, end) == end - start

    def acked_indexes(self, first: int, count: int) -> list[int]:
        """Batch indexes of the entry ``[first, first+count)`` that are acknowledged."""
        end = first + count
        if end <= self.mark_delete:
            return list(range(count))
        below = list(range(0, max(0, self.mark_delete - first)))
        return below + [o - first for o in self.acked.members_in(max(first, self.mark_delete), end)]

    def to_json(self) -> bytes:
        """``{"mark_delete": 7, "acked": [[9, 12]], "type": "shared"}`` (``type`` only
        when known)."""
        doc: dict[str, object] = {"mark_delete": self.mark_delete, "acked": self.acked.ranges()}
        if self.sub_type is not None:
            doc["type"] = self.sub_type
        return json.dumps(doc).encode()

    @classmethod
    def from_json(cls, data: bytes) -> CursorState:
        """Reads what :meth:`to_json` writes, and older documents without ``type``."""
        doc = json.loads(data)
        sub_type = doc.get("type")
        return cls(
            int(doc["mark_delete"]),
            [(int(s), int(e)) for s, e in doc.get("acked", [])],
            sub_type=sub_type if isinstance(sub_type, str) else None,
        )

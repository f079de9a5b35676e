"""key_shared state of a dispatcher, without I/O: the hash ring, the parts of entries out
on each consumer, and the entries held for recently joined consumers (the newcomer rule).

The :class:`~pigeon.broker._dispatch.Dispatcher` decides; :class:`KeyShared` keeps what
those decisions need to know about keys (see the ``_dispatch`` module docstring for the
rules).  State, keyed by entry position ``(segment id, entry id)``:

* **ring**: ``RING_POINTS`` points per consumer name (CRC-32 of ``"name:i"``) on
  ``[0, HASH_RANGE)``; a key (CRC-32 of its bytes) belongs to the consumer of the first
  point at or after its hash.
* **pending**: the batch indexes of an entry out on each consumer.
* **held**: entries waiting for a recently joined consumer.
* **span** and **hashes**: ``(first offset, messages)`` and each message's key hash, of
  every entry pending or held (what the newcomer rule compares).
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from pigeon.broker._cursor import CursorState
    from pigeon.broker._dispatch import DispatchConsumer, Position

__all__ = ["HASH_RANGE", "RING_POINTS", "KeyShared", "key_hash"]

#: keys hash (CRC-32) into ``[0, HASH_RANGE)``
HASH_RANGE = 65536
#: points per consumer on the hash ring
RING_POINTS = 64

C = TypeVar("C", bound="DispatchConsumer")


def key_hash(key: bytes | None) -> int:
    """Where a message key falls on the ring (no key hashes as the empty key)."""
    return zlib.crc32(key or b"") % HASH_RANGE


class KeyShared(Generic[C]):
    """What a key_shared dispatcher knows about keys (see the module docstring)."""

    def __init__(self, cursor: CursorState) -> None:
        self.cursor = cursor
        self.ring: list[tuple[int, int, C]] = []
        self.pending: dict[Position, dict[C, set[int]]] = {}
        self.held: set[Position] = set()
        self.span: dict[Position, tuple[int, int]] = {}  # (first offset, messages)
        self.hashes: dict[Position, list[int]] = {}  # key hash of each message

    # ------------------------------------------------------------------ the ring

    def rebuild_ring(self, consumers: Iterable[C]) -> None:
        ring = []
        for c in consumers:
            for i in range(RING_POINTS):
                ring.append((zlib.crc32(f"{c.name}:{i}".encode()) % HASH_RANGE, c.consumer_id, c))
        ring.sort(key=lambda t: (t[0], t[1]))
        self.ring = ring

    def owner(self, h: int) -> C:
        """The consumer of key hash ``h`` (the ring must not be empty)."""
        ring = self.ring
        i = bisect.bisect_left(ring, h, key=lambda t: t[0])
        return ring[i % len(ring)][2]

    def owner_of(self, key: bytes | None) -> C | None:
        """The consumer a key maps to (None without consumers)."""
        if not self.ring:
            return None
        return self.owner(key_hash(key))

    def route(self, hashes: list[int], n: int, skip: set[int]) -> dict[C, list[int]]:
        """The batch indexes below ``n`` and not in ``skip``, grouped by the consumer of
        their key."""
        groups: dict[C, list[int]] = {}
        owners: dict[int, C] = {}
        for i in range(n):
            if i in skip:
                continue
            h = hashes[i]
            c = owners.get(h)
            if c is None:
                c = owners[h] = self.owner(h)
            groups.setdefault(c, []).append(i)
        return groups

    # ------------------------------------------------------------------ entries

    def out(self, pos: Position) -> set[int]:
        """The batch indexes of the entry at ``pos`` out on any consumer."""
        out: set[int] = set()
        for part in self.pending.get(pos, {}).values():
            out |= part
        return out

    def give(
        self, consumer: C, pos: Position, idx: list[int], span: tuple[int, int], hashes: list[int]
    ) -> None:
        """Messages ``idx`` of the entry at ``pos`` go out on ``consumer``."""
        self.pending.setdefault(pos, {}).setdefault(consumer, set()).update(idx)
        self.span[pos] = span
        self.hashes[pos] = hashes

    def hold(self, pos: Position, span: tuple[int, int], hashes: list[int]) -> None:
        """The entry at ``pos`` waits for a recently joined consumer."""
        self.held.add(pos)
        self.span.setdefault(pos, span)
        self.hashes[pos] = hashes

    def give_back(self, consumer: C, pos: Position) -> None:
        """``consumer``'s part of the entry at ``pos`` is no longer pending on it."""
        parts = self.pending.get(pos)
        if parts is not None:
            parts.pop(consumer, None)
            if not parts:
                del self.pending[pos]
                self._forget(pos, unless=self.held)

    def take_held(self) -> list[Position]:
        """Every held entry, in position order, no longer held."""
        held = sorted(self.held)
        for pos in held:
            self._forget(pos, unless=self.pending)
        self.held.clear()
        return held

    def settle(self, positions: Iterable[Position]) -> list[Position]:
        """Acknowledgements came for ``positions``: drop the parts acknowledged in full;
        the entries now fully acknowledged."""
        acked = []
        for pos in positions:
            parts = self.pending.get(pos)
            if not parts:
                continue
            span = self.span.get(pos)
            if span is None:
                continue
            first, n = span
            for c in list(parts):
                left = {i for i in parts[c] if not self.cursor.is_acked(first + i)}
                if left:
                    parts[c] = left
                else:
                    del parts[c]
                    c.pending.discard(pos)
            if not parts:
                del self.pending[pos]
                self._forget(pos, unless=self.held)
                if self.cursor.all_acked(first, n):
                    acked.append(pos)
        return acked

    def _forget(self, pos: Position, *, unless: Iterable[Position]) -> None:
        if pos not in unless:
            self.span.pop(pos, None)
            self.hashes.pop(pos, None)

    def clear(self) -> None:
        self.pending.clear()
        self.held.clear()
        self.span.clear()
        self.hashes.clear()

    # ------------------------------------------------------------------ newcomers

    def blocked(self, consumer: C, first: int, idx: list[int], hashes: list[int]) -> bool:
        """A recently joined ``consumer`` would get messages ``idx`` of the entry at offset
        ``first``, all below its join offset: does another consumer hold an earlier message
        of one of their keys (same hash), or is one held, not yet dispatched?

        Below the join offset a message is not necessarily a replay of something the
        earlier consumers gave back: it may never have been dispatched (delayed, or held
        for another newcomer) while an earlier message of its key is still out or held.
        """
        wanted = {hashes[i]: first + i for i in reversed(idx)}  # hash: its first offset
        last = max(wanted.values())
        for pos in self.held:
            span = self.span.get(pos)
            their = self.hashes.get(pos)
            if span is None or their is None or span[0] >= last:
                continue
            out = self.out(pos)
            for j, h in enumerate(their):
                if j not in out and self._earlier(wanted.get(h), span[0] + j):
                    return True
        for pos, parts in self.pending.items():
            span = self.span.get(pos)
            their = self.hashes.get(pos)
            if span is None or their is None or span[0] >= last:
                continue
            for c, part in parts.items():
                if c is consumer:
                    continue
                for j in part:
                    if self._earlier(wanted.get(their[j]), span[0] + j):
                        return True
        return False

    def _earlier(self, before: int | None, offset: int) -> bool:
        """The message at ``offset`` comes before ``before`` (a wanted offset of its key)
        and is not acknowledged."""
        return before is not None and offset < before and not self.cursor.is_acked(offset)

"""Wall-clock time that moves with trio's clock."""

from __future__ import annotations

import time

import trio

__all__ = ["WallClock"]

# One anchor per trio run, shared by every clock in it (broker, client, ...), so that
# all of them agree even when a MockClock makes trio's time jump.
_ANCHOR: trio.lowlevel.RunVar[float] = trio.lowlevel.RunVar("pigeon_wall_anchor")


class WallClock:
    """Wall-clock milliseconds that advance with trio's clock.

    Anchored to ``time.time()`` the first time any clock is read in a trio run, then
    driven by ``trio.current_time()``, so a trio ``MockClock`` moves publish times,
    delayed delivery and TTL exactly as it moves timeouts. Call it inside a trio run.
    """

    def now_ms(self) -> int:
        t = trio.current_time()
        try:
            anchor = _ANCHOR.get()
        except LookupError:
            anchor = time.time() - t
            _ANCHOR.set(anchor)
        return int((anchor + t) * 1000)

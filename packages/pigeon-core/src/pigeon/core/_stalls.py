"""Naming what holds a server's event loop: :class:`StallWatch`.

A latency tail of a few hundred milliseconds in one run out of several is hard to place
from outside: a slow disk, a blocked event loop, a garbage collection, the GIL held by
another thread, or the machine itself. A node's event loop watches itself and says which,
in one log line per stall (logger ``pigeon.core.stalls``):

* a **task step** that held the loop longer than the threshold (``task=`` names it; a
  step waiting for the GIL another thread holds counts too);
* a **garbage collection** longer than the threshold (``generation=``, objects
  collected);
* a **late wake-up**: the loop slept in ``epoll_wait`` for longer than it asked for by
  more than the threshold (the process did not run: the GIL held by another thread, or
  the machine paused it).

``PIGEON_STALL_WARNING_MS`` sets the threshold (default 100; 0 turns the watch off).
The cost is two ``perf_counter`` calls per task step.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

import trio

__all__ = ["StallWatch", "stall_threshold"]

log = logging.getLogger("pigeon.core.stalls")

#: the default threshold, milliseconds
DEFAULT_STALL_WARNING_MS = 100.0


def stall_threshold() -> float:
    """``PIGEON_STALL_WARNING_MS`` in seconds (0: off); a bad value is the default."""
    text = os.environ.get("PIGEON_STALL_WARNING_MS", "")
    try:
        ms = float(text) if text.strip() else DEFAULT_STALL_WARNING_MS
    except ValueError:
        log.warning(
            "PIGEON_STALL_WARNING_MS=%r is not a number: %g ms", text, DEFAULT_STALL_WARNING_MS
        )
        ms = DEFAULT_STALL_WARNING_MS
    return max(ms, 0.0) / 1000


class StallWatch(trio.abc.Instrument):
    """A trio instrument (and a ``gc`` callback) that logs each stall longer than
    ``threshold`` seconds; :meth:`install` in the run, :meth:`uninstall` at its end."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.stalls = 0
        self._step = 0.0
        self._sleep: tuple[float, float] | None = None
        self._gc = 0.0

    def install(self) -> None:
        """Watch the current run (from one of its tasks: this step counts from now)."""
        self._step = time.perf_counter()
        trio.lowlevel.add_instrument(self)
        gc.callbacks.append(self._collected)

    def uninstall(self) -> None:
        try:
            trio.lowlevel.remove_instrument(self)
        except (KeyError, ValueError, RuntimeError):
            pass
        if self._collected in gc.callbacks:
            gc.callbacks.remove(self._collected)

    # -- trio.abc.Instrument ----------------------------------------------------------

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        held = time.perf_counter() - self._step
        if held >= self.threshold:
            self.stalls += 1
            log.warning("event loop stalled %.0f ms: one step of task %s", held * 1000, task.name)

    def before_io_wait(self, timeout: float) -> None:
        self._sleep = (time.perf_counter(), timeout)

    def after_io_wait(self, timeout: float) -> None:
        if self._sleep is None:
            return
        start, asked = self._sleep
        self._sleep = None
        late = time.perf_counter() - start - asked
        if late >= self.threshold:
            self.stalls += 1
            log.warning(
                "event loop stalled %.0f ms: woke late from a %.0f ms wait (the process"
                " did not run: the GIL held by another thread, or the machine)",
                late * 1000,
                asked * 1000,
            )

    # -- gc.callbacks ---------------------------------------------------------------------

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc = time.perf_counter()
            return
        took = time.perf_counter() - self._gc
        if took >= self.threshold:
            self.stalls += 1
            log.warning(
                "event loop stalled %.0f ms: garbage collection generation=%s collected=%s",
                took * 1000,
                info.get("generation"),
                info.get("collected"),
            )

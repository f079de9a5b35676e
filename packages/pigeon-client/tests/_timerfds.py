"""What the kernel says of this process's timerfds (Linux's ``/proc/self``), and asyncio
loops that show which batching timer a producer takes: for test_timer.py and
test_asyncio.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from typing import Any


def open_timerfds() -> int:
    """How many timerfds this process has open."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[timerfd]"
    return count


def timerfd_left(fd: int) -> float:
    """Seconds until the timerfd ``fd`` expires, as the kernel has it (0: disarmed)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        found = re.search(r"it_value: \((\d+), (\d+)\)", f.read())
    assert found is not None, "not a timerfd"
    return int(found[1]) + int(found[2]) / 1e9


class RecordingLoop(asyncio.SelectorEventLoop):
    """asyncio's default loop on Linux, noting each ``call_at``: ``(when, callback)``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls_at: list[tuple[float, Any]] = []

    def call_at(self, when: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls_at.append((when, callback))
        return super().call_at(when, callback, *args, **kwargs)


class OwnClockLoop(RecordingLoop):
    """A loop with a clock of its own (a test's, say): a timerfd cannot stand for it."""

    def time(self) -> float:
        return 1000.0 + time.monotonic()

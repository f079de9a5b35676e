"""Sleeping until a deadline to the microsecond, for the batching timer: :class:`PreciseTimers`.

trio sleeps in ``epoll_wait``, whose timeout CPython rounds *up* to a whole millisecond:
a sleep whose deadline is 0.3 ms away waits 1 ms, so a batch due 1 ms after its first
message went out 1.3 to 1.6 ms after it (docs/benchmarks.md, "Where the time goes").
Here the wait is a Linux ``timerfd`` armed for the deadline itself (absolute, on
``CLOCK_MONOTONIC``, the clock of ``time.perf_counter`` and so of trio's default clock),
which the same ``epoll_wait`` watches like a socket: it wakes at the deadline plus the
kernel's timer slack (50 µs), whatever millisecond it falls in.

Only for a trio run on trio's default clock (the engine thread of the sync and asyncio
faces, and a trio face's run unless it was given another clock, such as a test's
``MockClock``); :meth:`PreciseTimers.open` returns None where there is no timerfd
(another OS, or ``perf_counter`` on another clock) or the run keeps another clock, and
the caller keeps ``trio.sleep_until``.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable

import trio

__all__ = ["PreciseTimers"]

_TFD_TIMER_ABSTIME = 1
_CLOCK_MONOTONIC = 1
#: timerfds kept for reuse (one per producer partition whose timer runs)
_MAX_FREE = 16


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _timerfd_calls() -> tuple[Callable[[], int], Callable[[int, int], None]] | None:
    """``(create(), arm(fd, monotonic_ns))``, ``monotonic_ns`` 0 disarming; None
    without timerfd."""
    if not sys.platform.startswith("linux"):
        return None
    if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        return None
    flags = os.O_NONBLOCK | os.O_CLOEXEC  # TFD_NONBLOCK | TFD_CLOEXEC, by definition
    os_create = getattr(os, "timerfd_create", None)  # Python 3.13
    os_settime = getattr(os, "timerfd_settime_ns", None)
    if os_create is not None and os_settime is not None:

        def create_os() -> int:
            return int(os_create(_CLOCK_MONOTONIC, flags=flags))

        def arm_os(fd: int, ns: int) -> None:
            os_settime(fd, flags=_TFD_TIMER_ABSTIME if ns else 0, initial=ns)

        return create_os, arm_os
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        timerfd_create = libc.timerfd_create
        timerfd_settime = libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
    timerfd_create.restype = ctypes.c_int
    timerfd_settime.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(_Itimerspec),
        ctypes.c_void_p,
    ]
    timerfd_settime.restype = ctypes.c_int

    def create() -> int:
        fd = int(timerfd_create(_CLOCK_MONOTONIC, flags))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return fd

    def arm(fd: int, ns: int) -> None:
        spec = _Itimerspec()
        spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(ns, 1_000_000_000)
        if timerfd_settime(fd, _TFD_TIMER_ABSTIME if ns else 0, ctypes.byref(spec), None):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return create, arm


def on_default_clock() -> bool:
    """Whether the current trio run keeps trio's default clock (``perf_counter`` plus an
    offset, which a timerfd on ``CLOCK_MONOTONIC`` can stand for); a ``MockClock`` or any
    clock of the caller's cannot."""
    clock = type(trio.lowlevel.current_clock())
    return clock.__name__ == "SystemClock" and clock.__module__.startswith("trio.")


class PreciseTimers:
    """Sleeps of one trio run (on trio's default clock), each woken by a timerfd.

    Not thread-safe: the run's own tasks use it. :meth:`close` when the run ends.
    """

    def __init__(self, create: Callable[[], int], arm: Callable[[int, int], None]) -> None:
        self._create = create
        self._arm = arm
        self._free: list[int] = []
        self.closed = False

    @classmethod
    def open(cls) -> PreciseTimers | None:
        """Timers for the current run, or None (then ``trio.sleep_until`` it is): none
        off Linux or off trio's default clock (:func:`on_default_clock`)."""
        if not on_default_clock():
            return None
        calls = _timerfd_calls()
        if calls is None:
            return None
        try:
            os.close(calls[0]())  # the kernel has them (not a seccomp'd sandbox, say)
        except OSError:
            return None
        return cls(*calls)

    async def sleep_until(self, deadline: float) -> None:
        """Like ``trio.sleep_until(deadline)`` (a checkpoint; cancellable), woken at
        ``deadline`` to the microsecond rather than at the next whole millisecond."""
        mono = time.perf_counter()
        now = trio.current_time()
        if deadline <= now or self.closed:
            await trio.sleep_until(deadline)
            return
        # the run's clock is perf_counter plus an offset: the deadline on CLOCK_MONOTONIC
        # (read in this order, the offset is never short: no wake-up before the deadline)
        ns = int((deadline - (now - mono)) * 1e9)
        fd = self._free.pop() if self._free else self._create()
        try:
            self._arm(fd, max(ns, 1))
            await trio.lowlevel.wait_readable(fd)
        finally:
            self._release(fd)

    def _release(self, fd: int) -> None:
        """Keep ``fd`` for the next sleep. One cancelled before its deadline may still
        expire: arming it again clears that (``timerfd_settime`` resets the count of
        expirations), and nothing waits on it meanwhile."""
        if self.closed or len(self._free) >= _MAX_FREE:
            self._close_fd(fd)
        else:
            self._free.append(fd)

    @staticmethod
    def _close_fd(fd: int) -> None:
        trio.lowlevel.notify_closing(fd)
        os.close(fd)

    def close(self) -> None:
        """Close the kept timerfds (from the run's thread, before it ends)."""
        self.closed = True
        free, self._free = self._free, []
        for fd in free:
            self._close_fd(fd)

"""Waking a batching timer at its deadline to the microsecond: :class:`PreciseTimers` (a
trio run's sleeps) and :class:`LoopTimers` (an asyncio loop's callbacks).

trio sleeps in ``epoll_wait``, whose timeout CPython rounds *up* to a whole millisecond:
a sleep whose deadline is 0.3 ms away waits 1 ms, so a batch due 1 ms after its first
message went out 1.3 to 1.6 ms after it (docs/benchmarks.md, "Where the time goes").
asyncio's selector loop rounds its ``select`` timeout up the same way, so a
``loop.call_at`` is late as much. Here the wait is a Linux ``timerfd`` armed for the
deadline itself (absolute, on ``CLOCK_MONOTONIC``, the clock of ``time.perf_counter``
and so of trio's default clock, and of ``time.monotonic`` and so of asyncio's
``BaseEventLoop.time``), which the same ``epoll_wait`` watches like a socket: it wakes at
the deadline plus the kernel's timer slack (50 µs), whatever millisecond it falls in.

Both open through :func:`timerfd_calls` and return None where there is no timerfd (another
OS, a clock that is not ``CLOCK_MONOTONIC``, a kernel or sandbox that refuses one), and
the caller keeps ``trio.sleep_until`` or ``loop.call_at``:

* :meth:`PreciseTimers.open`: only for a trio run on trio's default clock (the engine
  thread of the sync and asyncio faces, and a trio face's run unless it was given another
  clock, such as a test's ``MockClock``).
* :meth:`LoopTimers.open`: only for an asyncio loop whose ``time()`` is asyncio's own
  (``time.monotonic``) and which watches file descriptors (``add_reader``: the default
  selector loop; not a proactor loop, not uvloop, whose ``time()`` is its own).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Literal

import trio

__all__ = ["LoopTimers", "PreciseTimers", "timerfd_calls"]

_TFD_TIMER_ABSTIME = 1
_CLOCK_MONOTONIC = 1
_CLOCK_MONOTONIC_IMPLEMENTATION = "clock_gettime(CLOCK_MONOTONIC)"
#: timerfds kept for reuse (one per producer partition whose timer runs)
_MAX_FREE = 16

#: ``(create(), arm(fd, monotonic_ns))``: a non-blocking timerfd on ``CLOCK_MONOTONIC``;
#: arming it for an absolute time in nanoseconds, 0 disarming it
TimerfdCalls = tuple[Callable[[], int], Callable[[int, int], None]]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


#: what :func:`timerfd_calls` found, per clock
_found: dict[str, TimerfdCalls | None] = {}


def timerfd_calls(clock: Literal["monotonic", "perf_counter"]) -> TimerfdCalls | None:
    """The timerfd calls for deadlines read on ``time.<clock>`` (``"perf_counter"``,
    ``"monotonic"``), or None: not Linux, that clock is not ``CLOCK_MONOTONIC``, or the
    kernel refuses a timerfd (a seccomp'd sandbox, say). Looked up once per clock (a
    process out of file descriptors for now is asked again next time)."""
    if clock in _found:
        return _found[clock]
    calls = None
    if (
        sys.platform.startswith("linux")
        and time.get_clock_info(clock).implementation == _CLOCK_MONOTONIC_IMPLEMENTATION
    ):
        calls = _os_calls() or _libc_calls()
    if calls is not None:
        try:
            os.close(calls[0]())  # the kernel has them
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                return None
            calls = None
    _found[clock] = calls
    return calls


def _os_calls() -> TimerfdCalls | None:
    """Python 3.13's ``os.timerfd_*``."""
    flags = os.O_NONBLOCK | os.O_CLOEXEC  # TFD_NONBLOCK | TFD_CLOEXEC, by definition
    os_create = getattr(os, "timerfd_create", None)
    os_settime = getattr(os, "timerfd_settime_ns", None)
    if os_create is None or os_settime is None:
        return None

    def create() -> int:
        return int(os_create(_CLOCK_MONOTONIC, flags=flags))

    def arm(fd: int, ns: int) -> None:
        os_settime(fd, flags=_TFD_TIMER_ABSTIME if ns else 0, initial=ns)

    return create, arm


def _libc_calls() -> TimerfdCalls | None:
    """libc's ``timerfd_create`` and ``timerfd_settime`` through ctypes (Python < 3.13)."""
    flags = os.O_NONBLOCK | os.O_CLOEXEC
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
        calls = timerfd_calls("perf_counter")
        return None if calls is None else cls(*calls)

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


class LoopTimers:
    """The batching timers of one asyncio producer: one timerfd per partition whose batch
    has had a timer, which its loop watches (``add_reader``) until :meth:`close`.

    A partition has one open batch at a time, so one timerfd: arming it for a new batch
    replaces the deadline of the one before, which was sealed already (full, flushed) and
    whose timer would have done nothing. ``fire(index, generation)`` runs on the loop's
    thread when partition ``index``'s deadline is reached, never before; an expiry that
    arming again cleared meanwhile fires nothing. Not thread-safe: the loop's thread
    alone uses it.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        calls: TimerfdCalls,
        fire: Callable[[int, int], None],
    ) -> None:
        self._loop = loop
        self._create, self._arm = calls
        self._fire = fire
        #: partition -> its timerfd, and the generation of the batch it is armed for
        self._fds: dict[int, int] = {}
        self._generations: dict[int, int] = {}
        #: no more timers: closed, or the loop watches no file descriptor
        self.closed = False

    @classmethod
    def open(
        cls, loop: asyncio.AbstractEventLoop, fire: Callable[[int, int], None]
    ) -> LoopTimers | None:
        """Timers for a producer on ``loop``, or None (then ``loop.call_at`` it is): none
        off Linux, or on a loop whose ``time()`` is not asyncio's (``time.monotonic``),
        or that cannot watch a file descriptor (then the first :meth:`start` says
        False)."""
        if type(loop).time is not asyncio.BaseEventLoop.time:
            return None
        calls = timerfd_calls("monotonic")
        return None if calls is None else cls(loop, calls, fire)

    def start(self, index: int, generation: int, due: float) -> bool:
        """Call ``fire(index, generation)`` at ``due`` (on ``time.monotonic``); False
        if no timerfd could be had (out of file descriptors, a loop that watches none):
        the caller then falls back on ``loop.call_at``."""
        if self.closed:
            return False
        fd = self._fds.get(index)
        if fd is None:
            try:
                fd = self._create()
            except OSError:
                return False
            try:
                self._loop.add_reader(fd, self._expired, index)
            except (NotImplementedError, OSError, ValueError) as exc:
                os.close(fd)
                if isinstance(exc, NotImplementedError):
                    self.closed = True  # the loop never watches one: try no more
                return False
            self._fds[index] = fd
        self._generations[index] = generation
        # rounded up: the timer never expires before ``due`` as time.monotonic reads it
        self._arm(fd, max(math.ceil(due * 1e9), 1))
        return True

    def _expired(self, index: int) -> None:
        fd = self._fds.get(index)
        if fd is None:
            return
        try:
            os.read(fd, 8)  # the count of expirations: the fd is not readable again
        except BlockingIOError:
            return  # armed again since epoll saw it expire: that deadline is still ahead
        self._fire(index, self._generations[index])

    def close(self) -> None:
        """Stop watching and close every timerfd (from the loop's thread; again: nothing)."""
        self.closed = True
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            self._loop.remove_reader(fd)  # nothing on a closed loop
            os.close(fd)

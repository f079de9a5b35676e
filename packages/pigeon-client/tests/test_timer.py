"""The batching timer's sleeps (``pigeon.client._timer``): on the engine thread of the sync
and asyncio faces a timerfd wakes a sleep at its deadline, not at the next whole
millisecond epoll's rounded timeout gives; the producer's timer sleeps through the
engine's ``sleep_until`` until the batch is due. An asyncio loop's producer timers
(``LoopTimers``) are timerfds the loop watches, armed for the batch's due time.

The asyncio face's producer on those timers, against a server: test_asyncio.py."""

from __future__ import annotations

import asyncio
import errno
import os
import sys
import time

import pytest
import trio
from _timerfds import OwnClockLoop, open_timerfds, timerfd_left

from pigeon.client import _timer
from pigeon.client._engine import ClientEngine
from pigeon.client._thread import EngineThread
from pigeon.client._timer import LoopTimers, PreciseTimers
from pigeon.client.trio import Client

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")


@linux
async def test_a_sleep_never_ends_before_its_deadline() -> None:
    timers = PreciseTimers.open()
    assert timers is not None
    try:
        for left in (0.0002, 0.0007, 0.0013, 0.004):
            deadline = trio.current_time() + left
            await timers.sleep_until(deadline)
            assert trio.current_time() >= deadline, f"woke before a deadline {left}s away"
    finally:
        timers.close()


@linux
async def test_a_cancelled_sleep_does_not_wake_the_next_one_early() -> None:
    # the timerfd of a cancelled sleep is reused: its deadline, passed meanwhile, must
    # not end the next sleep at once
    timers = PreciseTimers.open()
    assert timers is not None
    try:
        with trio.move_on_after(0.0005):
            await timers.sleep_until(trio.current_time() + 0.002)
        await trio.sleep(0.005)  # the cancelled sleep's deadline passes
        deadline = trio.current_time() + 0.05
        await timers.sleep_until(deadline)
        assert trio.current_time() >= deadline, "a stale expiry ended the sleep"
    finally:
        timers.close()


@linux
def test_the_engine_thread_sleeps_on_timerfds_until_it_closes() -> None:
    thread = EngineThread(ClientEngine("pigeon://127.0.0.1:1"))
    sleep_until = thread.engine.sleep_until
    timers = getattr(sleep_until, "__self__", None)
    assert isinstance(timers, PreciseTimers)

    async def sleep() -> bool:
        deadline = trio.current_time() + 0.001
        await sleep_until(deadline)
        return trio.current_time() >= deadline

    assert thread.call(sleep)
    thread.call(thread.engine.aclose)
    thread.closed = True
    thread.join(30)
    assert timers.closed and not timers._free, "the kept timerfds were not closed"


async def test_the_batching_timer_sleeps_until_the_batch_is_due(
    pigeon_standalone, autojump_clock
) -> None:
    async with Client(pigeon_standalone.url) as client:
        slept: list[float] = []

        async def sleep_until(deadline: float) -> None:
            slept.append(deadline)
            await trio.sleep_until(deadline)

        client.engine.sleep_until = sleep_until
        producer = await client.create_producer("timer-due", batching_max_delay_ms=7)
        sent_at = trio.current_time()
        receipt = await producer.send(b"one")
        assert receipt is not None
        assert slept == [pytest.approx(sent_at + 0.007)], "the batch waited on another timer"
        await producer.close()


@linux
async def test_the_trio_face_sleeps_on_timerfds_on_trios_own_clock(pigeon_standalone) -> None:
    async with Client(pigeon_standalone.url) as client:
        timers = getattr(client.engine.sleep_until, "__self__", None)
        assert isinstance(timers, PreciseTimers)
        producer = await client.create_producer("timerfd-trio", batching_max_delay_ms=1)
        assert await producer.send(b"one") is not None
        await producer.close()
    assert timers.closed and not timers._free, "the kept timerfds were not closed"


async def test_the_trio_face_keeps_trios_sleep_on_a_mock_clock(
    pigeon_standalone, autojump_clock
) -> None:
    async with Client(pigeon_standalone.url) as client:
        assert client.engine.sleep_until is trio.sleep_until


# -- an asyncio loop's timers (LoopTimers) ----------------------------------------------


class Fired:
    """``fire(index, generation)`` of LoopTimers: records what fired, and when."""

    def __init__(self) -> None:
        self.fired: list[tuple[int, int, float]] = []
        self.event = asyncio.Event()

    def __call__(self, index: int, generation: int) -> None:
        self.fired.append((index, generation, time.monotonic()))
        self.event.set()

    async def wait(self, count: int) -> None:
        async with asyncio.timeout(5):
            while len(self.fired) < count:
                self.event.clear()
                await self.event.wait()


def loop_timers(fired: Fired) -> LoopTimers:
    timers = LoopTimers.open(asyncio.get_running_loop(), fired)
    assert timers is not None, "no timerfd on asyncio's default loop"
    return timers


@linux
def test_a_loop_timer_is_a_timerfd_armed_for_the_due_time_and_never_fires_early() -> None:
    async def main() -> None:
        fired = Fired()
        timers = loop_timers(fired)
        try:
            dues = {0: time.monotonic() + 0.0007, 3: time.monotonic() + 0.0013}
            for index, due in dues.items():
                assert timers.start(index, 10 + index, due)
                before = time.monotonic()
                left = timerfd_left(timers._fds[index])
                after = time.monotonic()
                if left:  # the kernel's deadline is ``due`` (read within [before, after])
                    assert before + left - 1e-6 <= due <= after + left + 1e-6, "armed off due"
                else:  # expired already (a busy machine)
                    assert after >= due, "the timerfd is not armed"
            await fired.wait(2)
            for index, generation, at in fired.fired:
                assert generation == 10 + index
                assert at >= dues[index], "the timer fired before its due time"
            await asyncio.sleep(0.005)
            assert len(fired.fired) == 2, "a timer fired twice"
        finally:
            timers.close()

    asyncio.run(main())


@linux
def test_arming_a_partitions_timer_again_replaces_its_deadline() -> None:
    # a batch sealed early (full) is followed by the next: its timer must not seal that one
    async def main() -> None:
        fired = Fired()
        timers = loop_timers(fired)
        loop = asyncio.get_running_loop()
        try:
            assert timers.start(0, 1, time.monotonic() + 0.0005)
            # the first deadline passes while the loop is busy (blocked, on purpose) ...
            time.sleep(0.002)  # noqa: ASYNC251
            # ... and the next batch's timer is armed before the loop looks at the fd
            # (queued ahead of the fd's readiness; the expiry that epoll saw is cleared)
            due = time.monotonic() + 0.02
            loop.call_soon(timers.start, 0, 2, due)
            await fired.wait(1)
            [(index, generation, at)] = fired.fired
            assert (index, generation) == (0, 2)
            assert at >= due, "the sealed batch's deadline fired the next batch's timer"
            await asyncio.sleep(0.005)
            assert len(fired.fired) == 1, "a timer fired twice"
        finally:
            timers.close()

    asyncio.run(main())


@linux
def test_closed_loop_timers_close_their_timerfds_and_fire_nothing() -> None:
    async def main() -> None:
        fired = Fired()
        before = open_timerfds()
        timers = loop_timers(fired)
        for index in range(4):
            assert timers.start(index, 1, time.monotonic() + 0.001)
        assert open_timerfds() == before + 4
        fds = list(timers._fds.values())
        timers.close()
        timers.close()
        assert open_timerfds() == before, "a timerfd was left open"
        loop = asyncio.get_running_loop()
        assert not any(loop.remove_reader(fd) for fd in fds), "the loop still watches one"
        await asyncio.sleep(0.005)
        assert fired.fired == [], "a closed timer fired"
        assert not timers.start(0, 2, time.monotonic()), "a closed timer was armed"

    asyncio.run(main())


def test_a_loop_with_its_own_clock_or_no_fds_keeps_call_at() -> None:
    async def main() -> None:
        assert LoopTimers.open(asyncio.get_running_loop(), Fired()) is None

    with asyncio.Runner(loop_factory=OwnClockLoop) as runner:
        runner.run(main())

    class NoFdLoop(asyncio.SelectorEventLoop):
        def add_reader(self, *args: object) -> None:
            raise NotImplementedError

    async def no_fds() -> None:
        timers = LoopTimers.open(asyncio.get_running_loop(), Fired())
        if timers is None:  # not Linux
            return
        before = open_timerfds()
        for _ in range(2):
            assert not timers.start(0, 1, time.monotonic() + 0.001), "armed, unwatched"
        assert timers.closed, "it would try again for every batch"
        assert open_timerfds() == before, "the refused timerfd was left open"
        timers.close()

    with asyncio.Runner(loop_factory=NoFdLoop) as runner:
        runner.run(no_fds())


@linux
def test_a_kernel_that_refuses_timerfds_keeps_call_at(monkeypatch: pytest.MonkeyPatch) -> None:
    # a seccomp'd sandbox says EPERM for good; a process out of descriptors, for now
    refusals = [errno.EMFILE, errno.EPERM]

    def create() -> int:
        err = refusals.pop(0)
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(_timer, "_found", {})
    monkeypatch.setattr(_timer, "_os_calls", lambda: (create, lambda fd, ns: None))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert LoopTimers.open(loop, Fired()) is None  # EMFILE: not this time ...
        assert LoopTimers.open(loop, Fired()) is None  # ... EPERM: not ever
        assert LoopTimers.open(loop, Fired()) is None
        assert refusals == [], "EPERM was not remembered, or EMFILE was"

    asyncio.run(main())

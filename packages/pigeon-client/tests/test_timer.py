"""The batching timer's sleeps (``pigeon.client._timer``): on the engine thread of the sync
and asyncio faces a timerfd wakes a sleep at its deadline, not at the next whole
millisecond epoll's rounded timeout gives; the producer's timer sleeps through the
engine's ``sleep_until`` until the batch is due."""

from __future__ import annotations

import sys

import pytest
import trio

from pigeon.client._engine import ClientEngine
from pigeon.client._thread import EngineThread
from pigeon.client._timer import PreciseTimers
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

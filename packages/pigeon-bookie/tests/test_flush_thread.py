"""FlushThread: the group commit's own thread for blocking calls."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from pigeon.bookie._storage_state import FlushThread


def _threads(name: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name == name)


async def test_calls_run_in_order_in_one_thread_and_errors_come_back() -> None:
    ft = FlushThread("test-flush-a")
    seen: list[tuple[int, str]] = []

    def call(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * 2

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(ft.run, call, i)
    assert sorted(i for i, _ in seen) == list(range(20))
    assert {name for _, name in seen} == {"test-flush-a"}
    assert await ft.run(call, 21) == 42

    def boom() -> None:
        raise OSError(5, "I/O error")

    with pytest.raises(OSError, match="I/O error"):
        await ft.run(boom)
    assert await ft.run(call, 1) == 2  # the thread survives a failing call


async def test_the_thread_ends_when_idle_and_starts_again() -> None:
    ft = FlushThread("test-flush-b", idle_s=0.01)
    assert await ft.run(lambda: 1) == 1
    deadline = time.monotonic() + 10
    while _threads("test-flush-b") and time.monotonic() < deadline:
        await trio.to_thread.run_sync(time.sleep, 0.01)
    assert _threads("test-flush-b") == 0
    assert await ft.run(lambda: 2) == 2
    # many calls racing the idle exit: none is lost
    for i in range(200):
        assert await ft.run(lambda i=i: i) == i


async def test_a_thread_that_cannot_start_fails_the_call_not_the_next_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # no thread left (a process at its limit): the call raises, and the next one,
    # once threads start again, runs instead of waiting forever for a thread
    ft = FlushThread("test-flush-c")

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="start new thread"):
        await ft.run(lambda: 1)
    monkeypatch.undo()
    got: list[int] = []
    async with trio.open_nursery() as nursery:

        async def call() -> None:
            got.append(await ft.run(lambda: 2))

        nursery.start_soon(call)
        with trio.move_on_after(10):  # bounded: a lost call is reported, not a hang
            while not got:  # noqa: ASYNC110
                await trio.sleep(0.01)
        if not got:  # unstick it: the failure is reported below
            threading.Thread(target=ft._serve, daemon=True).start()
    assert got == [2], "the call after a failed thread start was never run"

"""A server's event loop names what stalls it (``pigeon.core._stalls.StallWatch``): a
task step that holds the loop, a long garbage collection, a late wake-up; one log line
each, from the moment the node is ready (not the imports and opens of its start)."""

from __future__ import annotations

import functools
import gc
import logging
import os
import signal
import time

import pytest
import trio

from pigeon.core._runtime import run_until_signal
from pigeon.core._stalls import StallWatch, stall_threshold

BLOCK = 0.15  # seconds a step holds the loop in these tests (the threshold is 50 ms)


def stall_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pigeon.core.stalls"]


async def test_a_step_that_holds_the_loop_is_named(caplog: pytest.LogCaptureFixture) -> None:
    watch = StallWatch(0.05)
    watch.install()
    try:

        async def hog() -> None:
            await trio.lowlevel.checkpoint()
            time.sleep(BLOCK)  # noqa: ASYNC251 (the stall under test: this step holds the loop)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hog, name="the-hog")
    finally:
        watch.uninstall()
    lines = [line for line in stall_lines(caplog) if "the-hog" in line]
    assert len(lines) == 1 and "one step of task the-hog" in lines[0]
    assert watch.stalls >= 1


def test_a_late_wake_up_and_a_long_collection_are_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = StallWatch(0.05)
    watch.before_io_wait(0.0)
    time.sleep(BLOCK)  # the process "did not run" for that long after its wait
    watch.after_io_wait(0.0)
    watch._collected("start", {"generation": 2})
    time.sleep(BLOCK)
    watch._collected("stop", {"generation": 2, "collected": 7})
    lines = stall_lines(caplog)
    assert any("woke late from a 0 ms wait" in line for line in lines), lines
    assert any("garbage collection generation=2 collected=7" in line for line in lines), lines


def test_real_collections_are_watched_until_uninstalled() -> None:
    watch = StallWatch(0.0)  # every collection counts

    async def main() -> None:
        watch.install()
        gc.collect()
        seen = watch.stalls
        watch.uninstall()
        gc.collect()
        assert seen >= 1 and watch.stalls == seen

    trio.run(main)


def test_the_threshold_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("PIGEON_STALL_WARNING_MS", raising=False)
    assert stall_threshold() == pytest.approx(0.1)
    monkeypatch.setenv("PIGEON_STALL_WARNING_MS", "250")
    assert stall_threshold() == pytest.approx(0.25)
    monkeypatch.setenv("PIGEON_STALL_WARNING_MS", "0")
    assert stall_threshold() == 0
    monkeypatch.setenv("PIGEON_STALL_WARNING_MS", "soon")
    assert stall_threshold() == pytest.approx(0.1)
    assert any("is not a number" in r.getMessage() for r in caplog.records)


def test_a_node_is_watched_once_ready_not_while_starting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PIGEON_STALL_WARNING_MS", "50")
    caplog.set_level(logging.WARNING)

    ready: list[str] = []
    up = trio.Event()

    def on_ready(value: str) -> None:  # called once the watch is on
        ready.append(value)
        up.set()

    async def node(task_status: trio.TaskStatus[str]) -> None:
        time.sleep(BLOCK)  # noqa: ASYNC251 (starting: not watched)
        task_status.started("up")
        await up.wait()
        time.sleep(BLOCK)  # noqa: ASYNC251 (running: watched)
        os.kill(os.getpid(), signal.SIGINT)
        await trio.sleep_forever()

    trio.run(functools.partial(run_until_signal, node, ready=on_ready))
    assert ready == ["up"]
    lines = [line for line in stall_lines(caplog) if "one step of task" in line]
    assert any("node" in line for line in lines), lines
    assert len([line for line in lines if "node" in line]) == 1, lines

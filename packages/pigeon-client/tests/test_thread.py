"""EngineThread: one client engine in a background thread, shared by the sync and asyncio
faces.  No broker is needed: the engine connects lazily."""

from __future__ import annotations

import threading

import pytest
import trio

from pigeon.client._engine import ClientEngine
from pigeon.client._thread import EngineThread
from pigeon.core.errors import AlreadyClosed


def test_calls_run_on_the_engine_thread_until_it_is_closed() -> None:
    thread = EngineThread(ClientEngine("pigeon://127.0.0.1:1"))
    assert thread.alive() and thread.thread.name == "pigeon-client"

    async def where() -> str:
        return threading.current_thread().name

    assert thread.call(where) == "pigeon-client"
    done = threading.Event()
    seen: list[str] = []
    thread.soon(lambda: (seen.append(threading.current_thread().name), done.set()))
    assert done.wait(10) and seen == ["pigeon-client"]
    assert abs(thread.now() - thread.call(_trio_now)) < 1.0

    thread.call(thread.engine.aclose)
    thread.closed = True
    thread.join(30)
    assert not thread.alive() and not thread.thread.is_alive()
    with pytest.raises(AlreadyClosed):
        thread.call(where)
    with pytest.raises(AlreadyClosed):
        thread.soon(print)


async def _trio_now() -> float:
    return trio.current_time()

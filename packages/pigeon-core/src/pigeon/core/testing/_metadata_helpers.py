"""What the metadata contract suite and backends' own tests share: bounded waits on watch
events, running a store for the length of a block, a store in a process killed -9."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import TypeVar

import trio

from pigeon.core.metadata import EventType, MetadataStore, WatchEvent

__all__ = [
    "QUIET",
    "WAIT",
    "ExpireSession",
    "MetadataStoreFactory",
    "ServerRestart",
    "kill_ephemeral_owner",
    "next_event",
    "run_until_ready_and_kill",
    "running_store",
    "store_factory",
    "wait_event",
]

MetadataStoreFactory = Callable[[], AbstractAsyncContextManager[MetadataStore]]
ExpireSession = Callable[[MetadataStore], Awaitable[None]]
#: ``(new_store, restart)``: a not-running store on a server, and a blocking restart of it
ServerRestart = tuple[Callable[[], MetadataStore], Callable[[], object]]
S = TypeVar("S", bound=MetadataStore)

#: Upper bound of every wait in the suite.
WAIT = 20.0
#: How long the suite watches for something that must not happen.
QUIET = 0.3

C, U, D = EventType.CREATED, EventType.CHANGED, EventType.DELETED


async def next_event(events: AsyncIterator[WatchEvent]) -> WatchEvent:
    with trio.fail_after(WAIT):
        return await anext(events)


async def wait_event(
    events: AsyncIterator[WatchEvent], type: EventType, path: str
) -> list[WatchEvent]:
    """Read events until one of ``type`` on ``path``; return all read."""
    seen: list[WatchEvent] = []
    with trio.fail_after(WAIT):
        async for event in events:
            seen.append(event)
            if event.type is type and event.path == path:
                return seen
    raise AssertionError(f"watch ended before {type} {path}; saw {seen}")


@asynccontextmanager
async def running_store(store: S) -> AsyncIterator[S]:
    """``store`` running (``nursery.start(store.run)``) for the block; closed after it."""
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        yield store
        nursery.cancel_scope.cancel()


async def create_set_delete(store: MetadataStore, path: str) -> None:
    """A node's life at ``path``: created as ``b"1"``, set to ``b"2"``, deleted."""
    await store.create(path, b"1")
    await store.set(path, b"2")
    await store.delete(path)


def store_factory(new_store: Callable[[], MetadataStore]) -> MetadataStoreFactory:
    """A :data:`MetadataStoreFactory` that runs a store made by ``new_store()``."""

    def factory() -> AbstractAsyncContextManager[MetadataStore]:
        return running_store(new_store())

    return factory


_OWNER_SCRIPT = """
import sys, trio
from pigeon.core import PluginManager

async def main():
    store = PluginManager().metadata_stores.get(sys.argv[1].split(":")[0])(sys.argv[1])
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await store.create(sys.argv[2], b"owner", ephemeral=True)
        print("ready", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def kill_ephemeral_owner(url: str, path: str) -> None:
    """Run the store of ``url`` in a child process, let it create the ephemeral node
    ``path``, and kill the process (SIGKILL): its session ends only by timing out."""
    await run_until_ready_and_kill(_OWNER_SCRIPT, url, path)


async def run_until_ready_and_kill(script: str, *args: str) -> None:
    """Run the Python ``script`` (with ``args``) in a child process until it prints
    ``ready``, then kill it with SIGKILL: no cleanup of any kind runs."""
    async with trio.open_nursery() as nursery:
        proc = await nursery.start(
            partial(
                trio.run_process,
                [sys.executable, "-c", script, *args],
                stdout=subprocess.PIPE,
                check=False,
            )
        )
        output = b""
        with trio.fail_after(WAIT):
            while b"ready" not in output:
                chunk = await proc.stdout.receive_some()
                assert chunk, "the child process exited early"
                output += chunk
        proc.kill()
    assert proc.returncode == -9

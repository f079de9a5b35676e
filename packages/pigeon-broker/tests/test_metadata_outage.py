"""A metadata server that goes away (connection lost, restarting) must not end a broker:
the watches behind the bookie directory, the namespace policies and the load manager's
unload requests wait it out."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import trio

from pigeon.broker._node import BookieDirectory
from pigeon.broker._policies import NamespacePolicies, PolicyStore
from pigeon.core.errors import MetadataError
from pigeon.core.paths import BOOKIES_PATH


class _Stat:
    def __init__(self, value: bytes) -> None:
        self.value = value
        self.version = 0


class FlakyStore:
    """Watches fail (as kazoo's do on ConnectionLoss) until ``outages`` is used up."""

    def __init__(self, outages: int) -> None:
        self.outages = outages
        self.nodes: dict[str, bytes] = {}
        self.watches = 0
        self.events: trio.MemorySendChannel[Any] | None = None

    async def children(self, path: str) -> list[str]:
        await trio.lowlevel.checkpoint()
        return [p[len(path) + 1 :] for p in self.nodes if p.startswith(path + "/")]

    async def get(self, path: str) -> _Stat | None:
        await trio.lowlevel.checkpoint()
        value = self.nodes.get(path)
        return None if value is None else _Stat(value)

    async def delete(self, path: str) -> None:
        await trio.lowlevel.checkpoint()
        self.nodes.pop(path, None)

    @contextlib.asynccontextmanager
    async def watch(self, path: str, *, prefix: bool = False) -> AsyncIterator[Any]:
        self.watches += 1
        await trio.lowlevel.checkpoint()
        if self.outages:
            self.outages -= 1
            raise MetadataError(f"watch {path}: ConnectionLoss")
        send, receive = trio.open_memory_channel[Any](10)
        self.events = send
        async with receive:
            yield receive


async def test_bookie_directory_survives_a_metadata_outage(autojump_clock: Any) -> None:
    store = FlakyStore(outages=3)
    store.nodes[f"{BOOKIES_PATH}/127.0.0.1:3181"] = json.dumps({}).encode()
    directory = BookieDirectory(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(directory.run)
        assert directory.writable() == ["127.0.0.1:3181"]
        assert store.watches == 4
        nursery.cancel_scope.cancel()


async def test_policy_watch_survives_a_metadata_outage_and_keeps_its_cache(
    autojump_clock: Any,
) -> None:
    store = FlakyStore(outages=0)
    policies = PolicyStore(store)
    policies._cache["public/default"] = NamespacePolicies(retention_time_s=-1)
    async with trio.open_nursery() as nursery:
        await nursery.start(policies.watch)
        # the server goes away: the watch ends with an error, then comes back
        store.outages = 2
        assert store.events is not None
        await store.events.aclose()
        await trio.sleep(10)
        assert store.watches == 4
        assert policies.cached("public/default").retention_time_s == -1
        nursery.cancel_scope.cancel()


async def test_load_manager_requests_watch_survives_a_metadata_outage(
    autojump_clock: Any, monkeypatch: Any
) -> None:
    """Found by the nemesis: a broker started while ZooKeeper dropped its connection
    exited (``MetadataError: reading the change log: ConnectionLoss`` from the unload
    requests watch of the load manager)."""
    from types import SimpleNamespace

    from pigeon.broker import _lifecycle
    from pigeon.broker._loadmanager import LoadManager
    from pigeon.core.paths import UNLOAD_REQUESTS_PATH

    store = FlakyStore(outages=3)
    address = "127.0.0.1:6650"
    request = f"{UNLOAD_REQUESTS_PATH}/{address}/r-0000000001"
    store.nodes[request] = json.dumps({"namespace": "public/default", "bundle": "b1"}).encode()
    unloaded: list[str] = []

    async def unload_bundle(service: Any, namespace: str, bundle: str) -> list[str]:
        unloaded.append(f"{namespace}/{bundle}")
        return []

    monkeypatch.setattr(_lifecycle, "unload_bundle", unload_bundle)
    service = SimpleNamespace(store=store, ownership=SimpleNamespace(address=address), config=None)
    manager = LoadManager(service)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(1):  # the broker does not wait for the metadata server
            await nursery.start(manager._serve_requests)
        await trio.sleep(10)
        assert unloaded == ["public/default/b1"]
        assert request not in store.nodes
        assert store.watches == 4
        nursery.cancel_scope.cancel()

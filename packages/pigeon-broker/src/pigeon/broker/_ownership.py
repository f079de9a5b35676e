"""Topic ownership: namespace bundles held through ephemeral nodes, and broker lookups.

Each namespace's hash space is split into ``bundles_per_namespace`` equal bundles; a topic
belongs to the bundle its name's CRC-32 falls in. A broker serves a topic only while it
holds its bundle's ephemeral node ``/pigeon/ownership/<tenant>/<ns>/<bundle>`` (value: the
broker's service URL). When a broker dies its metadata session expires, the nodes vanish,
and the next lookup hands the bundle to another broker, which recovers (fences) the
topics' last segments before appending: no data moves.

Brokers register at ``/pigeon/brokers/available/<host:port>`` with a small load report;
a lookup for an unowned bundle proposes the least-loaded broker, and that broker claims
the bundle when the first producer or consumer arrives.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable
from typing import Any

import trio

from pigeon.core import TopicName
from pigeon.core.errors import NodeExists, NotOwner, PigeonError

__all__ = ["BROKERS_PATH", "OWNERSHIP_PATH", "Ownership"]

log = logging.getLogger(__name__)

BROKERS_PATH = "/pigeon/brokers/available"
OWNERSHIP_PATH = "/pigeon/ownership"
FULL_RANGE = 1 << 32


class Ownership:
    def __init__(
        self,
        store: Any,
        service_url: str,
        address: str,
        *,
        bundles_per_namespace: int = 4,
        load: Callable[[], dict[str, Any]] = dict,
        report_interval: float = 5.0,
    ) -> None:
        self.store = store
        self.service_url = service_url
        self.address = address
        self.bundles = max(1, bundles_per_namespace)
        self.load = load
        self.report_interval = report_interval
        self.owned: set[str] = set()

    # ------------------------------------------------------------------ bundles

    def bundle_of(self, name: TopicName) -> str:
        """``0xSTART_0xEND`` of the bundle holding ``name`` (partitions stay together)."""
        base = name.base.full
        h = zlib.crc32(base.encode())
        size = FULL_RANGE // self.bundles
        index = min(h // size, self.bundles - 1)
        start = index * size
        end = FULL_RANGE if index == self.bundles - 1 else start + size
        return f"0x{start:08x}_0x{end:08x}"

    def path_of(self, name: TopicName) -> str:
        return f"{OWNERSHIP_PATH}/{name.tenant}/{name.namespace}/{self.bundle_of(name)}"

    def owns(self, name: TopicName) -> bool:
        return self.path_of(name) in self.owned

    async def owner_of(self, name: TopicName) -> str | None:
        stat = await self.store.get(self.path_of(name))
        if stat is None:
            return None
        return str(json.loads(stat.value)["url"])

    async def acquire(self, name: TopicName) -> None:
        """Claim the topic's bundle for this broker; NotOwner if another holds it."""
        path = self.path_of(name)
        if path in self.owned:
            return
        value = json.dumps({"url": self.service_url, "address": self.address}).encode()
        for _attempt in range(3):
            try:
                await self.store.create(path, value, ephemeral=True)
                self.owned.add(path)
                log.info("bundle acquired bundle=%s", path)
                return
            except NodeExists:
                pass
            stat = await self.store.get(path)
            if stat is None:
                continue
            owner = json.loads(stat.value)["url"]
            if owner != self.service_url:
                raise NotOwner(f"{name} is served by {owner}")
            # Our own address from an earlier run whose session has not expired yet:
            # take the node over so that its expiry cannot drop our ownership later.
            try:
                await self.store.delete(path, version=stat.version)
            except PigeonError:
                pass
        raise NotOwner(f"could not acquire the bundle of {name}; try again")

    # ------------------------------------------------------------------ lookups

    async def brokers(self) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for child in await self.store.children(BROKERS_PATH):
            stat = await self.store.get(f"{BROKERS_PATH}/{child}")
            if stat is not None:
                try:
                    found[child] = json.loads(stat.value)
                except ValueError:
                    continue
        return found

    async def lookup(self, name: TopicName) -> str:
        """The owner's service URL, or the least-loaded broker's for an unowned bundle."""
        owner = await self.owner_of(name)
        if owner is not None:
            return owner
        brokers = await self.brokers()
        if not brokers:
            return self.service_url
        best = min(brokers.values(), key=lambda b: (b.get("topics", 0), b.get("url", "")))
        return str(best.get("url", self.service_url))

    # ------------------------------------------------------------------ lifecycle

    def _report(self) -> bytes:
        return json.dumps(
            {"url": self.service_url, "address": self.address, **self.load()}
        ).encode()

    async def register(self) -> None:
        path = f"{BROKERS_PATH}/{self.address}"
        try:
            await self.store.create(path, self._report(), ephemeral=True)
        except NodeExists:
            await self.store.delete(path)
            await self.store.create(path, self._report(), ephemeral=True)

    async def run(
        self,
        on_lost: Callable[[], Any],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Register, refresh the load report, and handle a lost metadata session."""
        await self.register()
        task_status.started()
        async with trio.open_nursery() as nursery:

            async def refresh() -> None:
                while True:
                    await trio.sleep(self.report_interval)
                    try:
                        await self.store.set(f"{BROKERS_PATH}/{self.address}", self._report())
                    except PigeonError as exc:
                        log.info("load report failed error=%s", exc)

            nursery.start_soon(refresh)
            while True:
                await self.store.wait_session_expired()
                log.warning("metadata session expired: giving up every owned bundle")
                self.owned.clear()
                await on_lost()
                while True:
                    try:
                        await self.store.new_session()
                        await self.register()
                        break
                    except PigeonError as exc:
                        log.warning("re-registering failed error=%s", exc)
                        await trio.sleep(1.0)

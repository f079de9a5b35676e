"""Load manager: an elected broker sheds bundles from overloaded brokers.

Every broker runs a :class:`LoadManager`. One of them, elected through
``/pigeon/load-manager``, compares the load reports brokers publish (topics served) every
``interval_s``: when the busiest broker serves at least ``overload_ratio`` times as many
topics as the idlest one (and at least ``min_difference`` more), it asks the busiest to
unload one of its bundles by creating ``/pigeon/unload-requests/<address>/<n>``. Each
broker watches its own request path and unloads the bundle (closing its topics, giving
up the ownership node); clients look the topics up again and the least-loaded broker
claims the bundle. Assignment of unowned bundles to the least-loaded broker happens at
lookup time (see ``_ownership.py``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import trio

from pigeon.broker._ownership import OWNERSHIP_PATH
from pigeon.core.errors import NoSuchNode, PigeonError
from pigeon.core.metadata import EventType, lead_forever

__all__ = ["LoadManager"]

log = logging.getLogger(__name__)

REQUESTS_PATH = "/pigeon/unload-requests"


class LoadManager:
    def __init__(
        self,
        service: Any,
        *,
        interval_s: float = 10.0,
        overload_ratio: float = 2.0,
        min_difference: int = 2,
    ) -> None:
        self.service = service
        self.store = service.store
        self.interval_s = interval_s
        self.overload_ratio = overload_ratio
        self.min_difference = min_difference
        self.is_leader = False
        self.sheds = 0

    @property
    def address(self) -> str:
        return str(self.service.ownership.address)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self._serve_requests)
            await nursery.start(
                lead_forever,
                self.store,
                "/pigeon/load-manager",
                self.service.service_url,
                self._lead,
            )
            task_status.started()

    async def _lead(self) -> None:
        self.is_leader = True
        log.info("load manager elected broker=%s", self.service.service_url)
        try:
            while True:
                await trio.sleep(self.interval_s)
                try:
                    await self.balance_once()
                except PigeonError as exc:
                    log.warning("load balancing pass failed error=%s", exc)
        finally:
            self.is_leader = False

    # ------------------------------------------------------------------ leader

    async def _owned_bundles(self, address: str) -> list[tuple[str, str]]:
        """(namespace, bundle) pairs whose ownership node names ``address``."""
        out = []
        for tenant in await self.store.children(OWNERSHIP_PATH):
            for ns in await self.store.children(f"{OWNERSHIP_PATH}/{tenant}"):
                base = f"{OWNERSHIP_PATH}/{tenant}/{ns}"
                for bundle in await self.store.children(base):
                    stat = await self.store.get(f"{base}/{bundle}")
                    if stat is not None and json.loads(stat.value).get("address") == address:
                        out.append((f"{tenant}/{ns}", bundle))
        return out

    async def balance_once(self) -> bool:
        """One pass: ask the busiest broker to shed a bundle if it is overloaded."""
        brokers = await self.service.ownership.brokers()
        if len(brokers) < 2:
            return False
        load = {address: int(info.get("topics", 0)) for address, info in brokers.items()}
        busiest = max(load, key=lambda a: (load[a], a))
        idlest = min(load, key=lambda a: (load[a], a))
        high, low = load[busiest], load[idlest]
        if high - low < self.min_difference or high < self.overload_ratio * max(low, 1):
            return False
        bundles = await self._owned_bundles(busiest)
        if len(bundles) < 2:
            return False  # shedding its only bundle would just move the problem
        namespace, bundle = bundles[0]
        await self.store.create(
            f"{REQUESTS_PATH}/{busiest}/r-",
            json.dumps({"namespace": namespace, "bundle": bundle}).encode(),
            sequential=True,
        )
        self.sheds += 1
        log.info(
            "shedding bundle broker=%s topics=%s idlest=%s topics=%s bundle=%s/%s",
            busiest,
            high,
            idlest,
            low,
            namespace,
            bundle,
        )
        return True

    # ------------------------------------------------------------------ every broker

    async def _serve_requests(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        from pigeon.broker._admin_ops import unload_bundle

        path = f"{REQUESTS_PATH}/{self.address}"
        async with self.store.watch(path, prefix=True) as events:
            task_status.started()
            for child in await self.store.children(path):
                await self._handle(f"{path}/{child}", unload_bundle)
            async for event in events:
                if event.type is EventType.CREATED and event.path != path:
                    await self._handle(event.path, unload_bundle)

    async def _handle(self, request: str, unload_bundle: Any) -> None:
        stat = await self.store.get(request)
        if stat is None:
            return
        try:
            doc = json.loads(stat.value)
            unloaded = await unload_bundle(self.service, doc["namespace"], doc["bundle"])
            log.info("bundle shed on request bundle=%s topics=%s", doc["bundle"], len(unloaded))
        except (PigeonError, ValueError, KeyError) as exc:
            log.warning("unload request failed request=%s error=%s", request, exc)
        try:
            await self.store.delete(request)
        except NoSuchNode:
            pass

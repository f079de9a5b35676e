"""Load manager: an elected broker sheds bundles from overloaded brokers, with hysteresis.

Every broker runs a :class:`LoadManager`. Each one adds a ``bundles`` section to its load
report (``/pigeon/brokers/available/<address>``): for every bundle it owns, the topics it
serves there and their inbound bytes/s over the last report interval. One of them, elected
through ``/pigeon/load-manager``, reads the reports every ``interval_s`` and asks
:class:`Shedder` (plain logic, no I/O) whether a bundle should move; if so it asks the
owner to unload it by creating ``/pigeon/unload-requests/<address>/<n>``. Each broker
watches its own request path and unloads the bundle (closing its topics, giving up the
ownership node); clients look the topics up again and the least-loaded broker claims the
bundle (see ``_ownership.py``). Every move unloads topics, so a move must be worth it:

* only from a broker whose load (topics served) exceeds the cluster mean by more than
  ``load_balancer_broker_overloaded_threshold_percentage`` percent;
* only a bundle whose load is *smaller than the gap* between that broker and the least
  loaded one: the move then narrows the gap and never makes the target the new busiest
  (``sum(load²)`` falls with every move, so with steady loads shedding stops);
* never a bundle moved (by this leader, or seen changing owner) less than
  ``load_balancer_shedding_grace_period_minutes`` ago;
* never a bundle with less inbound traffic than
  ``load_balancer_bundle_unload_minimum_throughput_threshold`` MB/s (0: any bundle);
* among those, the bundle that leaves the two brokers closest to even.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import trio

from pigeon.broker import _lifecycle
from pigeon.broker._watch import watch_forever
from pigeon.core.errors import NoSuchNode, PigeonError
from pigeon.core.metadata import EventType, lead_forever
from pigeon.core.paths import LOAD_MANAGER_PATH, OWNERSHIP_PATH, UNLOAD_REQUESTS_PATH

__all__ = ["BundleLoad", "LoadManager", "Shed", "Shedder"]

log = logging.getLogger(__name__)

MB = 1024 * 1024


# ---------------------------------------------------------------------- decisions (no I/O)


@dataclass(frozen=True, slots=True)
class BundleLoad:
    """One bundle as its owner reports it."""

    topics: int
    #: inbound bytes/s over the owner's last report interval
    bytes_rate: float = 0.0
    #: False for load the leader cannot attribute to a bundle (a report without one)
    movable: bool = True


@dataclass(frozen=True, slots=True)
class Shed:
    """The decision to unload ``bundle`` (``tenant/ns/0xSTART_0xEND``) from ``broker``."""

    broker: str
    bundle: str
    target: str  #: the least-loaded broker, expected to take the bundle
    bundle_load: int
    broker_load: int
    target_load: int
    mean: float


#: how long an ordered move counts in the loads while no report shows the bundle at its
#: target (a move that failed is forgotten after this)
PENDING_MOVE_S = 60.0


class Shedder:
    """Which bundle, if any, to move now; fed the cluster's reports every pass.

    ``decide(now, cluster)`` takes ``{broker: {bundle: BundleLoad}}`` and the time (any
    monotonic seconds), remembers every move it orders and every change of owner it sees,
    and returns a :class:`Shed` or ``None`` (``last_reason`` says why not).
    """

    def __init__(
        self,
        *,
        overloaded_threshold_pct: float = 20.0,
        min_throughput_bytes: float = 0.0,
        grace_period_s: float = 30 * 60.0,
    ) -> None:
        self.overloaded_threshold_pct = overloaded_threshold_pct
        self.min_throughput_bytes = min_throughput_bytes
        self.grace_period_s = grace_period_s
        self.moved_at: dict[str, float] = {}  #: bundle -> when it last moved
        #: bundle -> owner at the last pass, or the target of a move ordered since
        self._owner: dict[str, str] = {}
        #: moves ordered whose target has not reported the bundle yet: bundle ->
        #: (source, target, topics, when); counted in the loads until the reports show them
        self._pending: dict[str, tuple[str, str, int, float]] = {}
        self.last_reason = ""

    def recently_moved(self, bundle: str, now: float) -> bool:
        return now - self.moved_at.get(bundle, -math.inf) < self.grace_period_s

    def _observe(self, now: float, cluster: Mapping[str, Mapping[str, BundleLoad]]) -> None:
        for broker, bundles in cluster.items():
            for bundle, x in bundles.items():
                if not x.movable:
                    continue
                before = self._owner.get(bundle)
                if before is not None and before != broker:
                    self.moved_at[bundle] = now  # moved since the last pass
                self._owner[bundle] = broker
        # forget moves older than the grace period (the map stays bounded)
        for bundle in [b for b, t in self.moved_at.items() if now - t >= self.grace_period_s]:
            del self.moved_at[bundle]

    def _count_pending(
        self, now: float, cluster: Mapping[str, Mapping[str, BundleLoad]], load: dict[str, int]
    ) -> None:
        """Count the moves ordered but not yet in the reports as done: reports lag (each
        broker reports every few seconds), and without this a pass after a shed sees the
        same imbalance and sheds again, until every bundle has moved."""
        for bundle, (source, target, topics, when) in list(self._pending.items()):
            at_target = bundle in cluster.get(target, {})
            if at_target or now - when > PENDING_MOVE_S or target not in cluster:
                del self._pending[bundle]  # reported where it went (or given up on)
                continue
            if bundle in cluster.get(source, {}):
                load[source] -= topics
            load[target] += topics

    def decide(self, now: float, cluster: Mapping[str, Mapping[str, BundleLoad]]) -> Shed | None:
        self._observe(now, cluster)
        if len(cluster) < 2:
            self.last_reason = "fewer than two brokers"
            return None
        load = {b: sum(x.topics for x in bundles.values()) for b, bundles in cluster.items()}
        self._count_pending(now, cluster, load)
        mean = sum(load.values()) / len(load)
        busiest = max(load, key=lambda b: (load[b], b))
        idlest = min(load, key=lambda b: (load[b], b))
        high, low = load[busiest], load[idlest]
        if high <= mean * (1 + self.overloaded_threshold_pct / 100):
            self.last_reason = f"no broker above the mean {mean:.1f} by the threshold"
            return None
        gap = high - low
        candidates = [
            (abs(gap - 2 * x.topics), -x.topics, bundle, x.topics)
            for bundle, x in cluster[busiest].items()
            if x.movable
            and 0 < x.topics < gap  # the target stays below the source's load
            and x.bytes_rate >= self.min_throughput_bytes
            and not self.recently_moved(bundle, now)
        ]
        if not candidates:
            self.last_reason = f"no bundle of {busiest} lighter than the gap {gap} may move"
            return None
        _, _, bundle, topics = min(candidates)
        self.moved_at[bundle] = now
        self._owner[bundle] = idlest  # where it should be seen next: no new move
        self._pending[bundle] = (busiest, idlest, topics, now)
        self.last_reason = "shed"
        return Shed(busiest, bundle, idlest, topics, high, low, mean)


def cluster_view(brokers: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, BundleLoad]]:
    """``{broker: {bundle: BundleLoad}}`` from the brokers' registration values."""
    out: dict[str, dict[str, BundleLoad]] = {}
    for address, info in brokers.items():
        section = info.get("bundles")
        if not isinstance(section, dict):
            # a report without bundles: its topics count, but nothing can be picked
            out[address] = {"": BundleLoad(int(info.get("topics", 0) or 0), movable=False)}
            continue
        view = {}
        for bundle, doc in section.items():
            if isinstance(doc, dict):
                view[str(bundle)] = BundleLoad(
                    int(doc.get("topics", 0) or 0), float(doc.get("bytes_rate", 0.0) or 0.0)
                )
        out[address] = view
    return out


# ---------------------------------------------------------------------- the service


class LoadManager:
    def __init__(
        self,
        service: Any,
        *,
        interval_s: float = 10.0,
        overloaded_threshold_pct: float | None = None,
        min_throughput_mb: float | None = None,
        grace_period_minutes: float | None = None,
    ) -> None:
        self.service = service
        self.store = service.store
        self.interval_s = interval_s
        config = getattr(service, "config", None)

        def setting(given: float | None, key: str, default: float) -> float:
            return float(given if given is not None else getattr(config, key, default))

        self.shedder = Shedder(
            overloaded_threshold_pct=setting(
                overloaded_threshold_pct,
                "load_balancer_broker_overloaded_threshold_percentage",
                20.0,
            ),
            min_throughput_bytes=MB
            * setting(
                min_throughput_mb, "load_balancer_bundle_unload_minimum_throughput_threshold", 0.0
            ),
            grace_period_s=60.0
            * setting(grace_period_minutes, "load_balancer_shedding_grace_period_minutes", 30.0),
        )
        self.is_leader = False
        self.sheds = 0
        self._rate_at: float | None = None
        self._bytes_in: dict[str, int] = {}

    @property
    def address(self) -> str:
        return str(self.service.ownership.address)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.service.ownership.report_sections["bundles"] = self.bundle_report
        async with trio.open_nursery() as nursery:
            await nursery.start(self._serve_requests)
            await nursery.start(
                lead_forever,
                self.store,
                LOAD_MANAGER_PATH,
                self.service.service_url,
                self._lead,
            )
            task_status.started()

    # ------------------------------------------------------------------ every broker

    def bundle_report(self) -> dict[str, dict[str, Any]]:
        """``{tenant/ns/bundle: {"topics": n, "bytes_rate": b}}`` for every bundle
        owned or serving topics here; bytes/s since the previous report."""
        ownership = self.service.ownership
        now = trio.current_time()
        dt = None if self._rate_at is None else now - self._rate_at
        prefix = len(OWNERSHIP_PATH) + 1
        report: dict[str, dict[str, Any]] = {
            path[prefix:]: {"topics": 0, "bytes_rate": 0.0} for path in ownership.owned
        }
        counters: dict[str, int] = {}
        for key, topic in self.service.topics.items():
            bundle = ownership.path_of(topic.name)[prefix:]
            entry = report.setdefault(bundle, {"topics": 0, "bytes_rate": 0.0})
            entry["topics"] += 1
            counters[key] = total = int(topic.bytes_in)
            if dt:
                entry["bytes_rate"] += max(0, total - self._bytes_in.get(key, total)) / dt
        for entry in report.values():
            entry["bytes_rate"] = round(entry["bytes_rate"], 1)
        self._bytes_in, self._rate_at = counters, now
        return report

    async def _serve_requests(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        unload_bundle = _lifecycle.unload_bundle
        path = f"{UNLOAD_REQUESTS_PATH}/{self.address}"

        async def watching(_first: bool) -> None:  # requests made while not watching
            for child in await self.store.children(path):
                await self._handle(f"{path}/{child}", unload_bundle)

        async def event(event: Any) -> None:
            if event.type is EventType.CREATED and event.path != path:
                await self._handle(event.path, unload_bundle)

        # the broker serves while the metadata server is away: start at once
        task_status.started()
        await watch_forever(
            self.store,
            path,
            what="unload requests watch",
            on_watching=watching,
            on_event=event,
        )

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

    # ------------------------------------------------------------------ leader

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

    async def balance_once(self) -> bool:
        """One pass: ask an overloaded broker to shed one bundle, if one may move."""
        brokers = await self.service.ownership.brokers()
        shed = self.shedder.decide(trio.current_time(), cluster_view(brokers))
        if shed is None:
            log.debug("no bundle to shed reason=%s", self.shedder.last_reason)
            return False
        # the report may be a few seconds old: ask only the bundle's current owner
        stat = await self.store.get(f"{OWNERSHIP_PATH}/{shed.bundle}")
        if stat is None or json.loads(stat.value).get("address") != shed.broker:
            log.info("bundle to shed changed owner meanwhile bundle=%s", shed.bundle)
            return False
        namespace, bundle = shed.bundle.rsplit("/", 1)
        await self.store.create(
            f"{UNLOAD_REQUESTS_PATH}/{shed.broker}/r-",
            json.dumps({"namespace": namespace, "bundle": bundle}).encode(),
            sequential=True,
        )
        self.sheds += 1
        log.info(
            "shedding bundle broker=%s load=%d mean=%.1f target=%s target_load=%d"
            " bundle=%s bundle_load=%d",
            shed.broker,
            shed.broker_load,
            shed.mean,
            shed.target,
            shed.target_load,
            shed.bundle,
            shed.bundle_load,
        )
        return True

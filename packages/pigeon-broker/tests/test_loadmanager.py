"""Load manager: the Shedder's hysteresis by hand, against a model, and the elected
LoadManager over a real metadata store, where two brokers with steady loads used to pass
one bundle back and forth every pass (each move unloads its topics)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pigeon.broker import BrokerConfig
from pigeon.broker._loadmanager import (
    MB,
    BundleLoad,
    LoadManager,
    Shedder,
    cluster_view,
)
from pigeon.broker._ownership import Ownership
from pigeon.core import TopicName
from pigeon.core.config import load_config
from pigeon.core.errors import ConfigError
from pigeon.core.metadata import EmbeddedMetadataStore
from pigeon.core.paths import BROKERS_PATH, OWNERSHIP_PATH, UNLOAD_REQUESTS_PATH


def view(**brokers: dict[str, int]) -> dict[str, dict[str, BundleLoad]]:
    return {b: {x: BundleLoad(n) for x, n in bundles.items()} for b, bundles in brokers.items()}


# ---------------------------------------------------------------------- Shedder, by hand


def test_the_reported_ping_pong_does_not_happen() -> None:
    """3 topics against 1: the old rule (twice the topics, 2 more) moved the 2-topic
    bundle, which made the other broker the busiest, and it came straight back."""
    shedder = Shedder(grace_period_s=0)
    cluster = view(a={"t/n/x": 2, "t/n/y": 1}, b={"t/n/z": 1})
    shed = shedder.decide(0, cluster)
    assert shed is not None and (shed.broker, shed.bundle, shed.target) == ("a", "t/n/y", "b")
    after = view(a={"t/n/x": 2}, b={"t/n/y": 1, "t/n/z": 1})
    assert shedder.decide(10, after) is None  # balanced: nothing moves back


def test_a_move_counts_until_the_reports_show_it() -> None:
    """Reports lag behind sheds: passes made before the brokers report again must see
    the ordered move as done, not shed every bundle of the busy broker one per pass (seen
    under load: 16 topics in 4 bundles against 0, all 4 bundles moved)."""
    shedder = Shedder(grace_period_s=600)
    stale = view(a={"w": 5, "x": 5, "y": 3, "z": 3}, b={})
    first = shedder.decide(0, stale)
    assert first is not None and first.target == "b"
    for t in (1, 2, 3):  # the same stale reports: a has 16 - 5, b has 5: close enough
        second = shedder.decide(t, stale)
        assert second is None or second.bundle != first.bundle
        if second is not None:  # at most one more move evens 16 against 0
            assert shedder.decide(t + 0.5, stale) is None
            break
    moved = {"w": 5, "x": 5, "y": 3, "z": 3}
    assert len(shedder._pending) <= 2
    # once b reports the bundle, the pending move is dropped
    landed = view(a={b: n for b, n in moved.items() if b != first.bundle}, b={first.bundle: 5})
    shedder.decide(5, landed)
    assert first.bundle not in shedder._pending


def test_a_bundle_heavier_than_the_gap_never_moves() -> None:
    shedder = Shedder(grace_period_s=0)
    assert shedder.decide(0, view(a={"x": 3}, b={"y": 1})) is None
    assert "lighter than the gap 2" in shedder.last_reason
    assert shedder.decide(0, view(a={"x": 2}, b={"y": 0})) is None  # 2 is not below 2


def test_only_a_broker_clearly_above_the_mean_sheds() -> None:
    shedder = Shedder(overloaded_threshold_pct=50, grace_period_s=0)
    # mean 10: 14 is above it, but not by 50%
    cluster = view(a={"x": 7, "y": 7}, b={"z": 8}, c={"w": 8})
    assert shedder.decide(0, cluster) is None
    assert "threshold" in shedder.last_reason
    cluster = view(a={"x": 9, "y": 7}, b={"z": 7}, c={"w": 7})  # 16 > 1.5 * 10
    shed = Shedder(overloaded_threshold_pct=50, grace_period_s=0).decide(0, cluster)
    assert shed is not None and shed.broker == "a"


def test_the_move_that_evens_the_pair_best_is_chosen() -> None:
    cluster = view(a={"x1": 1, "x5": 5, "x7": 7, "x3": 3}, b={})
    shed = Shedder(grace_period_s=0).decide(0, cluster)  # gap 16: 7 leaves 9 against 7
    assert shed is not None and shed.bundle == "x7"


def test_a_bundle_that_moved_waits_for_the_grace_period() -> None:
    shedder = Shedder(grace_period_s=600)
    assert shedder.decide(0, view(a={"x": 1, "y": 4}, b={})) is not None  # y moves
    # y landed on b; traffic then shifts so that y is the one bundle that could move back
    cluster = view(a={"x": 5}, b={"y": 3, "z": 9})
    for t in (10, 300, 599):
        assert shedder.decide(t, cluster) is None
    shed = shedder.decide(600, cluster)
    assert shed is not None and shed.bundle == "y"


def test_a_change_of_owner_seen_in_the_reports_counts_as_a_move() -> None:
    """Moves this leader did not order (an admin unload, a broker that died) too."""
    shedder = Shedder(grace_period_s=600)
    assert shedder.decide(0, view(a={"x": 1}, b={"y": 1}, c={})) is None
    cluster = view(a={"x": 1}, b={}, c={"y": 1, "w": 2})  # y moved to c
    assert shedder.decide(10, cluster) is not None  # w may move: it did not move
    assert shedder.recently_moved("y", 10) and not shedder.recently_moved("y", 610)


def test_quiet_bundles_stay_put_under_a_throughput_threshold() -> None:
    cluster = {
        "a": {"x": BundleLoad(3, bytes_rate=0.5 * MB), "y": BundleLoad(3, bytes_rate=5 * MB)},
        "b": {},
    }
    shed = Shedder(min_throughput_bytes=1 * MB, grace_period_s=0).decide(0, cluster)
    assert shed is not None and shed.bundle == "y"
    cluster["a"]["y"] = BundleLoad(3, bytes_rate=0.1 * MB)
    assert Shedder(min_throughput_bytes=1 * MB, grace_period_s=0).decide(0, cluster) is None


def test_reports_without_bundles_count_but_never_move() -> None:
    brokers = {
        "a": {"topics": 9},  # an older broker: no per-bundle section
        "b": {"topics": 0, "bundles": {}},
        "c": {"topics": 1, "bundles": {"t/n/x": {"topics": 1, "bytes_rate": 12.5}}},
    }
    cluster = cluster_view(brokers)
    assert cluster["c"] == {"t/n/x": BundleLoad(1, 12.5)}
    assert Shedder(grace_period_s=0).decide(0, cluster) is None  # a is busy, can't pick


# ---------------------------------------------------------------------- two steady brokers


def settle(
    shedder: Shedder, owner: dict[str, str], load: dict[str, int], brokers: list[str]
) -> dict[str, list[str]]:
    """Run passes 10 s apart until nothing moves (at most 200); each moved bundle lands
    on the target, as the next lookup puts it on the least-loaded broker."""
    history = {bundle: [broker] for bundle, broker in owner.items()}
    for t in range(200):
        cluster = {b: {x: BundleLoad(load[x]) for x in owner if owner[x] == b} for b in brokers}
        shed = shedder.decide(10.0 * t, cluster)
        if shed is None:
            return history
        assert owner[shed.bundle] == shed.broker
        owner[shed.bundle] = shed.target
        history[shed.bundle].append(shed.target)
    raise AssertionError(f"still shedding after 200 passes: {history}")


@settings(max_examples=300, deadline=None)
@given(
    bundles=st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from(["a", "b"])), min_size=1, max_size=16
    ),
    threshold=st.sampled_from([0.0, 10.0, 20.0, 50.0]),
    grace=st.sampled_from([0.0, 5.0, 60.0]),
)
def test_two_brokers_with_steady_loads_never_pass_a_bundle_back(
    bundles: list[tuple[int, str]], threshold: float, grace: float
) -> None:
    """Whatever the start, each bundle moves at most once (even with no grace period),
    shedding stops, and every move narrowed the gap."""
    load = {f"x{i}": n for i, (n, _) in enumerate(bundles)}
    owner = {f"x{i}": b for i, (_, b) in enumerate(bundles)}
    shedder = Shedder(overloaded_threshold_pct=threshold, grace_period_s=grace)

    def gap() -> int:
        a = sum(load[x] for x in owner if owner[x] == "a")
        return abs(a - (sum(load.values()) - a))

    before = gap()
    history = settle(shedder, owner, load, ["a", "b"])
    assert all(len(h) <= 2 for h in history.values()), history
    assert gap() <= before
    moved = sum(len(h) - 1 for h in history.values())
    assert moved == 0 or gap() < before
    # and it stays settled when the grace periods are over
    cluster = {b: {x: BundleLoad(load[x]) for x in owner if owner[x] == b} for b in "ab"}
    assert shedder.decide(1e9, cluster) is None


# ---------------------------------------------------------------------- Shedder vs a model


class ShedderMachine(RuleBasedStateMachine):
    """The leader's passes while traffic changes and brokers come and go; every move the
    Shedder orders is checked against the cluster as the model knows it."""

    INTERVAL = 10.0
    GRACE = 60.0
    THRESHOLD = 20.0

    @initialize(
        brokers=st.integers(2, 4),
        loads=st.lists(st.integers(0, 12), min_size=1, max_size=10),
        data=st.data(),
    )
    def start(self, brokers: int, loads: list[int], data: st.DataObject) -> None:
        self.brokers = [f"b{i}" for i in range(brokers)]
        self.load = {f"x{i}": n for i, n in enumerate(loads)}
        self.owner = {x: data.draw(st.sampled_from(self.brokers)) for x in self.load}
        self.shedder = Shedder(overloaded_threshold_pct=self.THRESHOLD, grace_period_s=self.GRACE)
        self.now = 0.0
        self.last_move: dict[str, float] = {}
        self.seen: dict[str, str] = {}  # owners as of the last pass (what reports show)
        self.steady_since_last_pass = False
        self.last_potential: int | None = None
        self.bundle_count = len(self.load)
        self.joined = 0

    def broker_load(self, broker: str) -> int:
        return sum(self.load[x] for x in self.owner if self.owner[x] == broker)

    def potential(self) -> int:
        return sum(self.broker_load(b) ** 2 for b in self.brokers)

    @rule()
    def leader_pass(self) -> None:
        self.now += self.INTERVAL
        cluster = {
            b: {x: BundleLoad(self.load[x]) for x in self.owner if self.owner[x] == b}
            for b in self.brokers
        }
        for bundle, broker in self.owner.items():
            if self.seen.get(bundle, broker) != broker:
                self.last_move[bundle] = self.now  # the leader sees the move now
        before = self.potential()
        shed = self.shedder.decide(self.now, cluster)
        if shed is not None:
            loads = {b: self.broker_load(b) for b in self.brokers}
            mean = sum(loads.values()) / len(loads)
            size = self.load[shed.bundle]
            assert self.owner[shed.bundle] == shed.broker
            assert loads[shed.broker] == max(loads.values())
            assert loads[shed.target] == min(loads.values())
            assert loads[shed.broker] > mean * (1 + self.THRESHOLD / 100)
            assert 0 < size < loads[shed.broker] - loads[shed.target]
            assert self.now - self.last_move.get(shed.bundle, -1e18) >= self.GRACE
            self.owner[shed.bundle] = shed.target
            self.last_move[shed.bundle] = self.now
            assert self.potential() < before  # every move evens the cluster out
        self.seen = dict(self.owner)
        if self.steady_since_last_pass and self.last_potential is not None:
            assert before <= self.last_potential
        self.steady_since_last_pass = True
        self.last_potential = self.potential()

    @rule(data=st.data(), n=st.integers(0, 12))
    def traffic_changes(self, data: st.DataObject, n: int) -> None:
        bundle = data.draw(st.sampled_from(sorted(self.load)))
        self.load[bundle] = n
        self.steady_since_last_pass = False

    @rule(n=st.integers(0, 12), data=st.data())
    def new_bundle(self, n: int, data: st.DataObject) -> None:
        bundle = f"x{self.bundle_count}"
        self.bundle_count += 1
        self.load[bundle] = n
        self.owner[bundle] = data.draw(st.sampled_from(self.brokers))
        self.steady_since_last_pass = False

    @precondition(lambda self: len(self.brokers) < 5)
    @rule()
    def broker_joins(self) -> None:
        self.joined += 1
        self.brokers.append(f"n{self.joined}")
        self.steady_since_last_pass = False

    @precondition(lambda self: len(self.brokers) > 2)
    @rule(data=st.data())
    def broker_dies(self, data: st.DataObject) -> None:
        """Its bundles go to the least-loaded survivor, one by one (lookups)."""
        dead = data.draw(st.sampled_from(self.brokers))
        self.brokers.remove(dead)
        for bundle in sorted(x for x in self.owner if self.owner[x] == dead):
            target = min(self.brokers, key=lambda b: (self.broker_load(b), b))
            self.owner[bundle] = target
        self.steady_since_last_pass = False

    @invariant()
    def moves_are_remembered_within_bounds(self) -> None:
        assert set(self.shedder.moved_at) <= set(self.load)


ShedderMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_shedder_against_model = ShedderMachine.TestCase


# ---------------------------------------------------------------------- configuration


def test_config_keys_are_pulsar_like_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "broker.toml"
    path.write_text(
        "[broker]\n"
        "load_balancer_broker_overloaded_threshold_percentage = 35\n"
        "load_balancer_bundle_unload_minimum_throughput_threshold = 2.5\n"
        "load_balancer_shedding_grace_period_minutes = 5\n"
    )
    config = load_config(BrokerConfig, path=path, section="broker", env={})
    manager = LoadManager(SimpleNamespace(store=None, config=config))
    assert manager.shedder.overloaded_threshold_pct == 35
    assert manager.shedder.min_throughput_bytes == 2.5 * MB
    assert manager.shedder.grace_period_s == 300
    with pytest.raises(ConfigError, match="load_balancer_shedding_grace_period_minutes"):
        BrokerConfig(load_balancer_shedding_grace_period_minutes=-1).validate()
    with pytest.raises(ConfigError, match="overloaded_threshold"):
        BrokerConfig(load_balancer_broker_overloaded_threshold_percentage=float("nan")).validate()


# ---------------------------------------------------------------------- over a real store


@asynccontextmanager
async def embedded(tmp_path: Path) -> AsyncIterator[EmbeddedMetadataStore]:
    store = EmbeddedMetadataStore(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        yield store
        nursery.cancel_scope.cancel()


class Cluster:
    """Two brokers' reports and ownership nodes in a real store, kept by the test: each
    unload request is carried out by moving the bundle to the least-loaded broker."""

    def __init__(self, store: EmbeddedMetadataStore, loads: dict[str, int], owner: dict[str, str]):
        self.store = store
        self.loads = loads
        self.owner = owner
        self.moves: list[tuple[str, str, str]] = []

    async def publish(self) -> None:
        for broker in sorted(set(self.owner.values()) | {"127.0.0.1:1", "127.0.0.1:2"}):
            mine = {x: self.loads[x] for x in self.owner if self.owner[x] == broker}
            report = {
                "url": f"pigeon://{broker}",
                "address": broker,
                "topics": sum(mine.values()),
                "bundles": {f"t/n/{x}": {"topics": n, "bytes_rate": 0.0} for x, n in mine.items()},
            }
            path = f"{BROKERS_PATH}/{broker}"
            if await self.store.exists(path):
                await self.store.set(path, json.dumps(report).encode())
            else:
                await self.store.create(path, json.dumps(report).encode())
        for bundle, broker in self.owner.items():
            path = f"{OWNERSHIP_PATH}/t/n/{bundle}"
            value = json.dumps({"url": f"pigeon://{broker}", "address": broker}).encode()
            if await self.store.exists(path):
                await self.store.set(path, value)
            else:
                await self.store.create(path, value)

    async def carry_out_requests(self) -> None:
        for broker in await self.store.children(UNLOAD_REQUESTS_PATH):
            for name in await self.store.children(f"{UNLOAD_REQUESTS_PATH}/{broker}"):
                path = f"{UNLOAD_REQUESTS_PATH}/{broker}/{name}"
                stat = await self.store.get(path)
                assert stat is not None
                bundle = json.loads(stat.value)["bundle"]
                await self.store.delete(path)
                if self.owner.get(bundle) != broker:
                    continue
                others = {b for b in ("127.0.0.1:1", "127.0.0.1:2") if b != broker}
                target = min(
                    others,
                    key=lambda b: sum(self.loads[x] for x in self.owner if self.owner[x] == b),
                )
                self.owner[bundle] = target
                self.moves.append((bundle, broker, target))


async def test_two_brokers_do_not_pass_a_bundle_back_and_forth(tmp_path: Path) -> None:
    async with embedded(tmp_path) as store:
        # broker 1 serves 3 topics in two bundles, broker 2 one topic
        loads = {"0x00000000_0x40000000": 2, "0x40000000_0x80000000": 1, "0x80000000_0xc0000000": 1}
        owner = {
            "0x00000000_0x40000000": "127.0.0.1:1",
            "0x40000000_0x80000000": "127.0.0.1:1",
            "0x80000000_0xc0000000": "127.0.0.1:2",
        }
        cluster = Cluster(store, loads, owner)
        ownership = Ownership(store, "pigeon://127.0.0.1:1", "127.0.0.1:1")
        service = SimpleNamespace(store=store, ownership=ownership, service_url="pigeon://x")
        manager = LoadManager(service, grace_period_minutes=0)  # no grace: hysteresis alone
        for _ in range(8):
            await cluster.publish()
            await manager.balance_once()
            await cluster.carry_out_requests()
        assert cluster.moves == [("0x40000000_0x80000000", "127.0.0.1:1", "127.0.0.1:2")]


class FakeTopic(SimpleNamespace):  # its bytes in are its ledger's, as a Topic's are
    bytes_in = property(lambda self: self.ledger.bytes_in)


async def test_each_broker_reports_its_bundles_with_their_traffic(tmp_path: Path) -> None:
    async with embedded(tmp_path) as store:
        ownership = Ownership(store, "pigeon://127.0.0.1:1", "127.0.0.1:1", bundles_per_namespace=2)
        names = [TopicName.parse(f"persistent://t/n/topic-{i}") for i in range(6)]
        ledgers = {str(n): SimpleNamespace(bytes_in=0) for n in names}
        topics = {str(n): FakeTopic(name=n, persistent=True, ledger=ledgers[str(n)]) for n in names}
        service = SimpleNamespace(store=store, ownership=ownership, topics=topics)
        manager = LoadManager(service)
        first = manager.bundle_report()
        bundles = {ownership.bundle_of(n) for n in names}
        assert {key.rsplit("/", 1)[1] for key in first} == bundles
        assert sum(entry["topics"] for entry in first.values()) == 6
        assert all(entry["bytes_rate"] == 0 for entry in first.values())
        await trio.sleep(0.2)
        ledgers[str(names[0])].bytes_in = 1_000_000
        second = manager.bundle_report()
        busy = f"t/n/{ownership.bundle_of(names[0])}"
        assert second[busy]["bytes_rate"] > 1_000_000  # a rate over the last ~0.2 s
        assert all(e["bytes_rate"] == 0 for k, e in second.items() if k != busy)
        # it rides along in the registration, for the leader to read
        ownership.report_sections["bundles"] = manager.bundle_report
        await ownership.register()
        report = (await ownership.brokers())["127.0.0.1:1"]
        assert report["bundles"].keys() == second.keys()

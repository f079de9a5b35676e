"""ManagedLedger's write lifecycle against a scripted replication policy and an
in-memory metadata store: failed writers, recovery, shrinking ensembles, bookies coming
back, metadata hiccups and a takeover by another broker.

What a user would notice is checked: every append is answered exactly once; every
success is really in the log (read back), at the offset it was given; offsets are dense;
and the ledger recovers by itself.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from pigeon.broker._ledger import ManagedLedger
from pigeon.core import TopicName
from pigeon.core._entry import unpack_entry_header
from pigeon.core._replication import PolicyBase
from pigeon.core.errors import (
    BadVersion,
    ConnectionClosed,
    MetadataError,
    NodeExists,
    NoSuchNode,
    NotEnoughBookies,
    NotOwner,
    PigeonError,
    StorageError,
)
from pigeon.core.paths import segment_path

# ------------------------------------------------------------------ fakes


@dataclass
class _Stat:
    value: bytes
    version: int


class MemoryStore:
    """The parts of the metadata store a ledger uses, with injectable failures."""

    def __init__(self) -> None:
        self.nodes: dict[str, _Stat] = {}
        self.seq = itertools.count()
        self.fail_sets = 0

    async def get(self, path: str) -> _Stat | None:
        await trio.lowlevel.checkpoint()
        return self.nodes.get(path)

    async def create(self, path: str, value: bytes, *, sequential: bool = False) -> str:
        await trio.lowlevel.checkpoint()
        if sequential:
            path = f"{path}{next(self.seq):010d}"
        if path in self.nodes:
            raise NodeExists(path)
        self.nodes[path] = _Stat(value, 0)
        return path

    async def set(self, path: str, value: bytes, *, version: int = -1) -> int:
        await trio.lowlevel.checkpoint()
        if self.fail_sets:
            self.fail_sets -= 1
            raise MetadataError("metadata server unreachable")
        stat = self.nodes.get(path)
        if stat is None:
            raise NoSuchNode(path)
        if version not in (-1, stat.version):
            raise BadVersion(path)
        self.nodes[path] = _Stat(value, stat.version + 1)
        return stat.version + 1

    async def delete(self, path: str, *, version: int = -1) -> None:
        self.nodes.pop(path, None)


class FakeClient:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    async def connection(self, address: str) -> object:
        await trio.lowlevel.checkpoint()
        if address in self.cluster.dead:
            raise ConnectionClosed(f"cannot connect to {address}")
        return object()


class Cluster:
    """Bookies (by address) that are up or dead, and what each segment holds."""

    def __init__(self, bookies: list[str]) -> None:
        self.registered = list(bookies)
        self.dead: set[str] = set()
        self.segments: dict[int, dict[int, bytes]] = {}
        self.writers: list[ScriptedWriter] = []

    def bookies(self) -> list[str]:
        return list(self.registered)


class ScriptedWriter:
    """A segment writer whose adds complete only when the test says so."""

    def __init__(self, cluster: Cluster, segment_id: int, ensemble: list[str], qw: int) -> None:
        self.cluster = cluster
        self.segment_id = segment_id
        self.ensemble = ensemble
        self.write_quorum = qw
        self.flights: dict[int, tuple[bytes, Callable[[int, Any], None]]] = {}
        self.next_entry_id = 0
        self.bytes_written = 0
        self.lac = -1
        self.failed: BaseException | None = None
        self.closed = False
        self._idle = trio.Event()
        self._idle.set()
        cluster.segments[segment_id] = {}

    @property
    def pending(self) -> int:
        return len(self.flights)

    def add_nowait(self, data: bytes, callback: Callable[[int, Any], None]) -> int:
        if self.failed is not None:
            raise self.failed
        eid = self.next_entry_id
        self.next_entry_id += 1
        self.flights[eid] = (bytes(data), callback)
        self.bytes_written += len(data)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        return eid

    def store(self, upto: int, *, ack: bool = True) -> None:
        """Entries up to ``upto`` reach the bookies; acknowledged in order if ``ack``."""
        for eid in sorted(self.flights):
            if eid > upto:
                break
            self.cluster.segments[self.segment_id][eid] = self.flights[eid][0]
            if ack:
                _data, cb = self.flights.pop(eid)
                self.lac = eid
                cb(eid, None)
        if not self.flights:
            self._idle.set()

    def fail(self, error: BaseException) -> None:
        self.failed = error
        flights, self.flights = self.flights, {}
        self._idle.set()
        for eid in sorted(flights):
            flights[eid][1](eid, error)

    def abort(self, error: BaseException) -> None:
        self.closed = True
        self.fail(error)

    def close(self) -> None:
        self.closed = True

    async def wait_idle(self) -> None:
        await self._idle.wait()


class ScriptedPolicy(PolicyBase):
    name = "scripted"

    def __init__(self, cluster: Cluster, e: int = 3, qw: int = 2, qa: int = 2) -> None:
        super().__init__(FakeClient(cluster), ensemble_size=e, write_quorum=qw, ack_quorum=qa)  # type: ignore[arg-type]
        self.cluster = cluster
        self.created: list[tuple[list[str], int, int]] = []

    async def create_writer(self, segment_id: int, ensemble: Any, **kw: Any) -> ScriptedWriter:
        await trio.lowlevel.checkpoint()
        for address in ensemble:
            if address in self.cluster.dead:
                raise ConnectionClosed(f"cannot connect to bookie {address}")
        self.created.append((list(ensemble), kw["write_quorum"], kw["ack_quorum"]))
        writer = ScriptedWriter(self.cluster, segment_id, list(ensemble), kw["write_quorum"])
        self.cluster.writers.append(writer)
        return writer

    async def recover(self, segment_id: int, ensemble: Any, **kw: Any) -> int:
        await trio.lowlevel.checkpoint()
        held = self.cluster.segments.get(segment_id, {})
        last = -1
        while last + 1 in held:
            last += 1
        return last

    async def read(self, segment_id: int, ensemble: Any, first: int, last: int, **kw: Any):  # type: ignore[no-untyped-def]
        await trio.lowlevel.checkpoint()
        held = self.cluster.segments[segment_id]
        return [(e, held[e]) for e in range(first, last + 1) if e in held]


class Results:
    def __init__(self) -> None:
        self.answers: dict[int, list[tuple[Any, Any]]] = {}

    def callback(self, i: int) -> Callable[[Any, Any], None]:
        def cb(result: Any, error: Any) -> None:
            self.answers.setdefault(i, []).append((result, error))

        return cb

    def ok(self) -> dict[int, tuple[int, int, int]]:
        return {i: a[0][0] for i, a in self.answers.items() if a[0][1] is None}

    def errors(self) -> dict[int, BaseException]:
        return {i: a[0][1] for i, a in self.answers.items() if a[0][1] is not None}

    def check_once(self) -> None:
        for i, a in self.answers.items():
            assert len(a) == 1, f"append {i} answered {len(a)} times: {a}"


async def _ledger(
    nursery: trio.Nursery, cluster: Cluster, policy: ScriptedPolicy, store: MemoryStore
) -> ManagedLedger:
    ledger = ManagedLedger(
        TopicName.parse("t"),
        store=store,
        policy=policy,
        bookies=cluster.bookies,
        nursery=nursery,
    )
    await ledger.open()
    return ledger


async def _log(ledger: ManagedLedger) -> list[tuple[int, int]]:
    """(first offset, message count) of every entry in the ledger, in order."""
    out = []
    pos: tuple[int, int] | None = ledger.start_position()
    while pos is not None:
        entries = await ledger.read(pos, max_entries=100)
        if not entries:
            break
        for e in entries:
            h = unpack_entry_header(e.data)
            out.append((h.first_offset, h.num_messages))
        pos = ledger.next_position(entries[-1].position)
    return out


async def _settle() -> None:
    for _ in range(50):
        await trio.sleep(0.01)


def _append(ledger: ManagedLedger, results: Results, i: int, n: int = 2) -> None:
    ledger.append_nowait(f"batch-{i}".encode(), n, results.callback(i))


# ------------------------------------------------------------------ tests


async def test_a_failed_writer_loses_nothing_and_keeps_offsets_dense(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = Cluster(["b1", "b2", "b3"])
    policy = ScriptedPolicy(cluster)
    store = MemoryStore()
    results = Results()
    async with trio.open_nursery() as nursery:
        ledger = await _ledger(nursery, cluster, policy, store)
        for i in range(5):
            _append(ledger, results, i)
        w1 = cluster.writers[-1]
        w1.store(1)  # 0, 1 acknowledged
        w1.store(2, ack=False)  # 2 reached the bookies, its ack did not come back
        w1.fail(StorageError("bookie b2 died"))
        await _settle()
        assert len(cluster.writers) == 2, "no new segment after the writer failed"
        cluster.writers[-1].store(10)
        await _settle()
        results.check_once()
        assert results.errors() == {}
        offsets = [results.ok()[i][2] for i in range(5)]
        assert offsets == [0, 2, 4, 6, 8]
        assert await _log(ledger) == [(o, 2) for o in offsets]
        assert ledger.next_offset == 10
        nursery.cancel_scope.cancel()


async def test_one_bookie_down_of_three_shrinks_the_ensemble_and_writes_go_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = Cluster(["b1", "b2", "b3"])
    policy = ScriptedPolicy(cluster)
    store = MemoryStore()
    results = Results()
    async with trio.open_nursery() as nursery:
        ledger = await _ledger(nursery, cluster, policy, store)
        _append(ledger, results, 0)
        cluster.writers[-1].store(0)
        # b3 dies, still registered (its session has not expired)
        cluster.dead.add("b3")
        _append(ledger, results, 1)
        cluster.writers[-1].fail(ConnectionClosed("b3 is gone"))
        await _settle()
        ensemble, qw, qa = policy.created[-1]
        assert sorted(ensemble) == ["b1", "b2"] and (qw, qa) == (2, 2)
        cluster.writers[-1].store(10)
        _append(ledger, results, 2)
        cluster.writers[-1].store(10)
        await _settle()
        results.check_once()
        assert results.errors() == {}
        assert [o for o, _n in await _log(ledger)] == [0, 2, 4]
        # b3 back: after its quarantine, a new segment has the full ensemble again
        cluster.dead.discard("b3")
        await trio.sleep(10)
        ledger._start_roll()
        await _settle()
        assert sorted(policy.created[-1][0]) == ["b1", "b2", "b3"]
        nursery.cancel_scope.cancel()


async def test_too_few_bookies_fail_with_a_retriable_error_and_writes_resume(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = Cluster(["b1", "b2", "b3"])
    policy = ScriptedPolicy(cluster)
    store = MemoryStore()
    results = Results()
    async with trio.open_nursery() as nursery:
        ledger = await _ledger(nursery, cluster, policy, store)
        _append(ledger, results, 0)
        cluster.writers[-1].store(0)
        cluster.dead |= {"b2", "b3"}
        cluster.registered = ["b1", "b2", "b3"]
        _append(ledger, results, 1)
        _append(ledger, results, 2)
        cluster.writers[-1].fail(ConnectionClosed("b2 and b3 are gone"))
        await _settle()
        errors = results.errors()
        assert set(errors) == {1, 2}
        assert all(isinstance(e, PigeonError) and e.retriable for e in errors.values())
        with pytest.raises(NotEnoughBookies):
            _append(ledger, results, 3)
        assert ledger.next_offset == 2, "failed appends must not keep their offsets"
        # the bookies return: the ledger is writable again without anyone's help
        cluster.dead.clear()
        with trio.fail_after(30):
            while ledger.unavailable is not None:  # noqa: ASYNC110
                await trio.sleep(0.1)
        _append(ledger, results, 4)
        cluster.writers[-1].store(10)
        await _settle()
        results.check_once()
        assert results.ok()[4][2] == 2
        assert [o for o, _n in await _log(ledger)] == [0, 2]
        nursery.cancel_scope.cancel()


async def test_a_rollover_that_fails_on_metadata_is_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = Cluster(["b1", "b2", "b3"])
    policy = ScriptedPolicy(cluster)
    store = MemoryStore()
    results = Results()
    async with trio.open_nursery() as nursery:
        ledger = await _ledger(nursery, cluster, policy, store)
        _append(ledger, results, 0)
        store.fail_sets = 4  # the metadata server is away for a while
        cluster.writers[-1].fail(StorageError("bookie failed"))
        _append(ledger, results, 1)  # queued while rolling
        await trio.sleep(20)
        cluster.writers[-1].store(10)
        await _settle()
        results.check_once()
        assert results.errors() == {}
        assert [o for o, _n in await _log(ledger)] == [0, 2]
        nursery.cancel_scope.cancel()


async def test_a_ledger_taken_over_by_another_broker_fails_pending_appends_retriably(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = Cluster(["b1", "b2", "b3"])
    policy = ScriptedPolicy(cluster)
    store = MemoryStore()
    results = Results()
    fenced: list[bool] = []
    async with trio.open_nursery() as nursery:
        ledger = await _ledger(nursery, cluster, policy, store)
        ledger.on_fenced = lambda: fenced.append(True)
        _append(ledger, results, 0)
        # another broker recovers and closes our segment, and appends one of its own
        doc = json.loads(store.nodes[ledger.path].value)
        doc["segments"][-1]["state"] = "closed"
        doc["segments"].append(dict(doc["segments"][-1], id=999))
        await store.set(ledger.path, json.dumps(doc).encode())
        cluster.writers[-1].fail(StorageError("segment fenced"))
        await _settle()
        results.check_once()
        assert isinstance(results.errors()[0], NotOwner)
        assert fenced == [True]
        with pytest.raises(PigeonError):
            _append(ledger, results, 1)
        nursery.cancel_scope.cancel()


async def test_close_with_writes_that_do_not_drain_leaves_the_segment_for_recovery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = Cluster(["b1", "b2", "b3"])
    policy = ScriptedPolicy(cluster)
    store = MemoryStore()
    results = Results()
    async with trio.open_nursery() as nursery:
        ledger = await _ledger(nursery, cluster, policy, store)
        _append(ledger, results, 0)
        _append(ledger, results, 1)
        cluster.writers[-1].store(0)
        cluster.writers[-1].store(1, ack=False)  # stored, never acknowledged
        await ledger.close()
        results.check_once()
        assert set(results.errors()) == {1}
        doc = json.loads(store.nodes[ledger.path].value)
        assert doc["segments"][-1]["state"] == "open", "the next owner must recover it"
        # the next owner finds entry 1 (stored although its append failed here)
        other = await _ledger(nursery, cluster, policy, store)
        assert [o for o, _n in await _log(other)] == [0, 2]
        assert other.next_offset == 4
        nursery.cancel_scope.cancel()


async def test_an_empty_segment_dropped_on_open_leaves_no_metadata_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A segment opened and never written (its owner died) is dropped when the ledger is
    opened again; its ``/pigeon/segments`` node went with it, or the bookies' garbage
    collector, which removes segments whose node is gone, would keep its files forever."""
    cluster = Cluster(["b1", "b2", "b3"])
    policy = ScriptedPolicy(cluster)
    store = MemoryStore()
    results = Results()
    async with trio.open_nursery() as nursery:
        first = await _ledger(nursery, cluster, policy, store)
        _append(first, results, 0)
        cluster.writers[-1].store(0)
        first._start_roll()  # a new, empty tail segment
        await _settle()
        empty = first.segments[-1].id
        assert segment_path(empty) in store.nodes
        # the owner dies; another opens the ledger
        second = await _ledger(nursery, cluster, policy, store)
        assert empty not in [s.id for s in second.segments]
        assert segment_path(empty) not in store.nodes
        assert [o for o, _n in await _log(second)] == [0]
        nursery.cancel_scope.cancel()


async def test_every_stored_append_is_timed_and_failed_ones_are_not(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The ledger measures its own publish latency (accepted to stored), from its first
    append on; the metrics endpoint only exports it."""
    cluster = Cluster(["b1", "b2", "b3"])
    policy = ScriptedPolicy(cluster)
    store = MemoryStore()
    results = Results()
    async with trio.open_nursery() as nursery:
        ledger = await _ledger(nursery, cluster, policy, store)
        for i in range(3):
            _append(ledger, results, i)
        cluster.writers[-1].store(1)
        assert ledger.publish_latency.count == 2
        cluster.dead.update({"b1", "b2", "b3"})
        cluster.writers[-1].fail(ConnectionClosed("every bookie is gone"))
        await _settle()
        assert results.errors(), "the append in flight fails when no bookie is left"
        assert ledger.publish_latency.count == 2
        assert ledger.publish_latency.sum >= 0
        nursery.cancel_scope.cancel()

"""A ManagedLedger's world in memory, for the ledger tests (``test_ledger_*.py``).

Bookies that are up or dead (:class:`Cluster`), a replication policy whose writers
complete an append only when the test says so (:class:`ScriptedPolicy`,
:class:`ScriptedWriter`), a metadata store with injectable failures (:class:`MemoryStore`;
:class:`ListingStore` also lists children), and a record of every append's answers
(:class:`Results`).  :func:`ledger_world` puts them together with a nursery:

    async with ledger_world() as world:
        ledger = await world.open()
        world.append(ledger, 0)
        world.writer.store(0)
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from pigeon.broker._ledger import LedgerConfig, ManagedLedger
from pigeon.core import TopicName
from pigeon.core._entry import ENTRY_HEADER_SIZE, unpack_entry_header
from pigeon.core.errors import (
    BadVersion,
    ConnectionClosed,
    MetadataError,
    NodeExists,
    NoSuchNode,
)
from pigeon.core.replication import PolicyBase, WriterBase

BOOKIES = ("b1", "b2", "b3")


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


class ScriptedWriter(WriterBase):
    """A segment writer whose adds complete only when the test says so (or it is told to
    :meth:`fail`); closing, aborting and waiting are :class:`WriterBase`'s."""

    def __init__(self, cluster: Cluster, segment_id: int, ensemble: list[str], qw: int) -> None:
        super().__init__()
        self.cluster = cluster
        self.segment_id = segment_id
        self.ensemble = ensemble
        self.write_quorum = qw
        #: entry id -> (data, callback) of the entries not yet acknowledged
        self.flights: dict[int, tuple[bytes, Callable[[int, Any], None]]] = self._in_flight
        self.next_entry_id = 0
        self.bytes_written = 0
        self.lac = -1
        cluster.segments[segment_id] = {}

    def add_nowait(self, data: bytes, callback: Callable[[int, Any], None]) -> int:
        if self.failed is not None:
            raise self.failed
        eid = self.next_entry_id
        self.next_entry_id += 1
        self.flights[eid] = (bytes(data), callback)
        self.bytes_written += len(data)
        self._busy()
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
        """Every entry in flight fails with ``error``, in order, and so does every later add."""
        self._failed = error
        flights = dict(self.flights)
        self.flights.clear()
        self._idle.set()
        for eid in sorted(flights):
            flights[eid][1](eid, error)

    _fail = fail


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


class ListingStore(MemoryStore):
    """A :class:`MemoryStore` that also lists children (the ledger then honours the
    subscriptions' cursors when it trims)."""

    async def children(self, path: str) -> list[str]:
        await trio.lowlevel.checkpoint()
        prefix = path.rstrip("/") + "/"
        return sorted(
            {p[len(prefix) :].split("/", 1)[0] for p in self.nodes if p.startswith(prefix)}
        )


# ------------------------------------------------------------------ reading the log


async def log_entries(ledger: ManagedLedger) -> list[tuple[int, int, int, int, bytes]]:
    """(segment, entry, first offset, count, payload) of every entry, in log order."""
    out = []
    pos: tuple[int, int] | None = ledger.start_position()
    while pos is not None:
        entries = await ledger.read(pos, max_entries=100)
        if not entries:
            break
        for e in entries:
            h = unpack_entry_header(e.data)
            payload = bytes(e.data)[ENTRY_HEADER_SIZE:]
            out.append((e.segment_id, e.entry_id, h.first_offset, h.num_messages, payload))
        pos = ledger.next_position(entries[-1].position)
    return out


async def log(ledger: ManagedLedger) -> list[tuple[int, int]]:
    """(first offset, message count) of every entry in the ledger, in order."""
    return [(first, count) for _s, _e, first, count, _p in await log_entries(ledger)]


async def log_offsets(ledger: ManagedLedger) -> list[int]:
    """The first offset of every entry in the ledger, in order."""
    return [first for first, _count in await log(ledger)]


async def settle() -> None:
    """Half a (virtual) second of checkpoints: what the test set off has run."""
    for _ in range(50):
        await trio.sleep(0.01)


# ------------------------------------------------------------------ the world


async def open_ledger(
    nursery: trio.Nursery,
    store: MemoryStore,
    policy: ScriptedPolicy,
    bookies: Callable[[], list[str]],
    config: LedgerConfig | None = None,
) -> ManagedLedger:
    """ManagedLedger ``t`` over ``store`` and ``policy``, opened."""
    ledger = ManagedLedger(
        TopicName.parse("t"),
        store=store,
        policy=policy,
        bookies=bookies,
        nursery=nursery,
        config=config,
    )
    await ledger.open()
    return ledger


@dataclass
class LedgerWorld:
    """Bookies, a policy over them and a metadata store, shared by every ledger a test
    opens on them (an owner and the next one); ``results`` records appends' answers."""

    nursery: trio.Nursery
    cluster: Cluster
    policy: ScriptedPolicy
    store: MemoryStore
    results: Results
    config: LedgerConfig | None = None

    async def open(
        self, nursery: trio.Nursery | None = None, config: LedgerConfig | None = None
    ) -> ManagedLedger:
        """A ledger on this world, as a broker taking the topic opens it."""
        return await open_ledger(
            nursery or self.nursery,
            self.store,
            self.policy,
            self.cluster.bookies,
            config or self.config,
        )

    def append(self, ledger: ManagedLedger, i: int, n: int = 2) -> None:
        """Append number ``i`` (``n`` messages); its answers go to ``results``."""
        ledger.append_nowait(f"batch-{i}".encode(), n, self.results.callback(i))

    @property
    def writer(self) -> ScriptedWriter:
        """The latest segment writer the policy made."""
        return self.cluster.writers[-1]


@asynccontextmanager
async def ledger_world(
    policy: type[ScriptedPolicy] | None = None,
    *,
    bookies: Sequence[str] = BOOKIES,
    store: type[MemoryStore] | None = None,
    config: LedgerConfig | None = None,
) -> AsyncIterator[LedgerWorld]:
    """A :class:`LedgerWorld` with its own nursery, cancelled when the block ends."""
    cluster = Cluster(list(bookies))
    async with trio.open_nursery() as nursery:
        yield LedgerWorld(
            nursery,
            cluster,
            (policy or ScriptedPolicy)(cluster),
            (store or MemoryStore)(),
            Results(),
            config,
        )
        nursery.cancel_scope.cancel()

"""The smallest backend on pigeon.core.metadata's planner, for the tests of this folder.

:class:`TreePlanner` plans on a snapshot of plain records and emits neutral effects;
:class:`MemoryServer` is a transactional server in memory (commit = check the conditions
the plan relied on, apply its effects, tell the watchers); :class:`MemoryStore` is a
:class:`~pigeon.core.metadata.TransactionalMetadataStore` on it with nothing but the
hooks, so the contract suite exercises the shared planner and front end without I/O.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from pigeon.core.errors import MetadataError, SessionExpired
from pigeon.core.metadata import (
    EventType,
    NeedRead,
    Planner,
    Snapshot,
    StaleRead,
    Stat,
    StoreLifecycle,
    TransactionalMetadataStore,
    Watcher,
    WatchEvent,
    WatchHub,
    WriteOp,
    parent_path,
    validate_path,
)


@dataclass(frozen=True)
class Node:
    exists: bool
    version: int = 0
    ephemeral: bool = False


ABSENT = Node(False)


@dataclass
class TreeSnapshot(Snapshot[Node]):
    counters: dict[str, int] = field(default_factory=dict)  # parent → next number
    children: dict[str, int] = field(default_factory=dict)  # path → number of children


class TreePlanner(Planner[Node]):
    """Emits ``effects`` (``create``/``number``/``set``/``delete``/``check`` tuples) and
    records what it relied on: ``relied`` (node reads, in order) and ``conditions``."""

    def __init__(self, snapshot: TreeSnapshot, *, session: bool = True) -> None:
        super().__init__(snapshot, session=session)
        self.snap = snapshot
        self.counters: dict[str, int] = {}
        self.child_delta: dict[str, int] = {}
        self.created: set[str] = set()
        self.effects: list[tuple[Any, ...]] = []
        self.relied: list[str] = []
        #: (kind, key) → the value read: ("node", path), ("counter", parent), ("children", path)
        self.conditions: dict[tuple[str, str], object] = {}

    def relied_on(self, path: str, info: Node) -> Node:
        self.relied.append(path)
        self.conditions[("node", path)] = info
        return info

    def next_number(self, parent: str) -> int:
        if parent in self.counters:
            return self.counters[parent]
        if parent not in self.snap.counters:
            raise NeedRead(counters={parent})
        self.conditions[("counter", parent)] = self.snap.counters[parent]
        return self.snap.counters[parent]

    def has_children(self, path: str, info: Node) -> bool:
        if path in self.created:  # created by this plan: only its own children
            return self.child_delta.get(path, 0) > 0
        if path not in self.snap.children:
            raise NeedRead(children={path})
        self.conditions[("children", path)] = self.snap.children[path]
        return self.snap.children[path] + self.child_delta.get(path, 0) > 0

    def _children_changed(self, path: str, delta: int) -> None:
        parent = parent_path(path)
        self.child_delta[parent] = self.child_delta.get(parent, 0) + delta

    def emit_create(self, path: str, value: bytes, *, ephemeral: bool) -> Node:
        self.effects.append(("create", path, value, ephemeral))
        self._children_changed(path, +1)
        self.created.add(path)
        return Node(True, 0, ephemeral)

    def emit_number(self, parent: str, number: int) -> None:
        self.effects.append(("number", parent, number))
        self.counters[parent] = number + 1

    def emit_set(self, path: str, info: Node, value: bytes) -> Node:
        self.effects.append(("set", path, value))
        return Node(True, info.version + 1, info.ephemeral)

    def emit_delete(self, path: str, info: Node, *, recursive: bool) -> Node:
        self.effects.append(("delete", path, recursive))
        self._children_changed(path, -1)
        self.counters[path] = 0
        return ABSENT

    def emit_check(self, path: str, info: Node) -> None:
        self.effects.append(("check", path, info.version))


@dataclass
class Record:
    value: bytes
    version: int
    session: str | None
    ctime: float
    mtime: float


@dataclass
class MemoryPlan:
    conditions: dict[tuple[str, str], object]
    effects: list[tuple[Any, ...]]
    results: list[object]


class MemoryServer:
    """Nodes, counters and sessions of stores that share them; one commit at a time."""

    def __init__(self) -> None:
        self.nodes: dict[str, Record] = {"/": Record(b"", 0, None, 0.0, 0.0)}
        self.counters: dict[str, int] = {}
        self.sessions: dict[str, Callable[[], None]] = {}  # live session → on_expired
        self.hubs: list[WatchHub] = []
        self.commits = 0
        #: called before each commit's conditions are checked (tests race writers here)
        self.before_commit: Callable[[], None] | None = None

    def children(self, path: str) -> list[str]:
        prefix = "/" if path == "/" else path + "/"
        return sorted(
            p[len(prefix) :]
            for p in self.nodes
            if p != "/" and p.startswith(prefix) and "/" not in p[len(prefix) :]
        )

    def read_node(self, path: str) -> Node:
        record = self.nodes.get(path)
        if record is None:
            return ABSENT
        return Node(True, record.version, record.session is not None)

    def _dispatch(self, events: list[WatchEvent]) -> None:
        for hub in self.hubs:
            for event in events:
                hub.dispatch(event)

    def commit(self, plan: MemoryPlan, session: str | None) -> bool:
        if self.before_commit is not None:
            self.before_commit()
        for (kind, key), value in plan.conditions.items():
            if kind == "node":
                current: object = self.read_node(key)
            elif kind == "counter":
                current = self.counters.get(key, 0)
            else:
                current = len(self.children(key))
            if current != value:
                return False
        if any(e[0] == "create" and e[3] for e in plan.effects) and session not in self.sessions:
            raise SessionExpired("the memory session expired")
        now = time.time()
        events: list[WatchEvent] = []
        for effect in plan.effects:
            kind, path = effect[0], effect[1]
            if kind == "create":
                owner = session if effect[3] else None
                self.nodes[path] = Record(effect[2], 0, owner, now, now)
                events.append(WatchEvent(EventType.CREATED, path, effect[2], 0))
            elif kind == "number":
                self.counters[path] = effect[2] + 1
            elif kind == "set":
                record = self.nodes[path]
                record.value, record.version, record.mtime = effect[2], record.version + 1, now
                events.append(WatchEvent(EventType.CHANGED, path, effect[2], record.version))
            elif kind == "delete":
                events += self._remove_tree(path)
        self.commits += 1
        self._dispatch(events)
        return True

    def _remove_tree(self, path: str) -> list[WatchEvent]:
        below = sorted((p for p in self.nodes if p.startswith(path + "/")), reverse=True)
        events = []
        for p in [*below, path]:
            record = self.nodes.pop(p)
            events.append(WatchEvent(EventType.DELETED, p, None, record.version))
        for p in [p for p in self.counters if p == path or p.startswith(path + "/")]:
            del self.counters[p]
        return events

    def start_session(self, on_expired: Callable[[], None]) -> str:
        sid = uuid.uuid4().hex
        self.sessions[sid] = on_expired
        return sid

    def end_session(self, sid: str) -> None:
        on_expired = self.sessions.pop(sid, None)
        if on_expired is None:
            return
        events = []
        for path in sorted((p for p, r in self.nodes.items() if r.session == sid), reverse=True):
            events += self._remove_tree(path)
        self._dispatch(events)
        on_expired()


class MemoryStore(StoreLifecycle, TransactionalMetadataStore[TreeSnapshot, MemoryPlan]):
    """A store on a :class:`MemoryServer`: the transactional hooks, sessions, watches."""

    session_timeout = 10.0

    def __init__(self, server: MemoryServer) -> None:
        self.server = server
        self._sid: str | None = None
        self._init_lifecycle()
        self._hub = WatchHub(self.watch_buffer)
        self.reads = 0

    # --- lifecycle and sessions ------------------------------------------------------------

    def _running(self) -> bool:
        return self._hub in self.server.hubs

    async def _open(self) -> None:
        self.server.hubs.append(self._hub)
        await self.new_session()

    def _background(self) -> Sequence[Callable[[], Awaitable[None]]]:
        return [trio.sleep_forever]

    async def _close(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._sid is not None:
            self.server.end_session(self._sid)
        if self._running():
            self.server.hubs.remove(self._hub)
        self._hub.fail_all("metadata store closed")

    @property
    def session_id(self) -> str | None:
        return self._sid if self._session_alive else None

    async def new_session(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._sid is not None:
            self.server.end_session(self._sid)
        self._sid = self.server.start_session(self._mark_session_ended)
        self._session_started()

    async def expire_session(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._sid is not None:
            self.server.end_session(self._sid)

    # --- reads ---------------------------------------------------------------------------------

    def _require(self) -> None:
        if not self._running():
            raise MetadataError(f"{self!r} is not running")

    async def get(self, path: str) -> Stat | None:
        validate_path(path)
        self._require()
        await trio.lowlevel.checkpoint()
        record = self.server.nodes.get(path)
        if record is None:
            return None
        ephemeral = record.session is not None
        return Stat(record.value, record.version, ephemeral, record.ctime, record.mtime)

    async def children(self, path: str) -> list[str]:
        validate_path(path)
        self._require()
        await trio.lowlevel.checkpoint()
        return self.server.children(path)

    @asynccontextmanager
    async def _watch(self, path: str, prefix: bool) -> AsyncIterator[Watcher]:
        await trio.lowlevel.checkpoint()
        self._require()
        watcher = self._hub.subscribe(path, prefix=prefix)
        try:
            yield watcher
        finally:
            self._hub.unsubscribe(watcher)

    # --- the transactional hooks -------------------------------------------------------------

    def _new_snapshot(self) -> TreeSnapshot:
        return TreeSnapshot()

    async def _read(self, need: NeedRead, snapshot: TreeSnapshot) -> None:
        await trio.lowlevel.checkpoint()  # a round trip: other writers may come between
        self.reads += 1
        for path in need.nodes:
            snapshot.nodes[path] = self.server.read_node(path)
        for path in need.counters:
            snapshot.counters[path] = self.server.counters.get(path, 0)
        for path in need.children:
            snapshot.children[path] = len(self.server.children(path))

    def _plan(self, ops: Sequence[WriteOp], snapshot: TreeSnapshot) -> MemoryPlan:
        planner = TreePlanner(snapshot, session=self.session_alive)
        results = planner.plan(ops)
        return MemoryPlan(planner.conditions, planner.effects, results)

    async def _commit_plan(self, ops: Sequence[WriteOp], plan: MemoryPlan) -> list[object]:
        await trio.lowlevel.checkpoint()
        if not self.server.commit(plan, self._sid if self.session_alive else None):
            raise StaleRead("a condition failed")
        return plan.results

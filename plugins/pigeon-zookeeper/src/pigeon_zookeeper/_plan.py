"""How a metadata write becomes one ZooKeeper multi (no I/O here).

Layout under the chroot ``C`` (all persistent unless noted)::

    C/tree/...                 the user's tree: node /a/b is znode C/tree/a/b
    C/log                      data: current log bucket number (ASCII); version: bumped
                               when the bucket changes
    C/log/<bucket:010d>/e-<n>  change log, one znode per write (ZooKeeper sequential)
    C/seq/<quoted parent>      sequential-child counter of a parent: the last number handed
                               out is its znode version (created at 0, +1 per use)
    C/sessions/<sid>           one per registered ZooKeeper session (sid: 16 hex digits)
    C/sessions/<sid>/<quoted path>  index of that session's ephemeral nodes
    C/alive/<sid>              ephemeral: the session is alive

Why a change log: ZooKeeper watches are one-shot and carry no data, so a watcher that
re-reads a node after a notification sees its *latest* value and misses intermediate
ones.  The contract wants every change with its value, in commit order.  So every write
is one multi that also appends a log entry listing the events it causes; watchers read
the log in order (see ``_store.py``).  Nodes deleted by ZooKeeper itself when a session
expires are logged afterwards by a *reaper* (any live store) from the session's index.

Why our own sequential counter: the log entry and the session index must name the
created node, which a ZooKeeper sequential create only names after commit.  The counter
znode's version is the last number handed out; the multi bumps it with a version check, so numbers
are unique, only grow, and restart when the parent is deleted (its counter goes too).

The contract's semantics are :class:`pigeon.core.metadata.Planner`'s; this module only
emits ZooKeeper ops for them.  A multi checks what the plan read by itself: a ``set`` or
``delete`` carries the version it read, a ``create`` fails if the node exists or its
parent does not, a ``check`` guards a node the plan only looked at.  If anything changed
meanwhile the multi fails and the caller reads again and re-plans.

Log entry format (big-endian)::

    b"PGL1" | u32 count | count x event
    event = u8 kind (1 created, 2 changed, 3 deleted) | u32 path length | path (UTF-8)
            | i64 version | i32 value length (-1: no value) | value
"""

from __future__ import annotations

import struct
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field

from pigeon.core.errors import CorruptFrame
from pigeon.core.metadata import (
    EventType,
    NeedRead,
    Planner,
    WatchEvent,
    WriteOp,
    join_path,
    parent_path,
)
from pigeon.core.metadata import Snapshot as TreeSnapshot

__all__ = [
    "Layout",
    "NeedIndexRead",
    "NodeInfo",
    "Plan",
    "Snapshot",
    "ZkOp",
    "decode_entry",
    "encode_entry",
    "plan",
    "sid_hex",
    "sid_int",
]

_MAGIC = b"PGL1"
_KINDS = {EventType.CREATED: 1, EventType.CHANGED: 2, EventType.DELETED: 3}
_TYPES = {v: k for k, v in _KINDS.items()}
_HEAD = struct.Struct(">4sI")
_EVENT = struct.Struct(">BI")
_TAIL = struct.Struct(">qi")


def encode_entry(events: list[WatchEvent]) -> bytes:
    out = [_HEAD.pack(_MAGIC, len(events))]
    for event in events:
        path = event.path.encode()
        out.append(_EVENT.pack(_KINDS[event.type], len(path)))
        out.append(path)
        value = event.value
        out.append(_TAIL.pack(event.version, -1 if value is None else len(value)))
        if value is not None:
            out.append(value)
    return b"".join(out)


def decode_entry(data: bytes) -> list[WatchEvent]:
    try:
        magic, count = _HEAD.unpack_from(data, 0)
        if magic != _MAGIC:
            raise CorruptFrame(f"metadata log entry: bad magic {magic!r}")
        pos = _HEAD.size
        events = []
        for _ in range(count):
            kind, path_len = _EVENT.unpack_from(data, pos)
            pos += _EVENT.size
            path = data[pos : pos + path_len].decode()
            pos += path_len
            version, value_len = _TAIL.unpack_from(data, pos)
            pos += _TAIL.size
            value: bytes | None = None
            if value_len >= 0:
                value = bytes(data[pos : pos + value_len])
                pos += value_len
            events.append(WatchEvent(_TYPES[kind], path, value, version))
        if pos != len(data):
            raise CorruptFrame("metadata log entry: trailing bytes")
        return events
    except (struct.error, KeyError, UnicodeDecodeError) as exc:
        raise CorruptFrame(f"metadata log entry: {exc}") from None


class Layout:
    """Znode paths of one store's chroot (the layout in the module docstring)."""

    __slots__ = ("alive", "chroot", "log", "seq_dir", "sessions", "tree")

    def __init__(self, chroot: str) -> None:
        self.chroot = chroot
        self.tree, self.log, self.seq_dir = f"{chroot}/tree", f"{chroot}/log", f"{chroot}/seq"
        self.sessions, self.alive = f"{chroot}/sessions", f"{chroot}/alive"

    def __repr__(self) -> str:
        return f"Layout({self.chroot!r})"

    def node(self, path: str) -> str:
        """The znode of the user's node ``path``."""
        return self.tree if path == "/" else self.tree + path

    def seq(self, parent: str) -> str:
        """The counter znode of ``parent``'s sequential children."""
        return f"{self.seq_dir}/{_quote(parent)}"

    def session(self, sid: str) -> str:
        return f"{self.sessions}/{sid}"

    def index(self, sid: str, path: str) -> str:
        """The entry of ``path`` in the index of session ``sid``'s ephemeral nodes."""
        return f"{self.session(sid)}/{_quote(path)}"

    def alive_marker(self, sid: str) -> str:
        return f"{self.alive}/{sid}"

    def bucket(self, bucket: int) -> str:
        return f"{self.log}/{bucket:010d}"

    def entry_prefix(self, bucket: int) -> str:
        """The path ZooKeeper appends an entry's sequence number to."""
        return f"{self.bucket(bucket)}/e-"

    def entry(self, bucket: int, seq: int) -> str:
        return f"{self.entry_prefix(bucket)}{seq:010d}"


def _quote(path: str) -> str:
    """A node path as one znode name."""
    return urllib.parse.quote(path, safe="")


def sid_hex(session_id: int) -> str:
    return f"{session_id & 0xFFFFFFFFFFFFFFFF:016x}"


def sid_int(sid: str) -> int:
    value = int(sid, 16)
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class NodeInfo:
    """What an ``exists`` read told about one tree node."""

    exists: bool
    version: int = 0
    owner: int = 0  # ephemeralOwner; 0 for persistent nodes
    num_children: int = 0

    @property
    def ephemeral(self) -> bool:
        return self.owner != 0


_ABSENT = NodeInfo(False)
_ROOT = NodeInfo(True)


@dataclass
class Snapshot(TreeSnapshot[NodeInfo]):
    """Reads the planner used; filled in by the caller on :class:`NeedRead`."""

    #: parent path → counter znode version, or None if there is no counter znode
    counters: dict[str, int | None] = field(default_factory=dict)
    #: path → names of its children
    children: dict[str, list[str]] = field(default_factory=dict)
    #: (sid, path) → whether the session index entry exists
    index: dict[tuple[str, str], bool] = field(default_factory=dict)


class NeedIndexRead(NeedRead):
    """The planner needs to know whether these session index entries exist."""

    def __init__(self, index: set[tuple[str, str]]) -> None:
        super().__init__()
        self.index = index


@dataclass(frozen=True)
class ZkOp:
    """One op of a ZooKeeper multi: ``create`` / ``set`` / ``delete`` / ``check``."""

    kind: str
    path: str
    data: bytes = b""
    version: int = -1
    ephemeral: bool = False

    def size(self) -> int:
        return len(self.path) + len(self.data) + 32


@dataclass
class Plan:
    ops: list[ZkOp]
    events: list[WatchEvent]
    results: list[object]

    def size(self) -> int:
        return sum(op.size() for op in self.ops) + sum(
            len(e.path) + len(e.value or b"") + 17 for e in self.events
        )


class _ZkPlanner(Planner[NodeInfo]):
    def __init__(self, layout: Layout, snapshot: Snapshot, sid: str | None) -> None:
        super().__init__(snapshot, session=sid is not None)
        self.layout = layout
        self.snap = snapshot
        self.sid = sid
        self.counters: dict[str, int | None] = {}
        self.added: dict[str, set[str]] = {}
        self.removed: dict[str, set[str]] = {}
        self.index: dict[tuple[str, str], bool] = {}
        self.ops: list[ZkOp] = []
        self.events: list[WatchEvent] = []

    # --- reads through the overlay -------------------------------------------------

    def parent_node(self, path: str) -> NodeInfo:
        """A node that gets a child (the root needs no read: it exists, persistent)."""
        return _ROOT if path == "/" and path not in self.nodes else self.node(path)

    def counter(self, parent: str) -> int | None:
        if parent in self.counters:
            return self.counters[parent]
        if parent in self.snap.counters:
            return self.snap.counters[parent]
        raise NeedRead(counters={parent})

    def child_names(self, path: str) -> set[str]:
        if path not in self.snap.children:
            raise NeedRead(children={path})
        names = set(self.snap.children[path]) | self.added.get(path, set())
        return names - self.removed.get(path, set())

    def has_index(self, sid: str, path: str) -> bool:
        key = (sid, path)
        if key in self.index:
            return self.index[key]
        if key in self.snap.index:
            return self.snap.index[key]
        raise NeedIndexRead({key})

    def next_number(self, parent: str) -> int:
        counter = self.counter(parent)  # the counter znode's version: the last number given
        return 0 if counter is None else counter + 1

    def has_children(self, path: str, info: NodeInfo) -> bool:
        return info.num_children > 0

    # --- overlay updates -------------------------------------------------------------

    def _child_added(self, path: str) -> None:
        parent = parent_path(path)
        name = path.rsplit("/", 1)[1]
        self.added.setdefault(parent, set()).add(name)
        self.removed.get(parent, set()).discard(name)
        info = self.parent_node(parent)
        self.nodes[parent] = NodeInfo(True, info.version, info.owner, info.num_children + 1)

    def _child_removed(self, path: str) -> None:
        parent = parent_path(path)
        name = path.rsplit("/", 1)[1]
        self.removed.setdefault(parent, set()).add(name)
        self.added.get(parent, set()).discard(name)
        info = self.parent_node(parent)
        self.nodes[parent] = NodeInfo(True, info.version, info.owner, max(0, info.num_children - 1))

    # --- emission ----------------------------------------------------------------------

    def emit_create(self, path: str, value: bytes, *, ephemeral: bool) -> NodeInfo:
        self.ops.append(ZkOp("create", self.layout.node(path), value, ephemeral=ephemeral))
        self.events.append(WatchEvent(EventType.CREATED, path, value, 0))
        self._child_added(path)
        if not ephemeral:
            return NodeInfo(True)
        assert self.sid is not None  # the planner checked the session
        self.ops.append(ZkOp("create", self.layout.index(self.sid, path)))
        self.index[(self.sid, path)] = True
        # the registered session is still the live one (its marker goes with it)
        self.ops.append(ZkOp("check", self.layout.alive_marker(self.sid)))
        return NodeInfo(True, 0, sid_int(self.sid), 0)

    def emit_number(self, parent: str, number: int) -> None:
        seq_path = self.layout.seq(parent)
        if number == 0:  # no counter znode yet
            self.ops.append(ZkOp("create", seq_path))
        else:
            self.ops.append(ZkOp("set", seq_path, version=number - 1))
        self.counters[parent] = number  # the counter znode's version after this op

    def emit_set(self, path: str, info: NodeInfo, value: bytes) -> NodeInfo:
        self.ops.append(ZkOp("set", self.layout.node(path), value, version=info.version))
        self.events.append(WatchEvent(EventType.CHANGED, path, value, info.version + 1))
        return NodeInfo(True, info.version + 1, info.owner, info.num_children)

    def emit_delete(self, path: str, info: NodeInfo, *, recursive: bool) -> NodeInfo:
        self._delete_tree(path, info)  # without children unless recursive
        return _ABSENT

    def _delete_tree(self, path: str, info: NodeInfo) -> None:
        if info.num_children:
            for name in sorted(self.child_names(path)):
                child = join_path(path, name)
                self._delete_tree(child, self.node(child))
        self.ops.append(ZkOp("delete", self.layout.node(path), version=info.version))
        self.events.append(WatchEvent(EventType.DELETED, path, None, info.version))
        counter = self.counter(path)
        if counter is not None:
            self.ops.append(ZkOp("delete", self.layout.seq(path), version=counter))
            self.counters[path] = None
        if info.owner:
            sid = sid_hex(info.owner)
            if self.has_index(sid, path):
                self.ops.append(ZkOp("delete", self.layout.index(sid, path)))
                self.index[(sid, path)] = False
        self.nodes[path] = _ABSENT
        self._child_removed(path)

    def emit_check(self, path: str, info: NodeInfo) -> None:
        self.ops.append(ZkOp("check", self.layout.node(path), version=info.version))


def plan(layout: Layout, ops: Sequence[WriteOp], snapshot: Snapshot, sid: str | None) -> Plan:
    """Plan ``ops`` on ``snapshot``.  Raises the contract error of the first op that
    fails, or :class:`NeedRead` if a read is missing (read it, then plan again)."""
    planner = _ZkPlanner(layout, snapshot, sid)
    results = planner.plan(ops)
    return Plan(planner.ops, planner.events, results)

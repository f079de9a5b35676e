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

The planner simulates the ops in order on a snapshot of the nodes it read, raising the
contract's errors (the first failing op wins), and emits ZooKeeper ops whose version
checks make the multi fail if anything it read changed meanwhile; the caller then reads
again and re-plans.

Log entry format (big-endian)::

    b"PGL1" | u32 count | count x event
    event = u8 kind (1 created, 2 changed, 3 deleted) | u32 path length | path (UTF-8)
            | i64 version | i32 value length (-1: no value) | value
"""

from __future__ import annotations

import struct
import urllib.parse
from dataclasses import dataclass, field

from pigeon.core.errors import (
    BadVersion,
    CorruptFrame,
    InvalidArgument,
    NodeExists,
    NoSuchNode,
    NotEmpty,
    SessionExpired,
)
from pigeon.core.metadata import (
    SEQUENCE_DIGITS,
    EventType,
    Op,
    OpKind,
    WatchEvent,
    join_path,
    parent_path,
)

__all__ = [
    "Layout",
    "NeedRead",
    "NodeInfo",
    "Plan",
    "Snapshot",
    "StaleRead",
    "ZkOp",
    "decode_entry",
    "encode_entry",
    "plan",
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


@dataclass(frozen=True)
class Layout:
    """Znode paths of one store's chroot."""

    chroot: str

    @property
    def tree(self) -> str:
        return f"{self.chroot}/tree"

    @property
    def log(self) -> str:
        return f"{self.chroot}/log"

    @property
    def seq_dir(self) -> str:
        return f"{self.chroot}/seq"

    @property
    def sessions(self) -> str:
        return f"{self.chroot}/sessions"

    @property
    def alive(self) -> str:
        return f"{self.chroot}/alive"

    def node(self, path: str) -> str:
        return self.tree if path == "/" else self.tree + path

    def seq(self, parent: str) -> str:
        return f"{self.seq_dir}/{urllib.parse.quote(parent, safe='')}"

    def session(self, sid: str) -> str:
        return f"{self.sessions}/{sid}"

    def index(self, sid: str, path: str) -> str:
        return f"{self.sessions}/{sid}/{urllib.parse.quote(path, safe='')}"

    def alive_marker(self, sid: str) -> str:
        return f"{self.alive}/{sid}"

    def bucket(self, bucket: int) -> str:
        return f"{self.log}/{bucket:010d}"

    def entry_prefix(self, bucket: int) -> str:
        return f"{self.log}/{bucket:010d}/e-"

    def entry(self, bucket: int, seq: int) -> str:
        return f"{self.log}/{bucket:010d}/e-{seq:010d}"


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


_ABSENT = NodeInfo(False)
_ROOT = NodeInfo(True)


@dataclass
class Snapshot:
    """Reads the planner used; filled in by the caller on :class:`NeedRead`."""

    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    #: parent path → counter znode version, or None if there is no counter znode
    counters: dict[str, int | None] = field(default_factory=dict)
    #: path → names of its children
    children: dict[str, list[str]] = field(default_factory=dict)
    #: (sid, path) → whether the session index entry exists
    index: dict[tuple[str, str], bool] = field(default_factory=dict)


class NeedRead(Exception):
    """The planner needs these reads before it can go on."""

    def __init__(
        self,
        nodes: set[str] | None = None,
        counters: set[str] | None = None,
        children: set[str] | None = None,
        index: set[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__("more reads needed")
        self.nodes = nodes or set()
        self.counters = counters or set()
        self.children = children or set()
        self.index = index or set()


class StaleRead(Exception):
    """The reads contradict each other (another writer came between): read again."""


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


@dataclass(frozen=True)
class Create:
    """A create as the store API knows it (``Op.create`` has no ``sequential``)."""

    path: str
    value: bytes
    ephemeral: bool = False
    sequential: bool = False


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` → ``['/a/b', '/a']`` (parents, nearest first, without the root)."""
    out = []
    while True:
        path = parent_path(path)
        if path == "/":
            return out
        out.append(path)


class _Planner:
    def __init__(self, layout: Layout, snapshot: Snapshot, sid: str | None) -> None:
        self.layout = layout
        self.snap = snapshot
        self.sid = sid
        self.nodes: dict[str, NodeInfo] = {}
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

    def node(self, path: str) -> NodeInfo:
        if path in self.nodes:
            return self.nodes[path]
        if path in self.snap.nodes:
            return self.snap.nodes[path]
        # read the path with all its ancestors at once: creates need them anyway
        raise NeedRead(nodes={path, *_ancestors(path)} - self.snap.nodes.keys())

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
        raise NeedRead(index={key})

    # --- overlay updates -------------------------------------------------------------

    def _set_node(self, path: str, info: NodeInfo) -> None:
        self.nodes[path] = info

    def _child_added(self, path: str) -> None:
        parent = parent_path(path)
        name = path.rsplit("/", 1)[1]
        self.added.setdefault(parent, set()).add(name)
        self.removed.get(parent, set()).discard(name)
        info = self.parent_node(parent)
        self._set_node(parent, NodeInfo(True, info.version, info.owner, info.num_children + 1))

    def _child_removed(self, path: str) -> None:
        parent = parent_path(path)
        name = path.rsplit("/", 1)[1]
        self.removed.setdefault(parent, set()).add(name)
        self.added.get(parent, set()).discard(name)
        info = self.parent_node(parent)
        self._set_node(
            parent, NodeInfo(True, info.version, info.owner, max(0, info.num_children - 1))
        )

    # --- ops ---------------------------------------------------------------------------

    def create(self, op: Create) -> str:
        path = op.path
        if op.sequential:
            parent = parent_path(path + "0")
        else:
            if path == "/":
                raise NodeExists("/")
            parent = parent_path(path)
        owner = 0
        if op.ephemeral:
            if self.sid is None:
                raise SessionExpired("the metadata session expired; call new_session()")
            owner = sid_int(self.sid)
        missing: list[str] = []
        node = parent
        while True:
            info = self.parent_node(node)
            if info.exists:
                if info.owner:
                    raise InvalidArgument(f"{node!r} is ephemeral and cannot have children")
                break
            missing.append(node)
            node = parent_path(node)
        counter: int | None = None
        if op.sequential:
            counter = self.counter(parent)
            number = 0 if counter is None else counter + 1
            if number >= 10**SEQUENCE_DIGITS:
                raise InvalidArgument(f"sequence counter of {parent!r} is exhausted")
            path = f"{path}{number:0{SEQUENCE_DIGITS}d}"
        # below a missing parent nothing exists: no need to read the node itself
        if not missing and self.node(path).exists:
            if op.sequential:  # the counter was read before another writer used it
                raise StaleRead(f"sequential node {path} exists already")
            raise NodeExists(path)
        for ancestor in reversed(missing):
            self.ops.append(ZkOp("create", self.layout.node(ancestor)))
            self.events.append(WatchEvent(EventType.CREATED, ancestor, b"", 0))
            self._set_node(ancestor, NodeInfo(True))
            self._child_added(ancestor)
        if op.sequential:
            seq_path = self.layout.seq(parent)
            if counter is None:
                self.ops.append(ZkOp("create", seq_path))
            else:
                self.ops.append(ZkOp("set", seq_path, version=counter))
            self.counters[parent] = number  # the counter znode's version after this op
        self.ops.append(ZkOp("create", self.layout.node(path), op.value, ephemeral=op.ephemeral))
        self.events.append(WatchEvent(EventType.CREATED, path, op.value, 0))
        self._set_node(path, NodeInfo(True, 0, owner, 0))
        self._child_added(path)
        if op.ephemeral:
            assert self.sid is not None
            self.ops.append(ZkOp("create", self.layout.index(self.sid, path)))
            self.index[(self.sid, path)] = True
            # the registered session is still the live one (its marker goes with it)
            self.ops.append(ZkOp("check", self.layout.alive_marker(self.sid)))
        return path

    def set(self, path: str, value: bytes, version: int | None) -> int:
        info = self.node(path)
        if not info.exists:
            raise NoSuchNode(path)
        if version is not None and version != info.version:
            raise BadVersion(f"{path}: version is {info.version}, expected {version}")
        self.ops.append(ZkOp("set", self.layout.node(path), value, version=info.version))
        self.events.append(WatchEvent(EventType.CHANGED, path, value, info.version + 1))
        self._set_node(path, NodeInfo(True, info.version + 1, info.owner, info.num_children))
        return info.version + 1

    def delete(self, path: str, version: int | None, recursive: bool) -> None:
        if path == "/":
            raise InvalidArgument("the root node cannot be deleted")
        info = self.node(path)
        if not info.exists:
            raise NoSuchNode(path)
        if version is not None and version != info.version:
            raise BadVersion(f"{path}: version is {info.version}, expected {version}")
        if info.num_children and not recursive:
            raise NotEmpty(path)
        self._delete_tree(path, info)

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
        self._set_node(path, _ABSENT)
        self._child_removed(path)

    def check(self, path: str, version: int | None) -> None:
        info = self.node(path)
        if not info.exists:
            raise NoSuchNode(path)
        if version is not None and version != info.version:
            raise BadVersion(f"{path}: version is {info.version}, expected {version}")
        self.ops.append(ZkOp("check", self.layout.node(path), version=info.version))


def plan(layout: Layout, ops: list[Op | Create], snapshot: Snapshot, sid: str | None) -> Plan:
    """Plan ``ops`` on ``snapshot``.  Raises the contract error of the first op that
    fails, or :class:`NeedRead` if a read is missing (read it, then plan again)."""
    planner = _Planner(layout, snapshot, sid)
    results: list[object] = []
    for op in ops:
        if isinstance(op, Create):
            results.append(planner.create(op))
        elif op.kind is OpKind.CREATE:
            results.append(planner.create(Create(op.path, op.value, op.ephemeral)))
        elif op.kind is OpKind.SET:
            results.append(planner.set(op.path, op.value, op.version))
        elif op.kind is OpKind.DELETE:
            planner.delete(op.path, op.version, recursive=False)
            results.append(None)
        else:
            planner.check(op.path, op.version)
            results.append(None)
    return Plan(planner.ops, planner.events, results)


def plan_recursive_delete(
    layout: Layout, path: str, version: int | None, snapshot: Snapshot
) -> Plan:
    """Plan ``delete(path, recursive=True)``."""
    planner = _Planner(layout, snapshot, None)
    planner.delete(path, version, recursive=True)
    return Plan(planner.ops, planner.events, [None])

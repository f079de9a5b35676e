"""How the metadata tree maps onto etcd's flat keyspace, and how a write becomes one
etcd transaction (no I/O here).

Keys (bytes) under the store's prefix ``P`` (``/pigeon`` by default); a path is encoded
as its components each preceded by a NUL byte (``enc("/a/b") = b"\\0a\\0b"``, the root
is empty), which paths cannot contain::

    P/n<enc(path)>                 the node: header + value (below); ephemeral nodes are
                                   attached to the session's lease
    P/c<enc(parent)>\\0\\0<name>     child index entry (empty value): one per node, on the
                                   node's lease if it is ephemeral
    P/s<enc(parent)>               sequential-child counter of a parent: its etcd version

Because NUL sorts before every other byte, a node and its whole subtree are one key range
``[P/n<enc>, P/n<enc>\\x01)`` (``/a`` does not cover ``/ab``): a prefix watch is one etcd
watch and a recursive delete is one range delete.  The child index makes ``children()``
a range over direct children only (``P/c<enc(parent)>\\0\\0``), and its subtree is again
one range (``[P/c<enc>\\0, P/c<enc>\\x01)``), as are the counters'.

Node value: ``u8 format (1) | u64 version | f64 ctime | f64 mtime | value`` (big-endian).
The version is the store's own, not etcd's per-key version, because a ``multi`` that
touches one node twice (create, then set) must be written as a single put (etcd refuses
a key twice in one transaction) yet end at version 1.

A plan simulates the ops in order on a snapshot of the keys it read (one etcd
transaction of ranges, so the snapshot is consistent), raising the contract's errors
(the first failing op wins), and emits one transaction: compares on the mod revision of
every key it relied on (version 0 for keys it relied on being absent; an empty child
range for a non-recursive delete), then the writes, each key once, in first-touch order.
If the compares fail, the caller reads again and re-plans.
"""

from __future__ import annotations

import struct
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
from pigeon.core.metadata import SEQUENCE_DIGITS, Op, OpKind, parent_path

__all__ = [
    "Compare",
    "Create",
    "Keys",
    "NeedRead",
    "NodeInfo",
    "Plan",
    "Snapshot",
    "StaleRead",
    "Write",
    "decode_value",
    "encode_value",
    "plan",
    "plan_recursive_delete",
]

_HEADER = struct.Struct(">BQdd")
_FORMAT = 1


def encode_value(value: bytes, version: int, ctime: float, mtime: float) -> bytes:
    return _HEADER.pack(_FORMAT, version, ctime, mtime) + value


def decode_value(raw: bytes) -> tuple[bytes, int, float, float]:
    """``(value, version, ctime, mtime)`` of a stored node."""
    if len(raw) < _HEADER.size or raw[0] != _FORMAT:
        raise CorruptFrame("etcd metadata node: missing or unknown header")
    _, version, ctime, mtime = _HEADER.unpack_from(raw, 0)
    return bytes(raw[_HEADER.size :]), version, ctime, mtime


def encode_path(path: str) -> bytes:
    if path == "/":
        return b""
    return b"".join(b"\0" + part.encode() for part in path[1:].split("/"))


def decode_path(encoded: bytes) -> str:
    if not encoded:
        return "/"
    return "/".join(part.decode() for part in encoded.split(b"\0"))


def _name(path: str) -> str:
    return path.rsplit("/", 1)[1]


@dataclass(frozen=True)
class Keys:
    """The etcd keys of one store's prefix."""

    prefix: bytes

    @property
    def nodes(self) -> bytes:
        return self.prefix + b"/n"

    def node(self, path: str) -> bytes:
        return self.nodes + encode_path(path)

    def path_of(self, key: bytes) -> str | None:
        """The path of a node key, or None if ``key`` is not one."""
        if not key.startswith(self.nodes):
            return None
        try:
            return decode_path(key[len(self.nodes) :])
        except UnicodeDecodeError:
            return None

    def subtree(self, path: str) -> tuple[bytes, bytes]:
        """The node and everything below it: ``[start, end)``."""
        key = self.node(path)
        return key, key + b"\x01"

    def below(self, path: str) -> tuple[bytes, bytes]:
        key = self.node(path)
        return key + b"\0", key + b"\x01"

    def child(self, path: str) -> bytes:
        return self.prefix + b"/c" + encode_path(parent_path(path)) + b"\0\0" + _name(path).encode()

    def children(self, parent: str) -> tuple[bytes, bytes]:
        start = self.prefix + b"/c" + encode_path(parent) + b"\0\0"
        return start, start[:-1] + b"\x01"

    def child_subtree(self, path: str) -> tuple[bytes, bytes]:
        """Index entries of every node strictly below ``path``."""
        start = self.prefix + b"/c" + encode_path(path) + b"\0"
        return start, start[:-1] + b"\x01"

    def counter(self, parent: str) -> bytes:
        return self.prefix + b"/s" + encode_path(parent)

    def counter_subtree(self, path: str) -> tuple[bytes, bytes]:
        key = self.counter(path)
        return key, key + b"\x01"


@dataclass(frozen=True)
class NodeInfo:
    """A node as read from etcd (``exists`` False for an absent key)."""

    exists: bool
    version: int = 0
    lease: int = 0
    mod_revision: int = 0
    ctime: float = 0.0
    value: bytes = b""


_ABSENT = NodeInfo(False)
_ROOT = NodeInfo(True)


@dataclass
class Snapshot:
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    #: path → number of children
    children: dict[str, int] = field(default_factory=dict)
    #: parent → etcd version of its counter key (0 if absent)
    counters: dict[str, int] = field(default_factory=dict)


class NeedRead(Exception):
    def __init__(
        self,
        nodes: set[str] | None = None,
        children: set[str] | None = None,
        counters: set[str] | None = None,
    ) -> None:
        super().__init__("more reads needed")
        self.nodes = nodes or set()
        self.children = children or set()
        self.counters = counters or set()


class StaleRead(Exception):
    """The reads contradict each other (another writer came between): read again."""


@dataclass(frozen=True)
class Compare:
    """``kind``: ``mod`` (mod revision == value), ``version`` (etcd version == value),
    ``empty`` (no key in ``[key, range_end)``)."""

    kind: str
    key: bytes
    value: int = 0
    range_end: bytes = b""


@dataclass(frozen=True)
class Write:
    """``put`` (value, lease), ``delete`` (one key) or ``delete_range`` ([key, range_end))."""

    kind: str
    key: bytes
    value: bytes = b""
    lease: int = 0
    range_end: bytes = b""

    def size(self) -> int:
        return len(self.key) + len(self.value) + len(self.range_end) + 16


@dataclass
class Plan:
    compares: list[Compare]
    writes: list[Write]
    results: list[object]

    def size(self) -> int:
        return sum(w.size() for w in self.writes) + 32 * len(self.compares)


@dataclass(frozen=True)
class Create:
    path: str
    value: bytes
    ephemeral: bool = False
    sequential: bool = False


def ancestors(path: str) -> list[str]:
    """``/a/b/c`` → ``['/a/b', '/a']`` (without the root)."""
    out = []
    while path != "/":
        path = parent_path(path)
        if path != "/":
            out.append(path)
    return out


class _Planner:
    def __init__(self, keys: Keys, snap: Snapshot, lease: int | None, now: float) -> None:
        self.keys = keys
        self.snap = snap
        self.lease = lease
        self.now = now
        self.nodes: dict[str, NodeInfo] = {}
        self.child_delta: dict[str, int] = {}
        self.counters: dict[str, int] = {}
        self.compares: dict[tuple[str, bytes], Compare] = {}
        self.writes: dict[bytes, Write] = {}
        self.created: set[str] = set()

    def node(self, path: str) -> NodeInfo:
        if path in self.nodes:
            return self.nodes[path]
        if path not in self.snap.nodes:
            raise NeedRead(nodes={path, *ancestors(path)} - self.snap.nodes.keys())
        info = self.snap.nodes[path]
        self._compare(path, info)
        if path == "/" and not info.exists:  # the root exists even before its first set
            info = _ROOT
        return info

    def parent_node(self, path: str) -> NodeInfo:
        """A node a create goes below (the root needs no read: it exists, persistent)."""
        return _ROOT if path == "/" and path not in self.nodes else self.node(path)

    def _compare(self, path: str, info: NodeInfo) -> None:
        key = self.keys.node(path)
        if info.exists:
            self._add_compare(Compare("mod", key, info.mod_revision))
        else:
            self._add_compare(Compare("version", key, 0))

    def _add_compare(self, compare: Compare) -> None:
        self.compares.setdefault((compare.kind, compare.key), compare)

    def num_children(self, path: str) -> int:
        if path in self.created:  # no children in etcd yet
            return self.child_delta.get(path, 0)
        if path not in self.snap.children:
            raise NeedRead(children={path})
        return self.snap.children[path] + self.child_delta.get(path, 0)

    def counter(self, parent: str) -> int:
        if parent in self.counters:
            return self.counters[parent]
        if parent not in self.snap.counters:
            raise NeedRead(counters={parent})
        version = self.snap.counters[parent]
        self._add_compare(Compare("version", self.keys.counter(parent), version))
        return version

    def _write(self, write: Write) -> None:
        self.writes.pop(write.key, None)  # one write per key: the last one wins ...
        self.writes[write.key] = write  # ... in the place of the last touch

    def _put_node(self, path: str, info: NodeInfo) -> None:
        self.nodes[path] = info
        raw = encode_value(info.value, info.version, info.ctime, self.now)
        self._write(Write("put", self.keys.node(path), raw, info.lease))

    # --- ops ---------------------------------------------------------------------------

    def create(self, op: Create) -> str:
        path = op.path
        if op.sequential:
            parent = parent_path(path + "0")
        else:
            if path == "/":
                raise NodeExists("/")
            parent = parent_path(path)
        lease = 0
        if op.ephemeral:
            if self.lease is None:
                raise SessionExpired("the metadata session expired; call new_session()")
            lease = self.lease
        missing: list[str] = []
        node = parent
        while True:
            info = self.parent_node(node)
            if info.exists:
                if info.lease:
                    raise InvalidArgument(f"{node!r} is ephemeral and cannot have children")
                break
            missing.append(node)
            node = parent_path(node)
        if op.sequential:
            number = self.counter(parent)
            if number >= 10**SEQUENCE_DIGITS:
                raise InvalidArgument(f"sequence counter of {parent!r} is exhausted")
            path = f"{path}{number:0{SEQUENCE_DIGITS}d}"
            self.counters[parent] = number + 1
            self._write(Write("put", self.keys.counter(parent)))
        if self.node(path).exists:
            if op.sequential:
                raise StaleRead(f"sequential node {path} exists already")
            raise NodeExists(path)
        for ancestor in reversed(missing):
            self._add_node(ancestor, NodeInfo(True, 0, 0, 0, self.now, b""))
        self._add_node(path, NodeInfo(True, 0, lease, 0, self.now, op.value))
        return path

    def _add_node(self, path: str, info: NodeInfo) -> None:
        self._put_node(path, info)
        # the index entry shares the node's lease: both go when the session ends
        self._write(Write("put", self.keys.child(path), lease=info.lease))
        parent = parent_path(path)
        self.child_delta[parent] = self.child_delta.get(parent, 0) + 1
        self.created.add(path)

    def set(self, path: str, value: bytes, version: int | None) -> int:
        info = self.node(path)
        if not info.exists:
            raise NoSuchNode(path)
        if version is not None and version != info.version:
            raise BadVersion(f"{path}: version is {info.version}, expected {version}")
        new = NodeInfo(True, info.version + 1, info.lease, info.mod_revision, info.ctime, value)
        self._put_node(path, new)
        return new.version

    def delete(self, path: str, version: int | None, recursive: bool) -> None:
        if path == "/":
            raise InvalidArgument("the root node cannot be deleted")
        info = self.node(path)
        if not info.exists:
            raise NoSuchNode(path)
        if version is not None and version != info.version:
            raise BadVersion(f"{path}: version is {info.version}, expected {version}")
        if recursive:
            start, end = self.keys.below(path)
            self._write(Write("delete_range", start, range_end=end))
            start, end = self.keys.child_subtree(path)
            self._write(Write("delete_range", start, range_end=end))
            start, end = self.keys.counter_subtree(path)
            self._write(Write("delete_range", start, range_end=end))
        else:
            if self.num_children(path) > 0:
                raise NotEmpty(path)
            start, end = self.keys.children(path)
            self._add_compare(Compare("empty", start, range_end=end))
            self._write(Write("delete", self.keys.counter(path)))
            self.counters[path] = 0
        self.nodes[path] = _ABSENT
        self._write(Write("delete", self.keys.node(path)))
        self._write(Write("delete", self.keys.child(path)))
        parent = parent_path(path)
        self.child_delta[parent] = self.child_delta.get(parent, 0) - 1

    def check(self, path: str, version: int | None) -> None:
        info = self.node(path)
        if not info.exists:
            raise NoSuchNode(path)
        if version is not None and version != info.version:
            raise BadVersion(f"{path}: version is {info.version}, expected {version}")


def plan(keys: Keys, ops: list[Op | Create], snap: Snapshot, lease: int | None, now: float) -> Plan:
    """Plan ``ops`` (``Op`` or :class:`Create`).  Raises the first op's contract error,
    :class:`NeedRead` when a read is missing, :class:`StaleRead` when reads conflict."""
    planner = _Planner(keys, snap, lease, now)
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
    return Plan(list(planner.compares.values()), list(planner.writes.values()), results)


def plan_recursive_delete(
    keys: Keys, path: str, version: int | None, snap: Snapshot, now: float
) -> Plan:
    planner = _Planner(keys, snap, None, now)
    planner.delete(path, version, recursive=True)
    return Plan(list(planner.compares.values()), list(planner.writes.values()), [None])

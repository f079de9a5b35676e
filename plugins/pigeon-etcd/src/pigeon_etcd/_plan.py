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

The contract's semantics are :class:`pigeon.core.metadata.Planner`'s, on a snapshot of
the keys read (one etcd transaction of ranges, so the snapshot is consistent); this
module emits one transaction for them: compares on the mod revision of every node key
the plan relied on (version 0 for keys it relied on being absent; the counter's version
for a sequential create; an empty child range for a non-recursive delete), then the
writes, each key once, in the order of its last touch.  If the compares fail, the caller
reads again and re-plans.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from pigeon.core.errors import CorruptFrame
from pigeon.core.metadata import NeedRead, Planner, WriteOp, parent_path
from pigeon.core.metadata import Snapshot as TreeSnapshot

__all__ = [
    "Compare",
    "Keys",
    "NodeInfo",
    "Plan",
    "Snapshot",
    "Write",
    "decode_value",
    "encode_value",
    "plan",
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

    @property
    def ephemeral(self) -> bool:
        return self.lease != 0


_ABSENT = NodeInfo(False)
_ROOT = NodeInfo(True)


@dataclass
class Snapshot(TreeSnapshot[NodeInfo]):
    #: path → number of children
    children: dict[str, int] = field(default_factory=dict)
    #: parent → etcd version of its counter key (0 if absent)
    counters: dict[str, int] = field(default_factory=dict)


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


class _EtcdPlanner(Planner[NodeInfo]):
    def __init__(self, keys: Keys, snap: Snapshot, lease: int | None, now: float) -> None:
        super().__init__(snap, session=lease is not None)
        self.keys = keys
        self.snap = snap
        self.lease = lease
        self.now = now
        self.child_delta: dict[str, int] = {}
        self.counters: dict[str, int] = {}
        self.compares: dict[tuple[str, bytes], Compare] = {}
        self.writes: dict[bytes, Write] = {}
        self.created: set[str] = set()

    # --- reads ---------------------------------------------------------------------------

    def relied_on(self, path: str, info: NodeInfo) -> NodeInfo:
        key = self.keys.node(path)
        if info.exists:
            self._add_compare(Compare("mod", key, info.mod_revision))
        else:
            self._add_compare(Compare("version", key, 0))
        if path == "/" and not info.exists:  # the root exists even before its first set
            return _ROOT
        return info

    def _add_compare(self, compare: Compare) -> None:
        self.compares.setdefault((compare.kind, compare.key), compare)

    def has_children(self, path: str, info: NodeInfo) -> bool:
        if path in self.created:  # no children in etcd yet
            return self.child_delta.get(path, 0) > 0
        if path not in self.snap.children:
            raise NeedRead(children={path})
        return self.snap.children[path] + self.child_delta.get(path, 0) > 0

    def next_number(self, parent: str) -> int:
        """The counter key's etcd version: the number of sequential creates so far."""
        if parent in self.counters:
            return self.counters[parent]
        if parent not in self.snap.counters:
            raise NeedRead(counters={parent})
        version = self.snap.counters[parent]
        self._add_compare(Compare("version", self.keys.counter(parent), version))
        return version

    # --- emission --------------------------------------------------------------------------

    def _write(self, write: Write) -> None:
        self.writes.pop(write.key, None)  # one write per key: the last one wins ...
        self.writes[write.key] = write  # ... in the place of the last touch

    def _put_node(self, path: str, info: NodeInfo) -> NodeInfo:
        raw = encode_value(info.value, info.version, info.ctime, self.now)
        self._write(Write("put", self.keys.node(path), raw, info.lease))
        return info

    def emit_create(self, path: str, value: bytes, *, ephemeral: bool) -> NodeInfo:
        lease = 0
        if ephemeral:
            assert self.lease is not None  # the planner checked the session
            lease = self.lease
        info = self._put_node(path, NodeInfo(True, 0, lease, 0, self.now, value))
        # the index entry shares the node's lease: both go when the session ends
        self._write(Write("put", self.keys.child(path), lease=lease))
        parent = parent_path(path)
        self.child_delta[parent] = self.child_delta.get(parent, 0) + 1
        self.created.add(path)
        return info

    def emit_number(self, parent: str, number: int) -> None:
        self.counters[parent] = number + 1
        self._write(Write("put", self.keys.counter(parent)))

    def emit_set(self, path: str, info: NodeInfo, value: bytes) -> NodeInfo:
        new = NodeInfo(True, info.version + 1, info.lease, info.mod_revision, info.ctime, value)
        return self._put_node(path, new)

    def emit_delete(self, path: str, info: NodeInfo, *, recursive: bool) -> NodeInfo:
        if recursive:
            start, end = self.keys.below(path)
            self._write(Write("delete_range", start, range_end=end))
            start, end = self.keys.child_subtree(path)
            self._write(Write("delete_range", start, range_end=end))
            start, end = self.keys.counter_subtree(path)
            self._write(Write("delete_range", start, range_end=end))
        else:
            start, end = self.keys.children(path)
            self._add_compare(Compare("empty", start, range_end=end))
            self._write(Write("delete", self.keys.counter(path)))
            self.counters[path] = 0
        self._write(Write("delete", self.keys.node(path)))
        self._write(Write("delete", self.keys.child(path)))
        parent = parent_path(path)
        self.child_delta[parent] = self.child_delta.get(parent, 0) - 1
        return _ABSENT


def plan(keys: Keys, ops: Sequence[WriteOp], snap: Snapshot, lease: int | None, now: float) -> Plan:
    """Plan ``ops``.  Raises the first op's contract error, :class:`NeedRead` when a
    read is missing, :class:`StaleRead` when reads conflict."""
    planner = _EtcdPlanner(keys, snap, lease, now)
    results = planner.plan(ops)
    return Plan(list(planner.compares.values()), list(planner.writes.values()), results)

"""Metadata writes planned as one transaction on a snapshot of reads (no I/O here).

A backend on a server with conditional multi-key transactions (ZooKeeper's ``multi``,
etcd's ``Txn``) writes the same way whatever the server:

1. **read** what the write depends on into a :class:`Snapshot`;
2. **plan**: simulate the ops in order on the snapshot, raising the contract's error of
   the first op that fails, and emit one transaction: the writes, plus conditions that
   make it fail if anything the plan relied on has changed since it was read;
3. **commit**; if the conditions failed another writer came between: read again, plan
   again (:class:`pigeon.core.metadata.TransactionalMetadataStore` runs this loop).

:class:`Planner` is step 2 without the backend: the contract's semantics of the four
ops (see :mod:`pigeon.core.metadata._store`) on an overlay of the snapshot.  A backend
subclasses it and supplies two small sets of hooks, nothing else:

reads
    :meth:`~Planner.next_number` (the number a sequential create under a parent gets),
    :meth:`~Planner.has_children` (for a non-recursive delete) and
    :meth:`~Planner.relied_on` (called for every snapshot read the plan uses: where the
    backend records the condition that the read still holds at commit).
emission
    :meth:`~Planner.emit_create`, :meth:`~Planner.emit_number`, :meth:`~Planner.emit_set`,
    :meth:`~Planner.emit_delete`, :meth:`~Planner.emit_check`: the backend's operations
    for one step, returning the node's new state for the overlay.

Reads on demand
    The planner never does I/O.  When it needs something the snapshot does not hold it
    raises :class:`NeedRead` naming it; the caller reads that into the same snapshot and
    plans again from the first op (planning is cheap and deterministic: the same
    snapshot gives the same plan).  :func:`first_reads` is what any plan of the ops needs,
    so a typical write plans after one round trip.  A node is always asked for with its
    ancestors, which a create needs anyway.  :class:`StaleRead` means the reads contradict
    each other (one was made after another writer's change): read everything again.

Semantics (the contract's, in the order the checks are made; the first failing op wins)
    ``create``: not of the root (``NodeExists``); an ephemeral node needs a live session
    (``SessionExpired``); missing ancestors are created as persistent empty nodes, top
    down, but an existing ephemeral ancestor cannot have children (``InvalidArgument``);
    a sequential create takes its parent's next number (``InvalidArgument`` once the
    :data:`~pigeon.core.metadata.SEQUENCE_DIGITS` digits are used up); then the node must
    not exist (``NodeExists``; for a sequential node the counter read was stale:
    :class:`StaleRead`).  Below a missing ancestor nothing exists, so that node is not
    read.  ``set``/``check``/``delete``: the node must exist (``NoSuchNode``) with the
    expected version if one is given (``BadVersion``, on that node only); ``set`` adds 1
    to the version; ``delete`` refuses the root (``InvalidArgument``) and, unless
    recursive, a node with children (``NotEmpty``).  Every op sees the effects of the
    ops before it.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeAlias, TypeVar

from pigeon.core.errors import (
    BadVersion,
    InvalidArgument,
    NodeExists,
    NoSuchNode,
    NotEmpty,
    SessionExpired,
)
from pigeon.core.metadata._store import SEQUENCE_DIGITS, Op, OpKind, parent_path

__all__ = [
    "Create",
    "Delete",
    "NeedRead",
    "NodeView",
    "Planner",
    "Snapshot",
    "StaleRead",
    "WriteOp",
    "first_reads",
]


@dataclass(frozen=True)
class Create:
    """A create as :meth:`MetadataStore.create` takes it (:meth:`Op.create` has no
    ``sequential``); ``path`` is the prefix of a sequential node."""

    path: str
    value: bytes = b""
    ephemeral: bool = False
    sequential: bool = False


@dataclass(frozen=True)
class Delete:
    """A delete as :meth:`MetadataStore.delete` takes it (:meth:`Op.delete` has no
    ``recursive``).  A recursive delete is planned alone: the planner does not follow
    the nodes below it for later ops."""

    path: str
    version: int | None = None
    recursive: bool = False


#: What a :class:`Planner` plans: the ops of ``multi`` and the store's own writes.
WriteOp: TypeAlias = Op | Create | Delete


class NodeView(Protocol):
    """What the planner needs of a backend's node record (absent nodes included)."""

    @property
    def exists(self) -> bool: ...

    @property
    def version(self) -> int: ...

    @property
    def ephemeral(self) -> bool: ...


N = TypeVar("N", bound=NodeView)


@dataclass
class Snapshot(Generic[N]):
    """The reads a plan is made on.  Backends subclass it with their other reads
    (counters, children), filled in by the caller on :class:`NeedRead`."""

    #: path → the node as read (``exists`` false if it was absent)
    nodes: dict[str, N] = field(default_factory=dict)


class NeedRead(Exception):
    """The planner needs these reads before it can go on: read them into the snapshot,
    then plan again.  Backends with other kinds of reads subclass it."""

    def __init__(
        self,
        *,
        nodes: set[str] | None = None,
        children: set[str] | None = None,
        counters: set[str] | None = None,
    ) -> None:
        super().__init__("more reads needed")
        #: paths whose node records are needed
        self.nodes = nodes or set()
        #: paths whose children are needed (as the backend counts or lists them)
        self.children = children or set()
        #: parents whose sequential counters are needed
        self.counters = counters or set()


class StaleRead(Exception):
    """The reads contradict each other, or the commit found one changed (another writer
    came between): read everything again and re-plan."""


def first_reads(ops: Iterable[WriteOp], *, children_of_deletes: bool = False) -> NeedRead:
    """The reads any plan of ``ops`` needs: the node of each op (for a sequential create,
    its parent and the parent's counter), and with ``children_of_deletes`` the children
    of each node to delete (for backends that count them with a separate read)."""
    need = NeedRead()
    for op in ops:
        if isinstance(op, Create) and op.sequential:
            parent = parent_path(op.path + "0")
            need.nodes.add(parent)
            need.counters.add(parent)
            continue
        need.nodes.add(op.path)
        deleting = isinstance(op, Delete) or (isinstance(op, Op) and op.kind is OpKind.DELETE)
        if children_of_deletes and deleting:
            need.children.add(op.path)
    return need


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` → ``['/a/b', '/a']`` (nearest first, without the root)."""
    out = []
    while path != "/":
        path = parent_path(path)
        if path != "/":
            out.append(path)
    return out


class Planner(abc.ABC, Generic[N]):
    """The contract's write semantics on a :class:`Snapshot`; subclasses emit a backend's
    transaction (see the module docstring for the hooks).

    ``session`` says whether the store has a live session (ephemeral creates need one).
    :attr:`nodes` is the overlay: each node as the ops planned so far left it.
    """

    def __init__(self, snapshot: Snapshot[N], *, session: bool) -> None:
        self.snapshot = snapshot
        self.session = session
        self.nodes: dict[str, N] = {}

    def plan(self, ops: Iterable[WriteOp]) -> list[object]:
        """Plan ``ops`` in order; their results (see :class:`Op`).  Raises the contract
        error of the first op that fails, :class:`NeedRead` or :class:`StaleRead`."""
        results: list[object] = []
        for op in ops:
            if isinstance(op, Create):
                results.append(self.create(op))
            elif isinstance(op, Delete):
                self.delete(op.path, op.version, recursive=op.recursive)
                results.append(None)
            elif op.kind is OpKind.CREATE:
                results.append(self.create(Create(op.path, op.value, op.ephemeral)))
            elif op.kind is OpKind.SET:
                results.append(self.set(op.path, op.value, op.version))
            elif op.kind is OpKind.DELETE:
                self.delete(op.path, op.version, recursive=False)
                results.append(None)
            else:
                self.check(op.path, op.version)
                results.append(None)
        return results

    # --- reads through the overlay ---------------------------------------------------------

    def node(self, path: str) -> N:
        """``path`` after the ops planned so far (from the snapshot if they left it
        alone: :meth:`relied_on` is told)."""
        if path in self.nodes:
            return self.nodes[path]
        if path in self.snapshot.nodes:
            return self.relied_on(path, self.snapshot.nodes[path])
        raise NeedRead(nodes={path, *_ancestors(path)} - self.snapshot.nodes.keys())

    def existing(self, path: str, version: int | None) -> N:
        """The node at ``path``; ``NoSuchNode`` if there is none, ``BadVersion`` if
        ``version`` is given and is not its version."""
        info = self.node(path)
        if not info.exists:
            raise NoSuchNode(path)
        if version is not None and version != info.version:
            raise BadVersion(f"{path}: version is {info.version}, expected {version}")
        return info

    # --- the ops -----------------------------------------------------------------------------

    def create(self, op: Create) -> str:
        path = op.path
        if op.sequential:
            parent = parent_path(path + "0")
        else:
            if path == "/":
                raise NodeExists("/")
            parent = parent_path(path)
        if op.ephemeral and not self.session:
            raise SessionExpired("the metadata session expired; call new_session()")
        missing: list[str] = []  # ancestors to create, nearest first
        node = parent
        while node != "/":  # the root exists and is persistent
            info = self.node(node)
            if info.exists:
                if info.ephemeral:
                    raise InvalidArgument(f"{node!r} is ephemeral and cannot have children")
                break
            missing.append(node)
            node = parent_path(node)
        number: int | None = None
        if op.sequential:
            number = self.next_number(parent)
            if number >= 10**SEQUENCE_DIGITS:
                raise InvalidArgument(f"sequence counter of {parent!r} is exhausted")
            path = f"{path}{number:0{SEQUENCE_DIGITS}d}"
        # below a missing parent nothing exists: no need to read the node itself
        if not missing and self.node(path).exists:
            if number is not None:  # the counter was read before another writer used it
                raise StaleRead(f"sequential node {path} exists already")
            raise NodeExists(path)
        for ancestor in reversed(missing):
            self.nodes[ancestor] = self.emit_create(ancestor, b"", ephemeral=False)
        if number is not None:
            self.emit_number(parent, number)
        self.nodes[path] = self.emit_create(path, op.value, ephemeral=op.ephemeral)
        return path

    def set(self, path: str, value: bytes, version: int | None) -> int:
        info = self.existing(path, version)
        self.nodes[path] = self.emit_set(path, info, value)
        return info.version + 1

    def delete(self, path: str, version: int | None, *, recursive: bool) -> None:
        if path == "/":
            raise InvalidArgument("the root node cannot be deleted")
        info = self.existing(path, version)
        if not recursive and self.has_children(path, info):
            raise NotEmpty(path)
        self.nodes[path] = self.emit_delete(path, info, recursive=recursive)

    def check(self, path: str, version: int | None) -> None:
        self.emit_check(path, self.existing(path, version))

    # --- backend hooks: reads -------------------------------------------------------------------

    def relied_on(self, path: str, info: N) -> N:
        """The plan uses the snapshot's read of ``path`` (``info``); return the node as
        the plan should see it.  Backends whose commit does not check reads by itself
        record a condition here; the default does nothing."""
        return info

    @abc.abstractmethod
    def next_number(self, parent: str) -> int:
        """The number the next sequential create under ``parent`` gets (0 for a parent
        that never had one, or was deleted since); raise :class:`NeedRead` to read it."""

    @abc.abstractmethod
    def has_children(self, path: str, info: N) -> bool:
        """Whether the existing node ``path`` has children now."""

    # --- backend hooks: emission ---------------------------------------------------------------

    @abc.abstractmethod
    def emit_create(self, path: str, value: bytes, *, ephemeral: bool) -> N:
        """Create ``path`` (its parent exists by now, it does not); return the new node
        (version 0).  Parents are created before their children."""

    @abc.abstractmethod
    def emit_number(self, parent: str, number: int) -> None:
        """A sequential create under ``parent`` took ``number`` (the next one is
        ``number + 1``); called between the creates of missing ancestors and the node's."""

    @abc.abstractmethod
    def emit_set(self, path: str, info: N, value: bytes) -> N:
        """Replace the value of the existing node ``info``; return it with version + 1."""

    @abc.abstractmethod
    def emit_delete(self, path: str, info: N, *, recursive: bool) -> N:
        """Delete the existing node ``info`` (with everything below it if ``recursive``,
        else it has no children), and its sequential counter; return an absent node."""

    def emit_check(self, path: str, info: N) -> None:
        """``check`` found ``info`` as required.  The default emits nothing (the read's
        condition from :meth:`relied_on` is the check)."""

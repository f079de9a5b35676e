"""The metadata store contract: data types, the abstract class, and backend helpers.

Every backend (the embedded SQLite store here, ZooKeeper and etcd in their plugins)
subclasses :class:`MetadataStore` and runs :class:`pigeon.core.testing.MetadataStoreContract`
against itself.  The helpers below (path rules, :class:`WatchHub`) are shared so that all
backends agree on the details the suite checks.

Paths
    Absolute, ``/``-separated, no trailing slash, no empty, ``.`` or ``..`` components,
    no NUL.  ``/`` is the root: it always exists, can be read, listed and watched, and
    cannot be created or deleted.  Creating a node creates its missing ancestors as
    persistent nodes with an empty value (like ``mkdir -p``).  An ephemeral node cannot
    have children (ZooKeeper's rule, enforced by every backend).

Versions
    A new node has version 0, each ``set`` adds 1; deleting and re-creating restarts at 0.

Sequential nodes
    ``create(prefix, sequential=True)`` appends a zero-padded 10-digit counter to
    ``prefix`` (which may end with ``/``); the counter belongs to the parent, only grows
    while the parent exists and is unique per parent.

Watches
    ``watch(path)`` reports changes of that one node; ``watch(path, prefix=True)``
    reports changes of the node and of every node below it (a subtree, not a string
    prefix: ``/a`` does not cover ``/ab``).  Only changes made after the watch is
    established are reported, completely and in commit order.  A recursive delete
    reports the descendants before the node.  A watcher that does not keep up gets a
    :class:`~pigeon.core.errors.MetadataError` from its iterator after the events that
    fitted in its buffer: events are never dropped silently.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import trio

from pigeon.core.errors import InvalidArgument, MetadataError

__all__ = [
    "DEFAULT_WATCH_BUFFER",
    "EventType",
    "MetadataStore",
    "Op",
    "OpKind",
    "SEQUENCE_DIGITS",
    "Stat",
    "WatchEvent",
    "WatchHub",
    "WatchHubStatistics",
    "Watcher",
    "check_timeout",
    "check_value",
    "join_path",
    "node_name",
    "parent_path",
    "sequence_number",
    "validate_create",
    "validate_ops",
    "validate_path",
    "validate_sequential_prefix",
]

#: Width of the counter appended to sequential nodes (``item-0000000042``).
SEQUENCE_DIGITS = 10

#: Default number of events a watcher may have unread before it fails.
DEFAULT_WATCH_BUFFER = 1024


# --- data types -----------------------------------------------------------------


@dataclass(frozen=True)
class Stat:
    """A node as read by :meth:`MetadataStore.get`.

    ``ctime``/``mtime`` are wall-clock seconds (``time.time()``) of creation and last
    change as recorded by the backend (0.0 if it does not know); they are not part of
    equality, so ``Stat(b"v", 0, False)`` compares equal to any read of that node.
    """

    value: bytes
    version: int
    ephemeral: bool = False
    ctime: float = field(default=0.0, compare=False)
    mtime: float = field(default=0.0, compare=False)


class EventType(enum.Enum):
    CREATED = "created"
    CHANGED = "changed"
    DELETED = "deleted"


@dataclass(frozen=True)
class WatchEvent:
    """One change of one node.

    ``value`` is the new value (``None`` for ``DELETED``); ``version`` is the node's new
    version (0 for ``CREATED``), or its last version for ``DELETED`` (-1 if the backend
    cannot know it).
    """

    type: EventType
    path: str
    value: bytes | None
    version: int


class OpKind(enum.Enum):
    CREATE = "create"
    SET = "set"
    DELETE = "delete"
    CHECK = "check"


@dataclass(frozen=True)
class Op:
    """One operation of :meth:`MetadataStore.multi`; build it with the class methods.

    Results of a successful ``multi``, one per op: ``create`` → the created path,
    ``set`` → the new version, ``delete`` and ``check`` → ``None``.
    """

    kind: OpKind
    path: str
    value: bytes = b""
    version: int | None = None
    ephemeral: bool = False

    @classmethod
    def create(cls, path: str, value: bytes = b"", ephemeral: bool = False) -> Op:
        """Create ``path`` (missing parents too); fails with ``NodeExists``."""
        return cls(OpKind.CREATE, path, check_value(value), None, ephemeral)

    @classmethod
    def set(cls, path: str, value: bytes, version: int | None = None) -> Op:
        """Set ``path``; with ``version``, fails with ``BadVersion`` on mismatch."""
        return cls(OpKind.SET, path, check_value(value), version)

    @classmethod
    def delete(cls, path: str, version: int | None = None) -> Op:
        """Delete ``path`` (which must have no children)."""
        return cls(OpKind.DELETE, path, b"", version)

    @classmethod
    def check(cls, path: str, version: int | None = None) -> Op:
        """Require ``path`` to exist (``NoSuchNode``) with ``version`` (``BadVersion``);
        ``version=None`` only requires it to exist."""
        return cls(OpKind.CHECK, path, b"", version)


# --- path helpers ---------------------------------------------------------------


def validate_path(path: str) -> str:
    """Return ``path`` if it is a valid node path, else raise ``InvalidArgument``."""
    if not isinstance(path, str):
        raise InvalidArgument(f"metadata path must be a str, not {type(path).__name__}")
    if path == "/":
        return path
    if not path.startswith("/"):
        raise InvalidArgument(f"metadata path {path!r} is not absolute")
    if path.endswith("/"):
        raise InvalidArgument(f"metadata path {path!r} has a trailing slash")
    if "\x00" in path:
        raise InvalidArgument(f"metadata path {path!r} contains NUL")
    for part in path[1:].split("/"):
        if part in ("", ".", ".."):
            raise InvalidArgument(f"metadata path {path!r} has an empty, '.' or '..' part")
    return path


def validate_sequential_prefix(prefix: str) -> str:
    """Validate the ``path`` given to a sequential create (it may end with ``/``)."""
    validate_path(prefix + "0" * SEQUENCE_DIGITS)
    return prefix


def parent_path(path: str) -> str:
    """``/a/b`` → ``/a``; ``/a`` → ``/``.  The root has no parent (``InvalidArgument``)."""
    if path == "/":
        raise InvalidArgument("the root has no parent")
    head = path.rsplit("/", 1)[0]
    return head or "/"


def node_name(path: str) -> str:
    """Last component: ``/a/b`` → ``b``."""
    return path.rsplit("/", 1)[1]


def join_path(parent: str, name: str) -> str:
    return f"/{name}" if parent == "/" else f"{parent}/{name}"


def sequence_number(name: str) -> int | None:
    """The counter a sequential create appended to ``name``, or ``None``."""
    tail = name[-SEQUENCE_DIGITS:]
    if len(tail) == SEQUENCE_DIGITS and tail.isascii() and tail.isdigit():
        return int(tail)
    return None


def check_value(value: bytes) -> bytes:
    """Values are bytes; bytearray/memoryview are copied, anything else is refused."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise InvalidArgument(f"metadata values are bytes, not {type(value).__name__}")


def validate_create(path: str, value: bytes, *, sequential: bool) -> bytes:
    """Check the arguments of ``create`` (a sequential node's prefix may end with
    ``/``); return the value as bytes."""
    if sequential:
        validate_sequential_prefix(path)
    else:
        validate_path(path)
    return check_value(value)


def validate_ops(ops: Iterable[Op]) -> list[Op]:
    """Check the argument of ``multi``: :class:`Op` objects with valid paths."""
    checked = list(ops)
    for op in checked:
        if not isinstance(op, Op):
            raise InvalidArgument(f"multi() takes Op objects, not {type(op).__name__}")
        validate_path(op.path)
    return checked


def _ancestors_and_self(path: str) -> list[str]:
    """``/a/b`` → ``['/', '/a', '/a/b']``."""
    if path == "/":
        return ["/"]
    out = ["/"]
    end = 0
    while True:
        end = path.find("/", end + 1)
        if end == -1:
            out.append(path)
            return out
        out.append(path[:end])


# --- watches --------------------------------------------------------------------


class Watcher(AsyncIterator[WatchEvent]):
    """The iterator handed out by ``store.watch(...)``; created by :class:`WatchHub`."""

    def __init__(self, path: str, prefix: bool, buffer_size: int) -> None:
        self.path = path
        self.prefix = prefix
        self._send, self._receive = trio.open_memory_channel[WatchEvent](buffer_size)
        self._error: str | None = None

    def _deliver(self, event: WatchEvent) -> None:
        if self._error is not None:
            return
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            n = self._send.statistics().current_buffer_used
            self._fail(f"watch on {self.path!r} overflowed ({n} unread events): later events lost")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def _fail(self, message: str) -> None:
        if self._error is None:
            self._error = message
            self._send.close()

    def _close(self) -> None:
        self._send.close()
        self._receive.close()

    @property
    def buffered(self) -> int:
        return self._send.statistics().current_buffer_used

    def __aiter__(self) -> Watcher:
        return self

    async def __anext__(self) -> WatchEvent:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            if self._error is not None:
                raise MetadataError(self._error) from None
            raise StopAsyncIteration from None


@dataclass(frozen=True)
class WatchHubStatistics:
    watchers: int
    buffered_events: int


class WatchHub:
    """Fan-out of :class:`WatchEvent` to watchers, each with a bounded buffer.

    Backends call :meth:`dispatch` (synchronously, in the trio thread — from a client
    library's thread through ``trio.from_thread.run_sync``) once per committed change,
    in commit order; :meth:`subscribe` inside ``watch()``'s ``__aenter__`` and
    :meth:`unsubscribe` in its ``__aexit__``.  Dispatch costs O(depth of the path), not
    O(watchers).
    """

    def __init__(self, buffer_size: int = DEFAULT_WATCH_BUFFER) -> None:
        if buffer_size < 1:
            raise InvalidArgument("watch buffer size must be >= 1")
        self.buffer_size = buffer_size
        self._exact: dict[str, list[Watcher]] = {}
        self._prefix: dict[str, list[Watcher]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def subscribe(self, path: str, *, prefix: bool = False) -> Watcher:
        watcher = Watcher(validate_path(path), prefix, self.buffer_size)
        table = self._prefix if prefix else self._exact
        table.setdefault(path, []).append(watcher)
        self._count += 1
        return watcher

    def unsubscribe(self, watcher: Watcher) -> None:
        table = self._prefix if watcher.prefix else self._exact
        watchers = table.get(watcher.path, [])
        if watcher in watchers:
            watchers.remove(watcher)
            self._count -= 1
            if not watchers:
                del table[watcher.path]
        watcher._close()

    def dispatch(self, event: WatchEvent) -> None:
        for watcher in self._exact.get(event.path, ()):
            watcher._deliver(event)
        if self._prefix:
            for ancestor in _ancestors_and_self(event.path):
                for watcher in self._prefix.get(ancestor, ()):
                    watcher._deliver(event)

    def fail_all(self, message: str) -> None:
        """End every current watcher with ``MetadataError(message)`` once its buffered
        events are read, and forget them (the store closed, or events were lost)."""
        for table in (self._exact, self._prefix):
            for watchers in table.values():
                for watcher in watchers:
                    watcher._fail(message)
            table.clear()
        self._count = 0

    def statistics(self) -> WatchHubStatistics:
        buffered = sum(
            w.buffered for table in (self._exact, self._prefix) for ws in table.values() for w in ws
        )
        return WatchHubStatistics(watchers=self._count, buffered_events=buffered)


# --- the abstract store ---------------------------------------------------------


class MetadataStore(abc.ABC):
    """A hierarchical key-value store with versions, sessions and watches.

    A store is a trio service: ``await nursery.start(store.run)`` connects (or opens)
    and starts a session; every other method needs the store running.  Paths, versions,
    sequential nodes and watches follow the rules in this module's docstring.

    A session owns the ephemeral nodes created through the store.  It ends when the store
    closes (``run`` returns) and may *expire* earlier (a missed keepalive, a network
    partition, a forced expiry in tests): its ephemeral nodes are deleted,
    :meth:`wait_session_expired` returns, and ephemeral creates raise ``SessionExpired``
    until :meth:`new_session` is called.  Persistent reads and writes keep working.
    """

    #: Seconds without keepalive after which the session expires.
    session_timeout: float
    #: Unread events a watcher may hold before it fails with ``MetadataError``.
    watch_buffer: int = DEFAULT_WATCH_BUFFER

    @abc.abstractmethod
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open/connect, start a session, call ``task_status.started()``, serve until
        cancelled; on exit end the session (ephemeral nodes are deleted) and close."""

    @abc.abstractmethod
    async def get(self, path: str) -> Stat | None:
        """The node at ``path``, or ``None`` if there is none."""

    async def exists(self, path: str) -> bool:
        return await self.get(path) is not None

    @abc.abstractmethod
    async def create(
        self, path: str, value: bytes = b"", *, ephemeral: bool = False, sequential: bool = False
    ) -> str:
        """Create a node (and its missing parents); return its path.

        Raises ``NodeExists``; ``SessionExpired`` for an ephemeral node while the
        session is expired; ``InvalidArgument`` for a bad path or a parent that is
        ephemeral.
        """

    @abc.abstractmethod
    async def set(self, path: str, value: bytes, *, version: int | None = None) -> int:
        """Replace the value; return the new version.  ``version`` makes it a
        compare-and-set (``BadVersion`` on mismatch).  ``NoSuchNode`` if absent."""

    @abc.abstractmethod
    async def delete(
        self, path: str, *, version: int | None = None, recursive: bool = False
    ) -> None:
        """Delete a node.  ``NoSuchNode``, ``BadVersion`` (checked on ``path`` only),
        ``NotEmpty`` if it has children and ``recursive`` is false."""

    @abc.abstractmethod
    async def children(self, path: str) -> list[str]:
        """Sorted names (not paths) of the children; ``[]`` if ``path`` does not exist."""

    @abc.abstractmethod
    async def multi(self, ops: list[Op]) -> list[object]:
        """Apply ``ops`` in order, atomically: all of them or none.  Raises the error of
        the first op that fails; see :class:`Op` for the results."""

    @abc.abstractmethod
    def watch(
        self, path: str, *, prefix: bool = False
    ) -> AbstractAsyncContextManager[AsyncIterator[WatchEvent]]:
        """``async with store.watch(path) as events: async for event in events: ...``

        The watch is established when ``__aenter__`` returns."""

    @abc.abstractmethod
    async def wait_session_expired(self) -> None:
        """Return once the current session has expired or ended (its ephemeral nodes
        are gone).  Returns at once if it already has."""

    @abc.abstractmethod
    async def new_session(self) -> None:
        """End the current session if it is still alive (deleting its ephemeral nodes)
        and start a new one."""


def check_timeout(value: float, name: str) -> float:
    """``value`` as a float if it is a positive, finite number of seconds (a store's
    ``session_timeout``, ``request_timeout``...), else InvalidArgument naming ``name``."""
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise InvalidArgument(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


#: the name plugins released before :func:`check_timeout` was public import
_check_timeout = check_timeout

"""The ZooKeeper metadata store (kazoo, bridged into trio).

Threading
    kazoo runs a connection thread and a completion thread.  Every request is sent with
    a kazoo ``*_async`` call from the trio thread (it only queues the request) and its
    ``IAsyncResult`` is linked back with a trio token (``run_sync_soon``), so no worker
    thread waits on ZooKeeper; only ``start``/``stop`` of the client run in
    ``trio.to_thread``.  Watch and state callbacks come back the same way.

Writes
    :class:`~pigeon.core.metadata.TransactionalMetadataStore` validates and plans them;
    every write is one ZooKeeper multi (:mod:`pigeon_zookeeper._plan`): the ops
    themselves, version checks on everything the plan read, and one change-log entry
    listing the events.  A multi that fails because something changed since the reads is
    re-read and re-planned (at most :attr:`ZooKeeperMetadataStore.max_attempts` times).
    A request that may or may not have been applied (the connection dropped while it was
    in flight) raises ``MetadataError``.

Watches
    A store with watchers follows the change log from the position it had when the
    first watcher subscribed: it reads entry after entry of the current bucket, and when
    it reaches the end it sets one-shot ZooKeeper watches on the next entry and on the
    bucket pointer.  Events reach watchers through :class:`~pigeon.core.metadata.WatchHub`
    in commit order, with the values they had.  Because the log is durable, watchers
    survive disconnects and session expiry; a watcher only fails if the log it still
    needed was trimmed (after :attr:`ZooKeeperMetadataStore.log_retention` seconds).

Sessions
    The store's session is its ZooKeeper session.  kazoo reports ``LOST`` when
    ZooKeeper says the session expired: :meth:`wait_session_expired` returns, ephemeral
    creates raise ``SessionExpired`` (kazoo has meanwhile connected with a fresh
    session) until :meth:`new_session` registers the new one.  ZooKeeper deletes the
    expired session's ephemeral nodes itself; a reaper in every live store then logs
    their deletion from the session's index (``C/sessions/<sid>``), so watchers see it.
    Closing the store or calling :meth:`new_session` on a live session deletes its
    ephemeral nodes explicitly first (logged, with versions) and then closes the
    ZooKeeper session.
"""

from __future__ import annotations

import logging
import math
import random
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadArgumentsError,
    BadVersionError,
    ConnectionClosedError,
    ConnectionLoss,
    KazooException,
    NodeExistsError,
    NoNodeError,
    RolledBackError,
    SessionExpiredError,
)
from kazoo.protocol.states import ZnodeStat
from kazoo.retry import KazooRetry

from pigeon.core.errors import (
    ConfigError,
    CorruptFrame,
    InvalidArgument,
    MetadataError,
    NoSuchNode,
    PigeonError,
    SessionExpired,
)
from pigeon.core.metadata import (
    DEFAULT_WATCH_BUFFER,
    Create,
    Delete,
    EventType,
    NeedRead,
    Op,
    StaleRead,
    Stat,
    TransactionalMetadataStore,
    Watcher,
    WatchEvent,
    WatchHub,
    WriteOp,
    check_timeout,
    first_reads,
    parse_server_url,
    validate_path,
)
from pigeon_zookeeper._plan import (
    Layout,
    NeedIndexRead,
    NodeInfo,
    Plan,
    Snapshot,
    ZkOp,
    decode_entry,
    encode_entry,
    plan,
    sid_hex,
    sid_int,
)

__all__ = ["ZooKeeperMetadataStore", "ZooKeeperStoreStatistics"]

log = logging.getLogger(__name__)

DEFAULT_CHROOT = "/pigeon"
DEFAULT_PORT = 2181
#: ZooKeeper refuses requests above jute.maxbuffer (1 MiB by default); stay below it.
MAX_REQUEST_BYTES = 1000 * 1024
_READ_AHEAD_MAX = 32
_REAP_CHUNK = 200
_DELETE_CHUNK = 500
#: Data of a log bucket whose entries are being deleted.
_TRIMMED = b"trimmed"


@dataclass(frozen=True)
class ZooKeeperStoreStatistics:
    running: bool
    connected: bool
    session_id: str | None
    session_alive: bool
    watchers: int
    buffered_events: int
    #: (bucket, entry) of the next change-log entry the watchers will read, or None
    log_position: tuple[int, int] | None


@dataclass
class _Outcome:
    ok: bool
    results: list[Any]
    index: int = -1
    error: BaseException | None = None


def _first_error(results: list[Any]) -> tuple[int, BaseException]:
    for i, result in enumerate(results):
        if isinstance(result, BaseException) and not isinstance(result, RolledBackError):
            return i, result
    for i, result in enumerate(results):  # only rollbacks: report the first
        if isinstance(result, BaseException):
            return i, result
    return -1, MetadataError("multi failed without an error")


class ZooKeeperMetadataStore(TransactionalMetadataStore[Snapshot, Plan]):
    """:class:`~pigeon.core.metadata.MetadataStore` on ZooKeeper (3.5 or later).

    :param hosts: ``host:port[,host:port...]``.
    :param chroot: the znode under which the store keeps everything (default
        ``/pigeon``); several independent stores may share one ensemble with different
        chroots.
    :param session_timeout: requested ZooKeeper session timeout in seconds (the server
        clamps it to 2 to 20 ``tickTime``).
    :param connect_timeout: how long :meth:`run` waits for the first connection.
    :param request_timeout: how long one call waits for a connection and an answer.
    :param watch_buffer: unread events a watcher may hold before it fails.
    """

    #: Entries per change-log bucket (a new bucket starts when one is full).
    log_bucket_size = 1000
    #: A closed bucket is kept this long (seconds) for slow watchers, then trimmed.
    log_retention = 120.0
    #: How often (seconds, jittered) a store looks for log buckets to trim.
    trim_interval = 30.0

    def __init__(
        self,
        hosts: str,
        chroot: str = DEFAULT_CHROOT,
        *,
        session_timeout: float = 10.0,
        connect_timeout: float = 15.0,
        request_timeout: float = 30.0,
        watch_buffer: int = DEFAULT_WATCH_BUFFER,
    ) -> None:
        if not hosts:
            raise InvalidArgument("ZooKeeper metadata store needs hosts")
        if chroot == "/" or not chroot:
            raise InvalidArgument("the ZooKeeper chroot must not be '/'")
        self.hosts = hosts
        self.chroot = validate_path(chroot)
        self.session_timeout = check_timeout(session_timeout, "session_timeout")
        self.connect_timeout = check_timeout(connect_timeout, "connect_timeout")
        self.request_timeout = check_timeout(request_timeout, "request_timeout")
        self.watch_buffer = watch_buffer
        self._layout = Layout(self.chroot)
        self._hub = WatchHub(watch_buffer)
        self._zk: KazooClient | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._connected = False
        self._state_changed = trio.Event()
        self._closing = False
        # session
        self._sid: str | None = None
        self._session_alive = False
        self._session_ended = trio.Event()
        self._session_ended.set()
        # change log
        self._bucket: int | None = None
        self._bucket_version = 0
        self._cursor: tuple[int, int] | None = None
        self._cursor_moved = trio.Event()
        self._follow_wake = trio.Event()
        self._subscribing = 0
        self._reap_wake = trio.Event()

    @classmethod
    def from_url(cls, url: str) -> ZooKeeperMetadataStore:
        """Build a store from ``zk://host:port[,host:port]/chroot?options``.

        The chroot defaults to ``/pigeon``.  Options (seconds): ``session_timeout``
        (10), ``connect_timeout`` (15), ``request_timeout`` (30).
        """
        parsed = parse_server_url(
            url,
            scheme="zk",
            server="ZooKeeper",
            default_port=DEFAULT_PORT,
            default_path=DEFAULT_CHROOT,
            path_name="chroot",
            options=("session_timeout", "connect_timeout", "request_timeout"),
        )
        try:
            return cls(",".join(parsed.hosts), parsed.path, **parsed.options)
        except InvalidArgument as exc:
            raise ConfigError(f"metadata URL {url!r}: {exc}") from None

    def __repr__(self) -> str:
        return f"<ZooKeeperMetadataStore {self.hosts}{self.chroot} session={self._sid}>"

    @property
    def session_id(self) -> str | None:
        """The current ZooKeeper session id (16 hex digits) while the session is alive."""
        return self._sid if self._session_alive else None

    @property
    def session_alive(self) -> bool:
        return self._session_alive

    def statistics(self) -> ZooKeeperStoreStatistics:
        hub = self._hub.statistics()
        return ZooKeeperStoreStatistics(
            running=self._zk is not None,
            connected=self._connected,
            session_id=self.session_id,
            session_alive=self._session_alive,
            watchers=hub.watchers,
            buffered_events=hub.buffered_events,
            log_position=self._cursor,
        )

    # --- bridging kazoo into trio ------------------------------------------------------

    def _soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` in the trio thread soon; callable from any thread."""
        token = self._token
        if token is None:
            return
        try:
            token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    async def _await(self, result: Any) -> Any:
        done = trio.Event()
        result.rawlink(lambda _: self._soon(done.set))
        await done.wait()
        return result.get_nowait()

    def _require(self) -> KazooClient:
        if self._zk is None:
            raise MetadataError(f"{self!r} is not running")
        return self._zk

    async def _wait_connected(self) -> KazooClient:
        self._require()
        with trio.move_on_after(self.request_timeout):
            while not self._connected:
                await self._state_changed.wait()
            return self._require()
        raise MetadataError(
            f"not connected to ZooKeeper at {self.hosts} for {self.request_timeout}s"
        )

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``zk.<method>_async(*args)`` once connected; kazoo errors as they are."""
        zk = await self._wait_connected()
        result = getattr(zk, method + "_async")(*args, **kwargs)
        with trio.move_on_after(self.request_timeout):
            return await self._await(result)
        raise MetadataError(f"ZooKeeper did not answer {method} in {self.request_timeout}s")

    async def _gather(self, calls: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Send several requests at once (pipelined); results or exceptions, in order."""
        zk = await self._wait_connected()
        pending = [getattr(zk, method + "_async")(*args) for method, args in calls]
        out: list[Any] = []
        with trio.move_on_after(self.request_timeout):
            for result in pending:
                try:
                    out.append(await self._await(result))
                except KazooException as exc:
                    out.append(exc)
            return out
        raise MetadataError(f"ZooKeeper did not answer in {self.request_timeout}s")

    async def _gather_reads(self, calls: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """:meth:`_gather` for read-only calls, repeated when the connection drops between
        the connected check and the answer (a server going away), within the timeout."""
        with trio.move_on_after(self.request_timeout):
            while True:
                results = await self._gather(calls)
                if not any(isinstance(r, ConnectionLoss) for r in results):
                    return results
                await trio.sleep(0.1)  # _gather waits for the reconnection
        raise MetadataError(f"ZooKeeper connection lost for {self.request_timeout}s")

    @staticmethod
    def _error(exc: BaseException, what: str) -> PigeonError:
        if isinstance(exc, PigeonError):
            return exc
        if isinstance(exc, BadArgumentsError):
            return InvalidArgument(f"{what}: ZooKeeper refused the path ({exc!r})")
        if isinstance(exc, SessionExpiredError):
            return MetadataError(f"{what}: the ZooKeeper session expired during the request")
        return MetadataError(f"{what}: {type(exc).__name__} {exc}".rstrip())

    # --- lifecycle ------------------------------------------------------------------------

    def _listener(self, client: KazooClient) -> Callable[[str], None]:
        def listener(state: str) -> None:  # in a kazoo thread
            self._soon(self._on_state, client, state)

        return listener

    def _on_state(self, client: KazooClient, state: str) -> None:
        if client is not self._zk:
            return
        self._connected = state == KazooState.CONNECTED
        self._state_changed.set()
        self._state_changed = trio.Event()
        if state == KazooState.LOST and not self._closing and self._session_alive:
            log.warning("%r: ZooKeeper session expired", self)
            self._mark_session_ended()
        self._follow_wake.set()
        self._reap_wake.set()

    def _mark_session_ended(self) -> None:
        self._session_alive = False
        self._session_ended.set()

    async def _start_client(self) -> KazooClient:
        # kazoo waits session_timeout / len(hosts) for a connect handshake.  A ZooKeeper
        # that is starting accepts connections it does not answer; waiting the whole
        # session timeout on one of them lets the session expire.  Listing each host
        # (at least) three times makes kazoo give up on such a connection after a third
        # of the session timeout and try again.
        hosts = self.hosts.split(",")
        kazoo_hosts = ",".join(hosts * math.ceil(3 / len(hosts)))
        client = KazooClient(
            hosts=kazoo_hosts,
            timeout=self.session_timeout,
            connection_retry=KazooRetry(max_tries=-1, delay=0.05, backoff=1.5, max_delay=1.0),
            logger=logging.getLogger("kazoo.client"),
        )
        client.add_listener(self._listener(client))
        self._zk = client
        self._connected = False
        try:
            await trio.to_thread.run_sync(
                lambda: client.start(timeout=self.connect_timeout), abandon_on_cancel=True
            )
        except Exception as exc:
            self._zk = None
            await trio.to_thread.run_sync(_stop_quietly, client, abandon_on_cancel=True)
            raise MetadataError(f"cannot connect to ZooKeeper at {self.hosts}: {exc}") from exc
        self._connected = client.connected
        self._state_changed.set()
        self._state_changed = trio.Event()
        return client

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self._zk is not None:
            raise MetadataError(f"{self!r} is already running")
        self._token = trio.lowlevel.current_trio_token()
        self._hub = WatchHub(self.watch_buffer)
        self._closing = False
        self._cursor = None
        self._bucket = None
        try:
            await self._start_client()
            await self._ensure_layout()
            await self._register_session()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._follow_loop)
                nursery.start_soon(self._reap_loop)
                nursery.start_soon(self._trim_loop)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self._close()

    async def _close(self) -> None:
        client = self._zk
        if client is None:
            return
        try:
            if self._session_alive and self._connected:
                with trio.move_on_after(min(self.request_timeout, 10.0)):
                    await self._end_session()
        except MetadataError as exc:
            log.warning("%r: could not remove the session's nodes on close: %s", self, exc)
        finally:
            self._closing = True
            self._mark_session_ended()
            self._hub.fail_all("metadata store closed")
            self._zk = None
            self._connected = False
            self._cursor = None
            with trio.move_on_after(10.0):
                await trio.to_thread.run_sync(_stop_quietly, client, abandon_on_cancel=True)

    async def _ensure_layout(self) -> None:
        lay = self._layout
        parts = self.chroot.strip("/").split("/")
        paths = ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
        paths += [lay.tree, lay.seq_dir, lay.sessions, lay.alive]
        results = await self._gather([("create", (p, b"")) for p in paths])
        for path, result in zip(paths, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, NodeExistsError):
                raise self._error(result, f"creating {path}")
        zk = await self._wait_connected()
        txn = zk.transaction()
        txn.create(lay.log, b"0")
        txn.create(lay.bucket(0), b"")
        await self._await(txn.commit_async())  # fails harmlessly if the log exists

    # --- sessions -------------------------------------------------------------------------

    async def _register_session(self) -> None:
        zk = await self._wait_connected()
        client_id = zk.client_id
        if client_id is None:
            raise MetadataError("ZooKeeper connection lost while starting a session")
        sid = sid_hex(client_id[0])
        txn = zk.transaction()
        txn.create(self._layout.session(sid), b"")
        txn.create(self._layout.alive_marker(sid), b"", ephemeral=True)
        try:
            results = await self._await(txn.commit_async())
        except KazooException as exc:
            raise self._error(exc, "starting a session") from exc
        if any(isinstance(r, BaseException) for r in results):
            _, error = _first_error(results)
            if not isinstance(error, NodeExistsError):
                raise self._error(error, "starting a session")
        self._sid = sid
        self._session_alive = True
        self._session_ended = trio.Event()
        log.debug("%r: session started", self)

    async def _end_session(self) -> None:
        """Delete this session's ephemeral nodes (logged) and its registration."""
        sid = self._sid
        if sid is not None and self._session_alive:
            await self._reap(sid, own=True)
        self._mark_session_ended()

    async def wait_session_expired(self) -> None:
        await self._session_ended.wait()

    async def new_session(self) -> None:
        self._require()
        if self._session_alive:
            await self._end_session()
            client = self._require()
            self._closing = True
            try:
                await trio.to_thread.run_sync(_stop_quietly, client, abandon_on_cancel=True)
            finally:
                self._closing = False
            self._zk = None
            await self._start_client()
        await self._register_session()
        self._reap_wake.set()  # the old session's nodes are logged as deleted soon

    async def expire_session(self) -> None:
        """Make this store's session end now, as an expiry would: its ephemeral nodes
        go, :meth:`wait_session_expired` returns, the store goes on with a new
        (unregistered) ZooKeeper session.  For tests and forced fail-over.

        It first tries the standard way (a second client takes over the session id and
        closes it, so the store sees ZooKeeper's own expiry); if the store's client keeps
        winning the session back, it closes the session itself and reconnects."""
        zk = await self._wait_connected()
        client_id = zk.client_id
        if client_id is None or not self._session_alive:
            await trio.lowlevel.checkpoint()
            return
        ended = self._session_ended

        def take_over_and_close() -> None:
            other = KazooClient(hosts=self.hosts, client_id=client_id, timeout=self.session_timeout)
            try:
                other.start(timeout=min(self.connect_timeout, 5.0))
            finally:
                _stop_quietly(other)

        with trio.fail_after(self.request_timeout):
            for _attempt in range(3):
                try:
                    await trio.to_thread.run_sync(take_over_and_close, abandon_on_cancel=True)
                except Exception as exc:  # the two clients fought over the session
                    log.debug("%r: taking over the session failed: %r", self, exc)
                with trio.move_on_after(1.0):
                    await ended.wait()
                    return
            log.debug("%r: closing the session from this client", self)
            await trio.to_thread.run_sync(_stop_quietly, zk, abandon_on_cancel=True)
            await ended.wait()  # kazoo reported LOST for it
            if self._zk is zk:
                await self._start_client()

    # --- change log: writing --------------------------------------------------------------

    async def _refresh_pointer(self) -> None:
        try:
            data, stat = await self._call("get", self._layout.log)
        except KazooException as exc:
            raise self._error(exc, "reading the change-log pointer") from exc
        self._bucket = int(data)
        self._bucket_version = stat.version

    async def _commit(self, ops: list[ZkOp], events: list[WatchEvent]) -> _Outcome:
        """One multi: pointer check, log entry, ``ops``.  Results exclude the first two."""
        if self._bucket is None:
            await self._refresh_pointer()
        assert self._bucket is not None
        zk = await self._wait_connected()
        lay = self._layout
        txn = zk.transaction()
        txn.check(lay.log, self._bucket_version)
        txn.create(lay.entry_prefix(self._bucket), encode_entry(events), sequence=True)
        for op in ops:
            if op.kind == "create":
                txn.create(op.path, op.data, ephemeral=op.ephemeral)
            elif op.kind == "set":
                txn.set_data(op.path, op.data, version=op.version)
            elif op.kind == "delete":
                txn.delete(op.path, version=op.version)
            else:
                txn.check(op.path, op.version)
        result = txn.commit_async()
        with trio.move_on_after(self.request_timeout):
            results = await self._await(result)
            if any(isinstance(r, BaseException) for r in results):
                index, error = _first_error(results)
                if index < 2:
                    self._bucket = None  # re-read the pointer before the next attempt
                return _Outcome(False, [], index - 2, error)
            entry = results[1]
            number = int(entry.rsplit("-", 1)[1])
            if number + 1 >= self.log_bucket_size:
                await self._advance_bucket()
            return _Outcome(True, results[2:])
        raise MetadataError(f"ZooKeeper did not answer a write in {self.request_timeout}s")

    async def _advance_bucket(self) -> None:
        bucket = self._bucket
        if bucket is None:
            return
        zk = await self._wait_connected()
        txn = zk.transaction()
        txn.set_data(self._layout.log, str(bucket + 1).encode(), version=self._bucket_version)
        txn.create(self._layout.bucket(bucket + 1), b"")
        try:
            await self._await(txn.commit_async())
        except KazooException as exc:
            log.debug("%r: advancing the log bucket failed: %r", self, exc)
        self._bucket = None

    async def _read(self, need: NeedRead, snap: Snapshot) -> None:
        lay = self._layout
        calls: list[tuple[str, tuple[Any, ...]]] = []
        keys: list[tuple[str, Any]] = []
        for path in need.nodes:
            calls.append(("exists", (lay.node(path),)))
            keys.append(("node", path))
        for path in need.nodes | need.counters:
            if path not in snap.counters:
                calls.append(("exists", (lay.seq(path),)))
                keys.append(("counter", path))
        for path in need.children:
            calls.append(("get_children", (lay.node(path),)))
            keys.append(("children", path))
        for sid, path in need.index if isinstance(need, NeedIndexRead) else ():
            calls.append(("exists", (lay.index(sid, path),)))
            keys.append(("index", (sid, path)))
        results = await self._gather_reads(calls)
        more: set[str] = set()
        for (kind, key), result in zip(keys, results, strict=True):
            if isinstance(result, NoNodeError):
                result = [] if kind == "children" else None
            elif isinstance(result, BaseException):
                raise self._error(result, "reading metadata")
            if kind == "node":
                snap.nodes[key] = _info(result)
            elif kind == "counter":
                snap.counters[key] = None if result is None else result.version
            elif kind == "children":
                snap.children[key] = list(result)
                more.update(f"{key.rstrip('/')}/{name}" for name in result)
            else:
                snap.index[key] = result is not None
        more -= snap.nodes.keys()
        if more:  # the planner will want the children next: read them now
            await self._read(NeedRead(nodes=more), snap)

    def _new_snapshot(self) -> Snapshot:
        return Snapshot()

    def _plan(self, ops: Sequence[WriteOp], snapshot: Snapshot) -> Plan:
        return plan(self._layout, ops, snapshot, self._sid if self._session_alive else None)

    async def _commit_plan(self, ops: Sequence[WriteOp], the_plan: Plan) -> list[object]:
        if the_plan.size() > MAX_REQUEST_BYTES:
            raise InvalidArgument(
                f"metadata write of ~{the_plan.size()} bytes is too large for ZooKeeper"
                f" (at most {MAX_REQUEST_BYTES} bytes per write, values included twice)"
            )
        try:
            outcome = await self._commit(the_plan.ops, the_plan.events)
        except KazooException as exc:
            if isinstance(exc, SessionExpiredError) and any(
                isinstance(op, Create | Op) and op.ephemeral for op in ops
            ):
                raise SessionExpired("the ZooKeeper session expired") from exc
            raise self._error(exc, "metadata write") from exc
        if outcome.ok:
            return the_plan.results
        failed = the_plan.ops[outcome.index] if 0 <= outcome.index < len(the_plan.ops) else None
        if (
            failed is not None
            and self._sid is not None
            and failed.path == self._layout.alive_marker(self._sid)
        ):
            raise SessionExpired("the ZooKeeper session expired")
        if isinstance(outcome.error, BadArgumentsError):
            raise self._error(outcome.error, "metadata write")
        if isinstance(outcome.error, SessionExpiredError | ConnectionClosedError):
            raise self._error(outcome.error, "metadata write")
        raise StaleRead(repr(outcome.error))  # something the plan read changed: again

    # --- reads ----------------------------------------------------------------------------

    async def get(self, path: str) -> Stat | None:
        validate_path(path)
        try:
            value, stat = await self._call("get", self._layout.node(path))
        except NoNodeError:
            return None
        except KazooException as exc:
            raise self._error(exc, f"get {path}") from exc
        return Stat(
            bytes(value), stat.version, stat.ephemeralOwner != 0, stat.ctime / 1e3, stat.mtime / 1e3
        )

    async def children(self, path: str) -> list[str]:
        validate_path(path)
        try:
            names = await self._call("get_children", self._layout.node(path))
        except NoNodeError:
            return []
        except KazooException as exc:
            raise self._error(exc, f"children of {path}") from exc
        return sorted(names)

    # --- writes ---------------------------------------------------------------------------

    async def _delete_tree(self, path: str, version: int | None) -> None:
        ops = [Delete(path, version, recursive=True)]
        for _attempt in range(self.max_attempts):
            the_plan = await self._plan_reading(ops, first_reads(ops))
            if the_plan.size() > MAX_REQUEST_BYTES or len(the_plan.ops) > 4 * _DELETE_CHUNK:
                await self._delete_in_chunks(path, version)
                return
            outcome = await self._commit(the_plan.ops, the_plan.events)
            if outcome.ok:
                return
            await trio.sleep(0.002 * random.random())
        raise MetadataError(
            f"recursive delete of {path} gave up after {self.max_attempts} attempts"
        )

    async def _delete_in_chunks(self, path: str, version: int | None) -> None:
        """A subtree too large for one multi: children first, in several multis."""
        names = await self.children(path)
        leaves: list[str] = []
        for name in names:
            child = f"{path.rstrip('/')}/{name}"
            if await self.children(child):
                await self.delete(child, recursive=True)
            else:
                leaves.append(child)
        for i in range(0, len(leaves), _DELETE_CHUNK):
            chunk = leaves[i : i + _DELETE_CHUNK]
            try:
                await self._transact([Op.delete(leaf) for leaf in chunk])
            except MetadataError:  # someone else deleted some: one by one
                for leaf in chunk:
                    try:
                        await self.delete(leaf, recursive=True)
                    except NoSuchNode:
                        pass
        await self.delete(path, version=version, recursive=True)

    # --- change log: following ------------------------------------------------------------

    def _wake_follower(self, _event: object = None) -> None:  # kazoo thread
        self._soon(self._follow_wake.set)

    async def _log_end(self) -> tuple[int, int]:
        try:
            data, _ = await self._call("get", self._layout.log)
            bucket = int(data)
            stat = await self._call("exists", self._layout.bucket(bucket))
        except KazooException as exc:
            raise self._error(exc, "reading the change log") from exc
        return bucket, (stat.numChildren if stat is not None else 0)

    def _set_cursor(self, position: tuple[int, int] | None) -> None:
        self._cursor = position
        self._cursor_moved.set()
        self._cursor_moved = trio.Event()

    async def _follow_loop(self) -> None:
        ahead = 1
        failures = 0
        while True:
            if not self._hub and not self._subscribing:
                if self._cursor is not None:
                    self._set_cursor(None)
                self._follow_wake = trio.Event()
                await self._follow_wake.wait()
                continue
            if self._cursor is None:
                await trio.sleep(0.01)  # a subscriber is setting it
                continue
            try:
                ahead = await self._follow_step(ahead)
                failures = 0
            except (MetadataError, KazooException) as exc:
                failures += 1
                log.debug("%r: reading the change log failed: %r", self, exc)
                with trio.move_on_after(min(0.05 * 2**failures, 1.0)):
                    self._follow_wake = trio.Event()
                    await self._follow_wake.wait()

    async def _follow_step(self, ahead: int) -> int:
        """Read what is there; if nothing, wait for a change.  Returns the next read-ahead."""
        assert self._cursor is not None
        bucket, seq = self._cursor
        lay = self._layout
        self._follow_wake = trio.Event()
        results = await self._gather([("get", (lay.entry(bucket, seq + i),)) for i in range(ahead)])
        read = 0
        for result in results:
            if self._cursor != (bucket, seq):
                return 1  # moved under us (reset)
            if isinstance(result, NoNodeError):
                break
            if isinstance(result, BaseException):
                raise result
            data, _ = result
            try:
                events = decode_entry(data)
            except CorruptFrame:
                log.exception("%r: corrupt change-log entry %d/%d", self, bucket, seq)
                self._hub.fail_all(f"metadata change log entry {bucket}/{seq} is corrupt")
                events = []
            for event in events:
                self._hub.dispatch(event)
            seq += 1
            read += 1
            self._set_cursor((bucket, seq))
        if read == ahead:
            return min(ahead * 2, _READ_AHEAD_MAX)
        if read:
            return 1
        # nothing new: watch the next entry and the pointer, then look once more
        entry = lay.entry(bucket, seq)
        if await self._call("exists", entry, watch=self._wake_follower) is not None:
            return 1
        data, _ = await self._call("get", lay.log, watch=self._wake_follower)
        if int(data) > bucket:
            if await self._call("exists", entry) is not None:
                return 1
            try:
                marker, _ = await self._call("get", lay.bucket(bucket))
            except NoNodeError:
                marker = _TRIMMED
            if marker == _TRIMMED:
                self._lost_log(f"change-log bucket {bucket} was trimmed")
                return 1
            self._set_cursor((bucket + 1, 0))
            return 1
        with trio.move_on_after(30.0):  # a lost notification costs at most this much
            await self._follow_wake.wait()
        return 1

    def _lost_log(self, why: str) -> None:
        log.warning("%r: watchers fell behind the change log (%s)", self, why)
        self._hub.fail_all(f"metadata watch fell behind the change log ({why}); events lost")
        self._set_cursor(None)

    @asynccontextmanager
    async def _watch(self, path: str, prefix: bool) -> AsyncIterator[Watcher]:
        await trio.lowlevel.checkpoint()
        self._require()
        self._subscribing += 1
        try:
            target = await self._log_end()
            with trio.move_on_after(self.request_timeout) as scope:
                while self._cursor is not None and self._cursor < target:
                    self._follow_wake.set()
                    await self._cursor_moved.wait()
            if scope.cancelled_caught:
                raise MetadataError("the change log follower did not catch up")
            if self._cursor is None:
                self._set_cursor(target)
            watcher = self._hub.subscribe(path, prefix=prefix)
        finally:
            self._subscribing -= 1
        self._follow_wake.set()
        try:
            yield watcher
        finally:
            self._hub.unsubscribe(watcher)

    # --- reaping expired sessions ---------------------------------------------------------

    def _wake_reaper(self, _event: object = None) -> None:  # kazoo thread
        self._soon(self._reap_wake.set)

    async def _reap_loop(self) -> None:
        failures = 0
        while True:
            self._reap_wake = trio.Event()
            try:
                sessions = await self._call("get_children", self._layout.sessions)
                alive = await self._call(
                    "get_children", self._layout.alive, watch=self._wake_reaper
                )
                for sid in sorted(set(sessions) - set(alive)):
                    await self._reap(sid)
                failures = 0
                timeout = 60.0
            except (MetadataError, KazooException) as exc:
                failures += 1
                log.debug("%r: reaping sessions failed: %r", self, exc)
                timeout = min(0.05 * 2**failures, 2.0)
            with trio.move_on_after(timeout):
                await self._reap_wake.wait()

    async def _reap(self, sid: str, *, own: bool = False) -> None:
        """Log (and, for our own live session, perform) the deletion of a session's
        ephemeral nodes, then remove the session's registration."""
        lay = self._layout
        owner = sid_int(sid)
        for _attempt in range(self.max_attempts):
            try:
                names = await self._call("get_children", lay.session(sid))
            except NoNodeError:
                return
            except KazooException as exc:
                raise self._error(exc, f"reaping session {sid}") from exc
            chunk = sorted(names, reverse=True)[:_REAP_CHUNK]
            paths = [urllib.parse.unquote(name) for name in chunk]
            found = await self._gather([("get", (lay.node(p),)) for p in paths])
            ops: list[ZkOp] = []
            events: list[WatchEvent] = []
            for path, result in zip(paths, found, strict=True):
                if isinstance(result, NoNodeError):
                    events.append(WatchEvent(EventType.DELETED, path, None, -1))
                elif isinstance(result, BaseException):
                    raise self._error(result, f"reaping session {sid}")
                else:
                    value, stat = result
                    if stat.ephemeralOwner == owner:
                        ops.append(ZkOp("delete", lay.node(path), version=stat.version))
                        events.append(WatchEvent(EventType.DELETED, path, None, stat.version))
                    else:  # deleted at expiry, then created again by someone else
                        events.append(WatchEvent(EventType.DELETED, path, None, -1))
                        events.append(
                            WatchEvent(EventType.CREATED, path, bytes(value), stat.version)
                        )
                ops.append(ZkOp("delete", lay.index(sid, path)))
            last = len(chunk) == len(names)
            if last:
                ops.append(ZkOp("delete", lay.session(sid)))
                if own:
                    ops.append(ZkOp("delete", lay.alive_marker(sid)))
            try:
                outcome = await self._commit(ops, events)
            except KazooException as exc:
                raise self._error(exc, f"reaping session {sid}") from exc
            if outcome.ok:
                if last:
                    log.debug("%r: session %s reaped", self, sid)
                    return
                continue
            if isinstance(outcome.error, NoNodeError | NodeExistsError | BadVersionError):
                await trio.sleep(0.002 * random.random())
                continue  # another reaper or a concurrent write: look again
            raise self._error(outcome.error or MetadataError("?"), f"reaping session {sid}")
        raise MetadataError(f"reaping session {sid} gave up after {self.max_attempts} attempts")

    # --- trimming the change log ----------------------------------------------------------

    async def _trim_loop(self) -> None:
        while True:
            await trio.sleep(self.trim_interval * random.uniform(0.5, 1.5))
            try:
                await self.trim_log()
            except (MetadataError, KazooException) as exc:
                log.debug("%r: trimming the change log failed: %r", self, exc)

    async def trim_log(self) -> int:
        """Delete change-log buckets closed more than :attr:`log_retention` seconds ago
        (every store does this now and then); return how many were deleted."""
        lay = self._layout
        data, _ = await self._call("get", lay.log)
        current = int(data)
        names = await self._call("get_children", lay.log)
        old = sorted(int(n) for n in names if n.isdigit() and int(n) < current - 1)
        now_ms = time.time() * 1e3
        trimmed = 0
        for bucket in old:
            successor = await self._call("exists", lay.bucket(bucket + 1))
            if successor is not None and now_ms - successor.ctime < self.log_retention * 1e3:
                continue
            try:
                # marked first: a watcher still reading it must not take it as complete
                await self._call("set", lay.bucket(bucket), _TRIMMED)
                entries = await self._call("get_children", lay.bucket(bucket))
            except NoNodeError:
                continue
            for i in range(0, len(entries), _DELETE_CHUNK):
                await self._gather(
                    [
                        ("delete", (f"{lay.bucket(bucket)}/{name}",))
                        for name in entries[i : i + _DELETE_CHUNK]
                    ]
                )
            await self._gather([("delete", (lay.bucket(bucket),))])
            trimmed += 1
        return trimmed


def _info(stat: ZnodeStat | None) -> NodeInfo:
    if stat is None:
        return NodeInfo(False)
    return NodeInfo(True, stat.version, stat.ephemeralOwner, stat.numChildren)


def _stop_quietly(client: KazooClient) -> None:
    try:
        client.stop()
    except Exception as exc:  # stopping a client that never connected, or twice
        log.debug("stopping a kazoo client: %r", exc)
    try:
        client.close()
    except Exception as exc:
        log.debug("closing a kazoo client: %r", exc)

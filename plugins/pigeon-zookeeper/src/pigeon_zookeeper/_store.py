"""The ZooKeeper metadata store (kazoo, bridged into trio).

Threading
    kazoo runs its own threads; requests and callbacks cross into trio as
    :mod:`pigeon_zookeeper._bridge` describes.  Only ``start``/``stop`` of the client run
    in ``trio.to_thread``.

Writes
    :class:`~pigeon.core.metadata.TransactionalMetadataStore` validates and plans them;
    every write is one ZooKeeper multi (:mod:`pigeon_zookeeper._plan`): the ops
    themselves, version checks on everything the plan read, and one change-log entry
    listing the events.  A multi that fails because something changed since the reads is
    re-read and re-planned (at most :attr:`ZooKeeperMetadataStore.max_attempts` times).
    A request that may or may not have been applied (the connection dropped while it was
    in flight) raises ``MetadataError``.

Watches
    Events come from the durable change log (:mod:`pigeon_zookeeper._changelog`) and
    reach watchers through :class:`~pigeon.core.metadata.WatchHub` in commit order, with
    the values they had.  Watchers survive disconnects and session expiry; a watcher only
    fails if the log it still needed was trimmed (after
    :attr:`ZooKeeperMetadataStore.log_retention` seconds).

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
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadArgumentsError,
    BadVersionError,
    ConnectionClosedError,
    KazooException,
    NodeExistsError,
    NoNodeError,
    SessionExpiredError,
)
from kazoo.protocol.states import ZnodeStat
from kazoo.retry import KazooRetry

from pigeon.core import metadata
from pigeon.core.errors import InvalidArgument, MetadataError, NoSuchNode, SessionExpired
from pigeon.core.metadata import EventType, WatchEvent
from pigeon_zookeeper._bridge import first_error, stop_quietly
from pigeon_zookeeper._changelog import DELETE_CHUNK, ChangeLog
from pigeon_zookeeper._plan import (
    Layout,
    NeedIndexRead,
    NodeInfo,
    Plan,
    Snapshot,
    ZkOp,
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
_REAP_CHUNK = 200


@dataclass(frozen=True)
class ZooKeeperStoreStatistics(metadata.MetadataStoreStatistics):
    connected: bool
    #: (bucket, entry) of the next change-log entry the watchers will read, or None
    log_position: tuple[int, int] | None


class ZooKeeperMetadataStore(ChangeLog, metadata.TransactionalMetadataStore[Snapshot, Plan]):
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

    def __init__(
        self,
        hosts: str,
        chroot: str = DEFAULT_CHROOT,
        *,
        session_timeout: float = 10.0,
        connect_timeout: float = 15.0,
        request_timeout: float = 30.0,
        watch_buffer: int = metadata.DEFAULT_WATCH_BUFFER,
    ) -> None:
        if not hosts:
            raise InvalidArgument("ZooKeeper metadata store needs hosts")
        if chroot == "/" or not chroot:
            raise InvalidArgument("the ZooKeeper chroot must not be '/'")
        self.hosts = hosts
        self.chroot = metadata.validate_path(chroot)
        self.session_timeout = metadata.check_timeout(session_timeout, "session_timeout")
        self.connect_timeout = metadata.check_timeout(connect_timeout, "connect_timeout")
        self.request_timeout = metadata.check_timeout(request_timeout, "request_timeout")
        self.watch_buffer = watch_buffer
        self._layout = Layout(self.chroot)
        self._hub = metadata.WatchHub(watch_buffer)
        self._zk = None
        self._connected = False
        self._state_changed = trio.Event()
        self._closing = False
        # session
        self._sid: str | None = None
        self._init_lifecycle()
        # change log
        self._bucket = None
        self._bucket_version = 0
        self._cursor = None
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
        parsed = metadata.parse_server_url(
            url,
            scheme="zk",
            server="ZooKeeper",
            default_port=DEFAULT_PORT,
            default_path=DEFAULT_CHROOT,
            path_name="chroot",
            options=("session_timeout", "connect_timeout", "request_timeout"),
        )
        return parsed.build(cls, ",".join(parsed.hosts))

    def __repr__(self) -> str:
        return f"<ZooKeeperMetadataStore {self.hosts}{self.chroot} session={self._sid}>"

    @property
    def session_id(self) -> str | None:
        """The current ZooKeeper session id (16 hex digits) while the session is alive."""
        return self._sid if self._session_alive else None

    def statistics(self) -> ZooKeeperStoreStatistics:
        return self._statistics(
            ZooKeeperStoreStatistics,
            [self._hub],
            connected=self._connected,
            log_position=self._cursor,
        )

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
            await trio.to_thread.run_sync(stop_quietly, client, abandon_on_cancel=True)
            raise MetadataError(f"cannot connect to ZooKeeper at {self.hosts}: {exc}") from exc
        self._connected = client.connected
        self._state_changed.set()
        self._state_changed = trio.Event()
        return client

    def _running(self) -> bool:
        return self._zk is not None

    async def _open(self) -> None:
        self._hub = metadata.WatchHub(self.watch_buffer)
        self._closing = False
        self._cursor = None
        self._bucket = None
        await self._start_client()
        await self._ensure_layout()
        await self._register_session()

    def _background(self) -> Sequence[Callable[[], Awaitable[None]]]:
        return [self._follow_loop, self._reap_loop, self._trim_loop]

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
                await trio.to_thread.run_sync(stop_quietly, client, abandon_on_cancel=True)

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
            _, error = first_error(results)
            if not isinstance(error, NodeExistsError):
                raise self._error(error, "starting a session")
        self._sid = sid
        self._session_started()
        log.debug("%r: session started", self)

    async def _end_session(self) -> None:
        """Delete this session's ephemeral nodes (logged) and its registration."""
        sid = self._sid
        if sid is not None and self._session_alive:
            await self._reap(sid, own=True)
        self._mark_session_ended()

    async def new_session(self) -> None:
        self._require()
        if self._session_alive:
            await self._end_session()
            client = self._require()
            self._closing = True
            try:
                await trio.to_thread.run_sync(stop_quietly, client, abandon_on_cancel=True)
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
                stop_quietly(other)

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
            await trio.to_thread.run_sync(stop_quietly, zk, abandon_on_cancel=True)
            await ended.wait()  # kazoo reported LOST for it
            if self._zk is zk:
                await self._start_client()

    async def _read(self, need: metadata.NeedRead, snap: Snapshot) -> None:
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
            await self._read(metadata.NeedRead(nodes=more), snap)

    def _new_snapshot(self) -> Snapshot:
        return Snapshot()

    def _plan(self, ops: Sequence[metadata.WriteOp], snapshot: Snapshot) -> Plan:
        return plan(self._layout, ops, snapshot, self._sid if self._session_alive else None)

    async def _commit_plan(self, ops: Sequence[metadata.WriteOp], the_plan: Plan) -> list[object]:
        if the_plan.size() > MAX_REQUEST_BYTES:
            raise InvalidArgument(
                f"metadata write of ~{the_plan.size()} bytes is too large for ZooKeeper"
                f" (at most {MAX_REQUEST_BYTES} bytes per write, values included twice)"
            )
        try:
            outcome = await self._commit(the_plan.ops, the_plan.events)
        except KazooException as exc:
            if isinstance(exc, SessionExpiredError) and any(
                isinstance(op, metadata.Create | metadata.Op) and op.ephemeral for op in ops
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
        raise metadata.StaleRead(repr(outcome.error))  # something the plan read changed: again

    # --- reads ----------------------------------------------------------------------------

    async def get(self, path: str) -> metadata.Stat | None:
        metadata.validate_path(path)
        try:
            value, stat = await self._call("get", self._layout.node(path))
        except NoNodeError:
            return None
        except KazooException as exc:
            raise self._error(exc, f"get {path}") from exc
        return metadata.Stat(
            bytes(value), stat.version, stat.ephemeralOwner != 0, stat.ctime / 1e3, stat.mtime / 1e3
        )

    async def children(self, path: str) -> list[str]:
        metadata.validate_path(path)
        try:
            names = await self._call("get_children", self._layout.node(path))
        except NoNodeError:
            return []
        except KazooException as exc:
            raise self._error(exc, f"children of {path}") from exc
        return sorted(names)

    # --- writes ---------------------------------------------------------------------------

    async def _delete_tree(self, path: str, version: int | None) -> None:
        ops = [metadata.Delete(path, version, recursive=True)]
        for _attempt in range(self.max_attempts):
            the_plan = await self._plan_reading(ops, metadata.first_reads(ops))
            if the_plan.size() > MAX_REQUEST_BYTES or len(the_plan.ops) > 4 * DELETE_CHUNK:
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
        for i in range(0, len(leaves), DELETE_CHUNK):
            chunk = leaves[i : i + DELETE_CHUNK]
            try:
                await self._transact([metadata.Op.delete(leaf) for leaf in chunk])
            except MetadataError:  # someone else deleted some: one by one
                for leaf in chunk:
                    try:
                        await self.delete(leaf, recursive=True)
                    except NoSuchNode:
                        pass
        await self.delete(path, version=version, recursive=True)

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


def _info(stat: ZnodeStat | None) -> NodeInfo:
    if stat is None:
        return NodeInfo(False)
    return NodeInfo(True, stat.version, stat.ephemeralOwner, stat.numChildren)

"""The etcd metadata store (etcd v3 gRPC API, bridged into trio).

Threading
    Unary calls (range, txn, lease grant/revoke) are sent as gRPC futures from the trio
    thread and come back through a trio token (``run_sync_soon``): no worker thread
    waits on etcd.  Every call has ``wait_for_ready`` and a deadline of
    ``request_timeout``, so calls made while etcd restarts wait for it (bounded) rather
    than fail at once.  Watches share one gRPC Watch stream per store, read by one
    thread (:class:`~pigeon_etcd._watch.WatchStream`); lease keepalives run in ``trio.to_thread``.

Data model
    See :mod:`pigeon_etcd._plan`: one key per node under ``P/n``, a child index under
    ``P/c``, sequential counters under ``P/s``; every write is one etcd transaction
    whose compares fail if anything it read changed, in which case it is re-read and
    re-planned (:class:`~pigeon.core.metadata.TransactionalMetadataStore` validates,
    plans and retries; this module reads and commits).

Watches
    Each ``watch()`` is one etcd watch on the node's key (or its subtree's key range)
    starting at the revision after the one current when it was established, with
    ``prev_kv`` (for the version of deleted nodes); :mod:`pigeon_etcd._watch` runs the
    stream and maps the events.

Sessions
    A session is an etcd lease with TTL ``ceil(session_timeout)``; ephemeral nodes are
    attached to it and a keepalive refreshes it every third of its TTL.  When etcd
    answers a keepalive with "lease not found" (it expired or was revoked), the session
    has ended: etcd has already deleted its nodes, :meth:`wait_session_expired` returns
    and ephemeral creates raise ``SessionExpired`` until :meth:`new_session`.  Closing
    the store revokes the lease.  An unreachable etcd does not by itself end the session
    (etcd decides; it also renews leases when it restarts).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from pigeon.core import metadata
from pigeon.core.errors import InvalidArgument, MetadataError, PigeonError, SessionExpired
from pigeon_etcd._plan import Compare, Keys, NodeInfo, Plan, Snapshot, Write, decode_value, plan
from pigeon_etcd._watch import WatchStream, convert_events

__all__ = ["EtcdMetadataStore", "EtcdStoreStatistics"]

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/pigeon"
DEFAULT_PORT = 2379
#: etcd refuses requests above --max-request-bytes (1.5 MiB by default).
MAX_REQUEST_BYTES = 1400 * 1024
#: etcd refuses transactions with more than --max-txn-ops (128 by default) operations.
MAX_TXN_OPS = 128
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


@dataclass(frozen=True)
class EtcdStoreStatistics(metadata.MetadataStoreStatistics):
    lease_id: int | None


class EtcdMetadataStore(
    metadata.StoreLifecycle, metadata.TransactionalMetadataStore[Snapshot, Plan]
):
    """:class:`~pigeon.core.metadata.MetadataStore` on etcd v3 (3.4 or later).

    :param target: ``host:port`` of an etcd member (or a gRPC target such as
        ``ipv4:10.0.0.1:2379,10.0.0.2:2379``).
    :param prefix: key prefix under which the store keeps everything (default
        ``/pigeon``).
    :param session_timeout: TTL of the session lease in seconds (rounded up; etcd's
        minimum is about 2 s).
    :param request_timeout: deadline of each etcd call (it waits for etcd to be reachable
        within it).
    :param watch_buffer: unread events a watcher may hold before it fails.
    """

    def __init__(
        self,
        target: str,
        prefix: str = DEFAULT_PREFIX,
        *,
        session_timeout: float = 10.0,
        request_timeout: float = 30.0,
        watch_buffer: int = metadata.DEFAULT_WATCH_BUFFER,
    ) -> None:
        if not target:
            raise InvalidArgument("etcd metadata store needs a target host:port")
        if not prefix or prefix == "/":
            raise InvalidArgument("the etcd key prefix must not be empty or '/'")
        self.target = target
        self.prefix = metadata.validate_path(prefix)
        self.session_timeout = metadata.check_timeout(session_timeout, "session_timeout")
        self.request_timeout = metadata.check_timeout(request_timeout, "request_timeout")
        self.watch_buffer = watch_buffer
        self._keys = Keys(self.prefix.encode())
        self._channel: Any = None
        self._kv: Any = None
        self._lease_stub: Any = None
        self._rpc: Any = None
        self._grpc: Any = None
        self._stream: WatchStream | None = None
        self._hubs: dict[int, metadata.WatchHub] = {}
        self._next_watch_id = 0
        self._lease: int | None = None
        self._ttl = max(1, math.ceil(self.session_timeout))
        self._init_lifecycle()
        self._keepalive_wake = trio.Event()

    @classmethod
    def from_url(cls, url: str) -> EtcdMetadataStore:
        """Build a store from ``etcd://host:port[,host:port]/prefix?options``.

        The prefix defaults to ``/pigeon``.  Options (seconds): ``session_timeout`` (10),
        ``request_timeout`` (30).
        """
        parsed = metadata.parse_server_url(
            url,
            scheme="etcd",
            server="etcd",
            default_port=DEFAULT_PORT,
            default_path=DEFAULT_PREFIX,
            path_name="prefix",
            options=("session_timeout", "request_timeout"),
        )
        target = parsed.hosts[0]
        if len(parsed.hosts) > 1:  # gRPC's static address list (IP addresses only)
            target = "ipv4:" + ",".join(parsed.hosts)
        return parsed.build(cls, target)

    def __repr__(self) -> str:
        return f"<EtcdMetadataStore {self.target}{self.prefix} lease={self._lease}>"

    @property
    def session_id(self) -> str | None:
        """The session's lease id in hex while the session is alive."""
        return f"{self._lease:x}" if self._lease is not None and self._session_alive else None

    @property
    def lease_id(self) -> int | None:
        """The session's lease while the session is alive."""
        return self._lease if self._session_alive else None

    def statistics(self) -> EtcdStoreStatistics:
        return self._statistics(EtcdStoreStatistics, self._hubs.values(), lease_id=self.lease_id)

    # --- calls -----------------------------------------------------------------------------

    def _require(self) -> None:
        if self._channel is None:
            raise MetadataError(f"{self!r} is not running")

    async def _unary(self, method: Any, request: Any, what: str) -> Any:
        self._require()
        future = method.future(request, timeout=self.request_timeout, wait_for_ready=True)
        done = trio.Event()
        future.add_done_callback(lambda _: self._soon(done.set))
        try:
            await done.wait()
        except BaseException:
            future.cancel()
            raise
        try:
            return future.result()
        except self._grpc.RpcError as exc:
            raise self._error(exc, what) from None
        except self._grpc.FutureCancelledError:
            raise MetadataError(f"{what}: the etcd call was cancelled") from None

    def _error(self, exc: Any, what: str) -> PigeonError:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        status = self._grpc.StatusCode
        if code == status.NOT_FOUND and "lease" in (details or ""):
            if self._session_alive:
                self._mark_session_ended()
            return SessionExpired(f"{what}: the etcd lease of this session is gone ({details})")
        if code == status.DEADLINE_EXCEEDED:
            return MetadataError(f"{what}: etcd at {self.target} did not answer in time")
        if code in (status.RESOURCE_EXHAUSTED,) or "too large" in (details or ""):
            return InvalidArgument(f"{what}: the request is too large for etcd ({details})")
        return MetadataError(f"{what}: etcd error {code.name if code else '?'}: {details}")

    async def _range(self, key: bytes, range_end: bytes = b"", **kwargs: Any) -> Any:
        request = self._rpc.RangeRequest(key=key, **kwargs)
        if range_end:
            request.range_end = range_end
        return await self._unary(self._kv.Range, request, "etcd range")

    # --- lifecycle ---------------------------------------------------------------------------

    def _running(self) -> bool:
        return self._channel is not None

    async def _open(self) -> None:
        from pigeon_etcd import _grpc

        self._grpc = _grpc.grpc
        self._rpc = _grpc.rpc
        self._channel = _grpc.grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._kv = _grpc.rpc.KVStub(self._channel)
        self._lease_stub = _grpc.rpc.LeaseStub(self._channel)
        self._stream = WatchStream(
            _grpc.rpc.WatchStub(self._channel),
            _grpc.rpc,
            self._events_from_thread,
            self._failed_from_thread,
        )
        self._stream.start()
        self._hubs = {}
        await self._grant()

    def _background(self) -> Sequence[Callable[[], Awaitable[None]]]:
        return [self._keepalive_loop]

    async def _close(self) -> None:
        if self._channel is None:
            return
        try:
            if self._session_alive and self._lease is not None:
                with trio.move_on_after(min(self.request_timeout, 10.0)):
                    await self._revoke(self._lease)
        except MetadataError as exc:
            log.warning("%r: could not revoke the session lease on close: %s", self, exc)
        finally:
            self._mark_session_ended()
            for hub in self._hubs.values():
                hub.fail_all("metadata store closed")
            self._hubs = {}
            stream, channel = self._stream, self._channel
            self._stream = None
            self._channel = None
            if stream is not None:
                await trio.to_thread.run_sync(stream.close, abandon_on_cancel=True)
            channel.close()

    # --- sessions -------------------------------------------------------------------------------

    async def _grant(self) -> None:
        response = await self._unary(
            self._lease_stub.LeaseGrant,
            self._rpc.LeaseGrantRequest(TTL=self._ttl),
            "starting a session (lease grant)",
        )
        if response.error:
            raise MetadataError(f"etcd refused a lease: {response.error}")
        self._lease = response.ID
        self._ttl = max(1, response.TTL)
        self._session_started()
        self._keepalive_wake.set()
        log.debug("%r: session started (ttl %ss)", self, self._ttl)

    async def _revoke(self, lease: int) -> None:
        try:
            await self._unary(
                self._lease_stub.LeaseRevoke,
                self._rpc.LeaseRevokeRequest(ID=lease),
                "ending the session (lease revoke)",
            )
        except SessionExpired:
            pass  # gone already

    def _keepalive_once(self, lease: int) -> int:
        """One keepalive round trip (in a worker thread); returns the new TTL."""
        request = self._rpc.LeaseKeepAliveRequest(ID=lease)
        responses = self._lease_stub.LeaseKeepAlive(
            iter([request]), timeout=self.request_timeout, wait_for_ready=True
        )
        try:
            for response in responses:
                return int(response.TTL)
        finally:
            responses.cancel()
        return -1

    async def _keepalive_loop(self) -> None:
        while True:
            lease = self._lease
            if not self._session_alive or lease is None:
                self._keepalive_wake = trio.Event()
                await self._keepalive_wake.wait()
                continue
            try:
                ttl = await trio.to_thread.run_sync(
                    self._keepalive_once, lease, abandon_on_cancel=True
                )
            except self._grpc.RpcError as exc:
                log.debug("%r: keepalive failed: %r", self, exc)
                with trio.move_on_after(0.2):
                    self._keepalive_wake = trio.Event()
                    await self._keepalive_wake.wait()
                continue
            if lease != self._lease or not self._session_alive:
                continue
            if ttl <= 0:
                log.warning("%r: session expired (lease %x gone)", self, lease)
                self._mark_session_ended()
                continue
            with trio.move_on_after(max(0.1, self._ttl / 3)):
                self._keepalive_wake = trio.Event()
                await self._keepalive_wake.wait()

    async def new_session(self) -> None:
        self._require()
        if self._session_alive and self._lease is not None:
            await self._revoke(self._lease)
            self._mark_session_ended()
        await self._grant()

    async def expire_session(self) -> None:
        """Revoke this session's lease now, as if its keepalives had stopped for a TTL:
        etcd deletes the ephemeral nodes, the store notices at its next keepalive (which
        is made at once).  For tests and forced fail-over."""
        self._require()
        if self._lease is not None and self._session_alive:
            await self._revoke(self._lease)
        self._keepalive_wake.set()

    # --- reads ----------------------------------------------------------------------------------

    async def get(self, path: str) -> metadata.Stat | None:
        metadata.validate_path(path)
        self._require()
        response = await self._range(self._keys.node(path))
        if not response.kvs:
            return metadata.Stat(b"", 0, False) if path == "/" else None
        kv = response.kvs[0]
        value, version, ctime, mtime = decode_value(kv.value)
        return metadata.Stat(value, version, kv.lease != 0, ctime, mtime)

    async def children(self, path: str) -> list[str]:
        metadata.validate_path(path)
        self._require()
        start, end = self._keys.children(path)
        response = await self._range(start, end, keys_only=True)
        return sorted(kv.key[len(start) :].decode() for kv in response.kvs)

    async def _read(self, need: metadata.NeedRead, snap: Snapshot) -> None:
        keys = self._keys
        items: list[tuple[str, str, Any]] = []
        for path in need.nodes:
            items.append(("node", path, self._rpc.RangeRequest(key=keys.node(path))))
        for path in need.children:
            start, end = keys.children(path)
            request = self._rpc.RangeRequest(key=start, range_end=end, count_only=True)
            items.append(("children", path, request))
        for path in need.counters:
            request = self._rpc.RangeRequest(key=keys.counter(path), keys_only=True)
            items.append(("counter", path, request))
        for i in range(0, len(items), MAX_TXN_OPS - 8):
            chunk = items[i : i + MAX_TXN_OPS - 8]
            txn = self._rpc.TxnRequest(
                success=[self._rpc.RequestOp(request_range=request) for _, _, request in chunk]
            )
            response = await self._unary(self._kv.Txn, txn, "etcd read")
            for (kind, path, _), op in zip(chunk, response.responses, strict=True):
                result = op.response_range
                if kind == "node":
                    if result.kvs:
                        kv = result.kvs[0]
                        value, version, ctime, _ = decode_value(kv.value)
                        snap.nodes[path] = NodeInfo(
                            True, version, kv.lease, kv.mod_revision, ctime, value
                        )
                    else:
                        snap.nodes[path] = NodeInfo(False)
                elif kind == "children":
                    snap.children[path] = int(result.count)
                else:
                    snap.counters[path] = int(result.kvs[0].version) if result.kvs else 0

    def _txn_request(self, compares: list[Compare], writes: list[Write]) -> Any:
        rpc = self._rpc
        equal, less = rpc.Compare.EQUAL, rpc.Compare.LESS
        pb_compares = []
        for compare in compares:
            if compare.kind == "mod":
                pb = rpc.Compare(result=equal, target=rpc.Compare.MOD, key=compare.key)
                pb.mod_revision = compare.value
            elif compare.kind == "version":
                pb = rpc.Compare(result=equal, target=rpc.Compare.VERSION, key=compare.key)
                pb.version = compare.value
            else:  # every key in the range has version < 1: there is none
                pb = rpc.Compare(result=less, target=rpc.Compare.VERSION, key=compare.key)
                pb.range_end, pb.version = compare.range_end, 1
            pb_compares.append(pb)
        ops = []
        for write in writes:
            if write.kind == "put":
                ops.append(
                    rpc.RequestOp(
                        request_put=rpc.PutRequest(
                            key=write.key, value=write.value, lease=write.lease
                        )
                    )
                )
            else:
                request = rpc.DeleteRangeRequest(key=write.key)
                if write.range_end:
                    request.range_end = write.range_end
                ops.append(rpc.RequestOp(request_delete_range=request))
        return rpc.TxnRequest(compare=pb_compares, success=ops)

    def _new_snapshot(self) -> Snapshot:
        return Snapshot()

    def _first_reads(self, ops: Sequence[metadata.WriteOp]) -> metadata.NeedRead:
        return metadata.first_reads(ops, children_of_deletes=True)

    def _plan(self, ops: Sequence[metadata.WriteOp], snapshot: Snapshot) -> Plan:
        lease = self._lease if self._session_alive else None
        return plan(self._keys, ops, snapshot, lease, time.time())

    async def _commit_plan(self, ops: Sequence[metadata.WriteOp], the_plan: Plan) -> list[object]:
        if the_plan.size() > MAX_REQUEST_BYTES:
            raise InvalidArgument(
                f"metadata write of ~{the_plan.size()} bytes is too large for etcd"
            )
        if len(the_plan.writes) > MAX_TXN_OPS or len(the_plan.compares) > MAX_TXN_OPS:
            raise InvalidArgument(
                f"metadata write needs {len(the_plan.writes)} etcd operations;"
                f" etcd allows {MAX_TXN_OPS} per transaction"
            )
        request = self._txn_request(the_plan.compares, the_plan.writes)
        response = await self._unary(self._kv.Txn, request, "metadata write")
        if not response.succeeded:  # something the plan read changed: again
            raise metadata.StaleRead("an etcd compare failed")
        return the_plan.results

    # --- watches --------------------------------------------------------------------------------

    def _events_from_thread(self, wid: int, events: list[Any]) -> None:
        converted = convert_events(self._keys, events)
        self._soon(self._deliver, wid, converted)

    def _failed_from_thread(self, wid: int, reason: str) -> None:
        self._soon(self._fail, wid, reason)

    def _deliver(self, wid: int, events: list[metadata.WatchEvent]) -> None:
        hub = self._hubs.get(wid)
        if hub is not None:
            for event in events:
                hub.dispatch(event)

    def _fail(self, wid: int, reason: str) -> None:
        hub = self._hubs.get(wid)
        if hub is not None:
            hub.fail_all(reason)

    @asynccontextmanager
    async def _watch(self, path: str, prefix: bool) -> AsyncIterator[metadata.Watcher]:
        await trio.lowlevel.checkpoint()
        self._require()
        revision = (await self._range(self._keys.nodes, count_only=True)).header.revision
        stream = self._stream
        assert stream is not None
        # one hub per watcher: its etcd watch covers exactly what it subscribed to
        hub = metadata.WatchHub(self.watch_buffer)
        watcher = hub.subscribe(path, prefix=prefix)
        wid = self._next_watch_id = self._next_watch_id + 1
        self._hubs[wid] = hub
        if prefix:
            key, end = self._keys.subtree(path)
        else:
            key, end = self._keys.node(path), b""
        stream.add(wid, key, end, revision + 1)
        try:
            yield watcher
        finally:
            stream.cancel(wid)
            self._hubs.pop(wid, None)
            hub.unsubscribe(watcher)

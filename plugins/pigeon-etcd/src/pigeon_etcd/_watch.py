"""etcd watches for the etcd metadata store: one gRPC Watch stream per store, read by one
thread (:class:`WatchStream`), and the mapping of etcd's events to
:class:`~pigeon.core.metadata.WatchEvent` (:func:`convert_events`).

A PUT that created the key → ``CREATED``, another PUT → ``CHANGED``, a DELETE →
``DELETED``; deletions within one revision are reported deepest first, so a recursive
delete reports children before parents.  If the stream breaks (etcd restarted), every
watch is re-created from the revision after the last event delivered: nothing is lost or
repeated unless etcd compacted that revision away, which fails the watcher.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from pigeon.core.errors import MetadataError
from pigeon.core.metadata import EventType, WatchEvent
from pigeon_etcd._plan import Keys, decode_value

__all__ = ["WatchStream", "convert_events"]

log = logging.getLogger(__name__)


def _depth(path: str) -> int:
    return 0 if path == "/" else path.count("/")


def _previous_version(event: Any) -> int:
    """The version the node had before ``event`` (from etcd's ``prev_kv``), or -1."""
    if event.HasField("prev_kv") and event.prev_kv.value:
        try:
            return decode_value(event.prev_kv.value)[1]
        except MetadataError:
            pass
    return -1


def convert_events(keys: Keys, events: list[Any]) -> list[WatchEvent]:
    """etcd watch events (``mvccpb.Event``) → :class:`WatchEvent`, deletions of one
    revision deepest first."""
    out: list[WatchEvent] = []
    run: list[tuple[int, WatchEvent]] = []
    run_revision = -1

    def flush() -> None:
        run.sort(key=lambda item: -item[0])  # stable: deepest first
        out.extend(event for _, event in run)
        run.clear()

    for event in events:
        kv = event.kv
        path = keys.path_of(kv.key)
        if path is None:
            continue
        if event.type == 1:  # DELETE
            if run and kv.mod_revision != run_revision:
                flush()
            run_revision = kv.mod_revision
            deleted = WatchEvent(EventType.DELETED, path, None, _previous_version(event))
            run.append((_depth(path), deleted))
            continue
        flush()
        try:
            value, version, _, _ = decode_value(kv.value)
        except MetadataError:
            log.warning("etcd metadata: %r is not a node written by PigeonMQ", kv.key)
            continue
        if kv.create_revision == kv.mod_revision and path != "/":  # the root always exists
            out.append(WatchEvent(EventType.CREATED, path, value, version))
        elif version == 0:  # deleted and created again within one transaction
            out.append(WatchEvent(EventType.DELETED, path, None, _previous_version(event)))
            out.append(WatchEvent(EventType.CREATED, path, value, version))
        else:
            out.append(WatchEvent(EventType.CHANGED, path, value, version))
    flush()
    return out


class _Watch:
    __slots__ = ("etcd_id", "key", "next_revision", "range_end")

    def __init__(self, key: bytes, range_end: bytes, start_revision: int) -> None:
        self.key = key
        self.range_end = range_end
        self.next_revision = start_revision
        self.etcd_id: int | None = None


class WatchStream:
    """All watches of one store on one gRPC Watch stream, read by one thread.

    ``on_events(wid, events)`` and ``on_failed(wid, reason)`` are called from that
    thread, in stream order.  A broken stream is reopened (``wait_for_ready``: it waits
    for etcd) and every watch re-created from the revision after its last event.
    """

    def __init__(
        self,
        stub: Any,
        rpc: Any,
        on_events: Callable[[int, list[Any]], None],
        on_failed: Callable[[int, str], None],
    ) -> None:
        self._stub = stub
        self._rpc = rpc
        self._on_events = on_events
        self._on_failed = on_failed
        self._lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}
        self._queue: queue.Queue[Any] | None = None
        self._pending: collections.deque[int] = collections.deque()
        self._by_etcd: dict[int, int] = {}
        self._closed = threading.Event()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name="pigeon-etcd-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, wid: int, key: bytes, range_end: bytes, start_revision: int) -> None:
        with self._lock:
            self._watches[wid] = _Watch(key, range_end, start_revision)
            if self._queue is not None:
                self._send_create(wid)

    def cancel(self, wid: int) -> None:
        with self._lock:
            watch = self._watches.pop(wid, None)
            if watch is not None and watch.etcd_id is not None and self._queue is not None:
                self._queue.put(self._cancel_request(watch.etcd_id))

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        with self._lock:
            if self._queue is not None:
                self._queue.put(None)
            call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout)

    def _cancel_request(self, etcd_id: int) -> Any:
        return self._rpc.WatchRequest(cancel_request=self._rpc.WatchCancelRequest(watch_id=etcd_id))

    def _send_create(self, wid: int) -> None:  # with the lock held
        watch = self._watches[wid]
        assert self._queue is not None
        self._pending.append(wid)
        create = self._rpc.WatchCreateRequest(
            key=watch.key, start_revision=watch.next_revision, prev_kv=True
        )
        if watch.range_end:
            create.range_end = watch.range_end
        self._queue.put(self._rpc.WatchRequest(create_request=create))

    def _run(self) -> None:
        backoff = 0.05
        while not self._closed.is_set():
            requests: queue.Queue[Any] = queue.Queue()
            with self._lock:
                self._queue = requests
                self._pending.clear()
                self._by_etcd.clear()
                for wid, watch in self._watches.items():
                    watch.etcd_id = None
                    self._send_create(wid)
                call = self._call = self._stub.Watch(iter(requests.get, None), wait_for_ready=True)
            try:
                for response in call:
                    backoff = 0.05
                    self._handle(response)
            except Exception as exc:  # grpc.RpcError: the stream broke (or we closed it)
                if not self._closed.is_set():
                    log.debug("etcd watch stream broke: %r", exc)
            with self._lock:
                self._queue = None
            requests.put(None)
            if self._closed.wait(backoff):
                return
            backoff = min(backoff * 2, 1.0)

    def _handle(self, response: Any) -> None:
        failed: str | None = None
        with self._lock:
            if response.created:
                wid_created = self._pending.popleft() if self._pending else None
                watch = self._watches.get(wid_created) if wid_created is not None else None
                if watch is None:  # cancelled before etcd created it
                    if self._queue is not None and not response.canceled:
                        self._queue.put(self._cancel_request(response.watch_id))
                    return
                assert wid_created is not None
                watch.etcd_id = response.watch_id
                self._by_etcd[response.watch_id] = wid_created
            wid = self._by_etcd.get(response.watch_id)
            watch = self._watches.get(wid) if wid is not None else None
            if wid is None or watch is None:
                return
            if response.compact_revision or response.canceled:
                self._watches.pop(wid, None)
                self._by_etcd.pop(response.watch_id, None)
                failed = (
                    f"etcd compacted revision {watch.next_revision}: watch events lost"
                    if response.compact_revision
                    else f"etcd cancelled the watch ({response.cancel_reason or 'no reason'})"
                )
            elif response.events:
                watch.next_revision = response.events[-1].kv.mod_revision + 1
        if failed is not None:
            self._on_failed(wid, failed)
        elif response.events:
            self._on_events(wid, list(response.events))

"""The bookie's RPC service: the segment store on the network, and its registration.

Adds are applied to the store in the order they arrive on a connection (the handler
writes synchronously, in the connection's reader task) and answered once durable under
the store's fsync policy; many adds are in flight at once, so one fsync covers a whole
group of them, and the answers of a group commit are sent from one callback (no task
per add).  Reads run in a task of the connection and go through
:meth:`~pigeon.core.storage.LedgerStorage.read_entries_async`: large reads happen in a
worker thread and never hold the event loop.  Every failure is answered with a typed error
(:mod:`pigeon.core.errors`); nothing a peer sends ends the connection.

Registration: the ephemeral node ``/pigeon/bookies/available/<host:port>`` holds a JSON
object (see :meth:`BookieServer.registration`), rewritten every
``register_interval_s``, at once when the bookie turns read-only or writable, and
created again (with a new session) if the metadata session expired.

Security (the ``SecurityConfig`` keys of the ``[bookie]`` table, docs/security.md): with
``tls_certificate_file`` the port takes TLS only (the certificate is reloaded on SIGHUP);
with ``authentication_enabled`` every connection authenticates in its ``connect``, and a
bookie serves brokers and bookies only: a connection whose role is not one of
``superuser_roles`` has every request refused with :class:`AuthorizationError` (decided
once, when it connects).  Forwarding to followers dials with the ``broker_client_*``
settings (this bookie's own role).

In-process links (:meth:`BookieServer.open_local_link`, ``pigeon standalone``'s broker):
the same protocol and answers without a socket; such a link is trusted (only code of this
process can open one), so it has no TLS and no authentication.  The
``pigeon_bookie_connections`` gauge counts connections by ``link`` (``tcp``,
``in_process``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import trio

from pigeon.bookie._forward import Forwarder, Replication
from pigeon.bookie._gc import SegmentCollector
from pigeon.bookie._metrics import render_metrics, serve_metrics
from pigeon.core.config import SecurityConfig
from pigeon.core.errors import (
    AuthorizationError,
    ConfigError,
    ConnectionClosed,
    InternalError,
    NodeExists,
    NoSuchNode,
    PigeonError,
    SegmentFenced,
    SegmentNotFound,
    ServiceUnavailable,
    SessionExpired,
    StorageError,
)
from pigeon.core.paths import BOOKIES_PATH
from pigeon.core.replication import BookieClient
from pigeon.core.rpc import (
    DEFAULT_MAX_FRAME_SIZE,
    BookieFrame,
    Connection,
    LocalStream,
    Request,
    serve_local,
    serve_tcp,
)
from pigeon.core.storage import LedgerStorage
from pigeon.core.tls import ServerTls, reload_on_sighup

__all__ = ["BookieConfig", "BookieServer", "DiskSpacePolicy", "build_ledger_storage"]

log = logging.getLogger(__name__)


#: reads answer at most this many entries (their sizes travel in the response header)
MAX_READ_COUNT = 10_000
#: room left in a read response frame for its Cap'n Proto header
_READ_HEADER_ROOM = 4096 + 16 * MAX_READ_COUNT
#: reads of one connection reading from disk at once (each holds up to read_max_bytes)
MAX_CONCURRENT_READS = 8
#: reads of one connection waiting for their turn; more are refused (retriable)
MAX_QUEUED_READS = 1024


class _ReadQueue:
    """Backpressure of one connection's reads: a bounded number read at once, and only
    while the connection's outgoing queue is below its high-water mark."""

    __slots__ = ("limit", "queued", "writable")

    def __init__(self) -> None:
        self.limit = trio.Semaphore(MAX_CONCURRENT_READS)
        self.queued = 0
        # Connection.wait_writable() supports one waiter at a time (each waiter
        # replaces the event the writer sets): the reads take turns calling it
        self.writable = trio.Lock()


@dataclass
class BookieConfig(SecurityConfig):
    """Configuration of a bookie (``[bookie]`` table, ``PIGEON_*`` variables, flags),
    with the security keys of :class:`~pigeon.core.config.SecurityConfig`: the bookie
    port's certificate (``tls_*``), who may connect (``authentication_*``, ``token_*``;
    only ``superuser_roles`` are served, whether or not ``authorization_enabled``), and
    how this bookie dials its followers (``broker_client_*``).  The ``http_port`` of
    /metrics stays plain HTTP without authentication (it shows counters only)."""

    host: str = "127.0.0.1"
    port: int = 3181
    data_dir: str = "./pigeon-data/bookie"
    metadata: str = ""
    fsync: Literal["always", "interval", "never"] = "always"
    fsync_interval_ms: float = 5.0
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    #: payload bytes a read answers at most (also bounded by max_frame_size)
    read_max_bytes: int = 4 * 1024 * 1024
    register_interval_s: float = 5.0
    #: HTTP port of GET /metrics (Prometheus); -1: not served
    http_port: int = -1
    advertised_address: str = ""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    #: turn read-only when the data dir's file system has less free space than this ...
    min_free_disk_bytes: int = 64 * 1024 * 1024
    #: ... or less than this percentage of its size free (0: no percentage threshold)
    min_free_disk_percent: float = 0.0
    disk_check_interval_s: float = 1.0
    #: how often orphaned and expired segments are looked for
    gc_interval_s: float = 60.0
    #: a segment is never collected as an orphan until idle for this long
    gc_grace_s: float = 300.0
    #: delete segments idle (no add, no fence) for this long; 0: never
    segment_expiry_s: float = 0.0
    #: at start, the checksums of at least this many bytes at the end of every segment
    #: are verified (torn tails and damage there are logged); older damage is found by
    #: the checksum every read verifies
    verify_tail_bytes: int = 1024 * 1024
    #: the storage backend keeping the segments (BookKeeper's ``ledgerStorageClass``):
    #: a name registered with the ``pigeon_ledger_storages`` hook
    ledger_storage: str = "segment-files"
    # --- the ``journal`` ledger storage (BookKeeper's keys, in snake_case) ---
    #: where the journal lives ("": ``<data_dir>/journal``); put it on its own disk:
    #: its fdatasync is the only one on the ack path
    journal_directory: str = ""
    #: where the entry logs (and the index, in the first) live (empty:
    #: ``<data_dir>/ledgers``); new entry logs go to each in turn
    ledger_directories: list[str] = dataclasses.field(default_factory=list)
    #: hold a journal fsync round back up to this long to gather more adds (0: an fsync
    #: starts as soon as the previous one ends; adds arriving meanwhile share the next)
    journal_max_group_wait_ms: float = 0.0
    #: a round of at most this many bytes runs its write + fdatasync on the event loop,
    #: not on the group commit's thread (two thread hops, and the GIL, less on the ack
    #: path); 0: always the thread
    journal_inline_sync_max_bytes: int = 64 * 1024
    #: ... unless the disk turned slow: half of the last 32 inline rounds slower than
    #: this, or one over 1 s; then rounds go to the thread again for 10 s (a slow disk
    #: must not stall every connection of the process)
    journal_inline_sync_max_ms: float = 2.0
    #: a journal file rolls once this big; old files are deleted after a checkpoint
    journal_max_size_mb: int = 512
    #: journal files are zero-filled to this size before use, in the background, so
    #: the group commit's fdatasync commits no metadata (0: off); skipped while the
    #: journal is written faster than 64 MiB/s (the zeros would halve its bandwidth)
    journal_pre_alloc_size_mb: float = 16.0
    #: an entry log rolls once this big (bytes)
    entry_log_size_limit: int = 1024 * 1024 * 1024
    #: checkpoint interval: entry logs fsynced, the index committed, old journal files
    #: deleted (also after 200000 adds); a restart replays the journal since.  Every
    #: checkpoint's writeback delays the journal fsyncs behind it (docs/benchmarks.md,
    #: "Storage backends"): BookKeeper checkpoints every 60 s, we every 10 s
    flush_interval_ms: float = 10_000.0
    #: ``journal``: have the kernel write an entry log's pages to disk every this many
    #: bytes (BookKeeper's ``flushEntrylogBytes``; 0: leave them all to the checkpoint),
    #: so that the checkpoint's fdatasync does not hold the journal's up behind them
    flush_entrylog_bytes: int = 8 * 1024 * 1024
    #: ``journal``: drop the journal's pages from the page cache once durable
    #: (BookKeeper's ``journalRemovePagesFromCache``; only a replay reads them)
    journal_remove_pages_from_cache: bool = True
    #: of each data file (a segment file, an entry log), the most recent bytes written
    #: that stay in the page cache once on disk; older pages are dropped, so that the
    #: kernel reuses their memory for the next writes (-1: keep them, the kernel
    #: decides).  Catch-up reads of older data then come from the disk
    page_cache_window_bytes: int = 64 * 1024 * 1024
    #: compaction rewrites entry logs whose live bytes fell below this fraction of
    #: their size, every minor_compaction_interval_s ...
    minor_compaction_threshold: float = 0.2
    minor_compaction_interval_s: float = 3600.0
    #: ... and below this one every major_compaction_interval_s
    major_compaction_threshold: float = 0.8
    major_compaction_interval_s: float = 86400.0

    def journal_paths(self) -> tuple[str, list[str]]:
        """``(journal directory, ledger directories)``, defaults filled in."""
        journal = self.journal_directory or os.path.join(self.data_dir, "journal")
        ledgers = self.ledger_directories or [os.path.join(self.data_dir, "ledgers")]
        return journal, ledgers

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"bad value for 'port': {self.port} is not a TCP port")
        if self.fsync_interval_ms <= 0:
            raise ConfigError("bad value for 'fsync_interval_ms': must be positive")
        for key in ("register_interval_s", "disk_check_interval_s", "gc_interval_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"bad value for {key!r}: must be positive")
        for key in ("gc_grace_s", "segment_expiry_s", "min_free_disk_bytes", "verify_tail_bytes"):
            if getattr(self, key) < 0:
                raise ConfigError(f"bad value for {key!r}: must be >= 0")
        for key in (
            "journal_max_size_mb",
            "journal_inline_sync_max_ms",
            "entry_log_size_limit",
            "flush_interval_ms",
            "minor_compaction_interval_s",
            "major_compaction_interval_s",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"bad value for {key!r}: must be positive")
        for key in (
            "journal_max_group_wait_ms",
            "journal_inline_sync_max_bytes",
            "journal_pre_alloc_size_mb",
            "flush_entrylog_bytes",
        ):
            if getattr(self, key) < 0:
                raise ConfigError(f"bad value for {key!r}: must be >= 0")
        for key in ("minor_compaction_threshold", "major_compaction_threshold"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"bad value for {key!r}: must be in [0, 1]")
        if self.page_cache_window_bytes < -1:
            raise ConfigError("bad value for 'page_cache_window_bytes': must be >= 0, or -1")
        if not 0 <= self.min_free_disk_percent < 100:
            raise ConfigError("bad value for 'min_free_disk_percent': must be in [0, 100)")
        if self.read_max_bytes < 1:
            raise ConfigError("bad value for 'read_max_bytes': must be positive")
        if self.max_frame_size <= _READ_HEADER_ROOM + 1024:
            raise ConfigError("bad value for 'max_frame_size': too small")
        self.validate_security()
        if self.authentication_enabled and not self.superuser_roles:
            raise ConfigError(
                "'authentication_enabled' on a bookie needs 'superuser_roles': a bookie"
                " serves only the roles of the brokers and bookies listed there"
            )


def build_ledger_storage(config: BookieConfig, plugins: Any) -> LedgerStorage:
    """The storage ``config.ledger_storage`` names, built (not running) by the factory
    registered in ``plugins.ledger_storages``; an unknown name is a ConfigError naming
    the known ones."""
    registry = plugins.ledger_storages
    name = config.ledger_storage
    if name not in registry:
        known = ", ".join(registry) or "none"
        raise ConfigError(
            f"bad value for 'ledger_storage': no ledger storage named {name!r} is"
            f" registered (known: {known})"
        )
    store: LedgerStorage = registry.get(name)(config)
    return store


class DiskSpacePolicy:
    """When free disk space makes a bookie read-only, and writable again.

    Read-only below ``threshold(total)`` = max(``min_free_bytes``,
    ``min_free_percent`` % of ``total``); writable again only at ``threshold + margin``
    (10% of the threshold, at least 1 MiB), so that the state does not flap around the
    threshold.  No I/O: the service feeds it ``shutil.disk_usage`` results.
    """

    def __init__(self, min_free_bytes: int, min_free_percent: float = 0.0) -> None:
        self.min_free_bytes = min_free_bytes
        self.min_free_percent = min_free_percent

    def threshold(self, total: int) -> int:
        return max(self.min_free_bytes, int(total * self.min_free_percent / 100))

    def low(self, total: int, free: int) -> bool:
        """Too little space: turn read-only."""
        return free < self.threshold(total)

    def recovered(self, total: int, free: int) -> bool:
        """Enough space again to accept writes after a read-only spell."""
        t = self.threshold(total)
        return free >= t + max(t // 10, 1 << 20)


class _Unauthorized:
    """The handler of a connection whose role may not use this bookie: every request is
    refused with the same :class:`AuthorizationError` (pings are still answered)."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("on_"):
            raise AttributeError(name)
        return self._refuse

    def _refuse(self, conn: Connection, req: Request) -> None:
        raise AuthorizationError(self.message)


def _follower_done(
    state: Replication, address: str, result: Any, error: BaseException | None
) -> None:
    state.follower(address, error)


def _state(info: Any) -> dict[str, Any]:
    return {
        "segmentId": info.segment_id,
        "lastEntryId": info.last_entry_id,
        "lac": info.lac,
        "fenced": info.fenced,
        "sizeBytes": info.size_bytes,
    }


class BookieServer:
    """Serves one :class:`~pigeon.core.storage.LedgerStorage` over the bookie protocol.

    ``await nursery.start(server.run)`` recovers the store, checks the disk, listens,
    registers (when ``metadata`` is given) and reports the bound ``(host, port)``.

    ``store``: the storage to serve; by default the one ``config.ledger_storage`` names,
    built by its factory in ``plugins.ledger_storages``.  ``plugins``: the
    :class:`~pigeon.core.PluginManager` whose ledger storages and authentication
    providers the bookie uses (the installed ones when None).  ``reload_on_sighup``: reload the
    TLS certificate on SIGHUP (off when the process embedding the bookie does it, as
    ``pigeon standalone``: ``server.tls`` is the listener's :class:`ServerTls`).
    """

    def __init__(
        self,
        config: BookieConfig,
        *,
        store: Any = None,
        metadata: Any = None,
        plugins: Any = None,
        reload_on_sighup: bool = True,
    ) -> None:
        config.validate()
        self.config = config
        self.metadata = metadata
        #: the TLS of the bookie port (None: plaintext); configuration errors show now
        self.tls: ServerTls | None = config.server_tls("bookie")
        if plugins is None and (store is None or config.authentication_enabled):
            from pigeon.core import PluginManager

            plugins = PluginManager()
        self.authenticator = (
            config.authenticator(plugins.authentication_providers)
            if config.authentication_enabled
            else None
        )
        self._client_tls = config.client_tls_context()
        self._client_authentication = config.client_authentication()
        self._reload_on_sighup = reload_on_sighup
        self._superusers = frozenset(config.superuser_roles)
        self.store: LedgerStorage = store or build_ledger_storage(config, plugins)
        self.collector = SegmentCollector(
            self.store,
            metadata,
            interval_s=config.gc_interval_s,
            grace_s=config.gc_grace_s,
            expiry_s=config.segment_expiry_s,
        )
        self.disk_policy = DiskSpacePolicy(config.min_free_disk_bytes, config.min_free_disk_percent)
        #: ``() -> (total, free)`` bytes of the data dir's file system
        self.disk_usage: Callable[[], tuple[int, int]] = self._statvfs
        self.address: tuple[str, int] | None = None
        self.client: BookieClient | None = None
        self.forwarder: Forwarder = None  # type: ignore[assignment]
        self.nursery: trio.Nursery = None  # type: ignore[assignment]
        self._disk: tuple[int, int] = (0, 0)
        self._reads: dict[Connection, _ReadQueue] = {}
        #: connections served now, by link (``tcp``, ``in_process``)
        self.connections: dict[str, int] = {"tcp": 0, "in_process": 0}
        self._serving = False
        self._wake = trio.Event()
        self._registered = False
        # bytes/s over the last registration interval
        self._rate_at = 0.0
        self._rate_totals = (0, 0)
        self._rates = (0.0, 0.0)

    @property
    def advertised(self) -> str:
        if self.config.advertised_address:
            return self.config.advertised_address
        assert self.address is not None
        return f"{self.address[0]}:{self.address[1]}"

    @property
    def registration_path(self) -> str:
        return f"{BOOKIES_PATH}/{self.advertised}"

    async def run(
        self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                await nursery.start(self.store.run)
                # leader-follower: this bookie forwards adds to the segment's followers
                self.client = BookieClient(
                    name="pigeon-bookie",
                    max_frame_size=self.config.max_frame_size,
                    tls=self._client_tls,
                    authentication=self._client_authentication,
                )
                await nursery.start(self.client.run)
                self.forwarder = Forwarder(self.store, self.client, nursery)
                await nursery.start(self.forwarder.run)
                self.check_disk()
                self.address = await nursery.start(
                    lambda task_status: serve_tcp(
                        self,
                        BookieFrame,
                        host=self.config.host,
                        port=self.config.port,
                        server_name="pigeon-bookie",
                        max_frame_size=self.config.max_frame_size,
                        max_message_size=self.config.max_frame_size,
                        tls=self.tls,
                        authenticator=self.authenticator,
                        task_status=task_status,
                    )
                )
                if self.tls is not None and self._reload_on_sighup:
                    await nursery.start(reload_on_sighup, self.tls)
                self._rate_at = trio.current_time()
                nursery.start_soon(self._watch_disk)
                if self.metadata is not None:
                    await self.publish()
                    nursery.start_soon(self._keep_registered)
                    nursery.start_soon(self._watch_session)
                await nursery.start(self.collector.run)
                if self.config.http_port >= 0:
                    self.http_address = await nursery.start(
                        functools.partial(
                            serve_metrics,
                            self.render_metrics,
                            host=self.config.host,
                            port=self.config.http_port,
                        )
                    )
                log.info(
                    "bookie serving address=%s data_dir=%s read_only=%s tls=%s authentication=%s",
                    self.advertised,
                    self.config.data_dir,
                    self.store.read_only is not None,
                    self.tls is not None,
                    ",".join(self.authenticator.methods) if self.authenticator else "off",
                )
                self._serving = True
                task_status.started(self.address)
                await trio.sleep_forever()
        finally:
            self._serving = False
            if self._registered:
                with trio.move_on_after(2, shield=True):
                    try:  # brokers stop choosing this bookie now, not at session expiry
                        await self.metadata.delete(self.registration_path)
                    except Exception as exc:  # the store may be closing too: best effort
                        log.debug("unregistering failed error=%s", exc)

    def render_metrics(self) -> str:
        """This bookie's Prometheus metrics (its storage's and its connections)."""
        return render_metrics(self.store, self.advertised, connections=self.connections)

    def open_local_link(self) -> LocalStream:
        """The client end of a new in-process link to this bookie (for
        :func:`pigeon.core.rpc.connect_local`; a broker's ``BookieClient.add_local``).

        :raises ConnectionClosed: the bookie is not serving (not started, or stopped)."""
        if not self._serving:
            raise ConnectionClosed("the in-process bookie is not running")
        return serve_local(
            self,
            BookieFrame,
            self.nursery,
            server_name="pigeon-bookie",
            max_frame_size=self.config.max_frame_size,
            max_message_size=self.config.max_frame_size,
        )

    # ------------------------------------------------------------------ disk space

    def _statvfs(self) -> tuple[int, int]:
        usage = shutil.disk_usage(self.config.data_dir)
        return usage.total, usage.free

    def check_disk(self) -> None:
        """Look at the free space now; turn read-only or writable again as needed."""
        try:
            total, free = self.disk_usage()
        except OSError as exc:
            log.warning("cannot read free disk space path=%s error=%s", self.config.data_dir, exc)
            return
        self._disk = (total, free)
        before = self.store.read_only
        if self.disk_policy.low(total, free):
            if before is None:
                self.store.set_read_only(
                    f"free disk space {free} bytes is below the threshold of"
                    f" {self.disk_policy.threshold(total)} bytes"
                )
        elif before is not None and self.disk_policy.recovered(total, free):
            # clears a low-space or full-disk state; an I/O error stays (until restart)
            self.store.set_read_only(None)
        if (before is None) != (self.store.read_only is None):
            self._wake.set()

    async def _watch_disk(self) -> None:
        while True:
            await trio.sleep(self.config.disk_check_interval_s)
            self.check_disk()

    # ------------------------------------------------------------------ registration

    def registration(self) -> dict[str, Any]:
        """What this bookie publishes about itself (the JSON value of its node)."""
        stats = self.store.statistics()
        total, free = self._disk
        write_rate, read_rate = self._rates
        return {
            "address": self.advertised,
            "read_only": stats.read_only,
            "read_only_reason": stats.read_only_reason,
            "free_disk_bytes": free,
            "total_disk_bytes": total,
            "disk_used_bytes": stats.disk_usage_bytes,
            "write_bytes_per_s": round(write_rate, 1),
            "read_bytes_per_s": round(read_rate, 1),
            "segments": stats.segments,
            "time": time.time(),
        }

    def _update_rates(self) -> None:
        now = trio.current_time()
        dt = now - self._rate_at
        if dt < 0.5 * self.config.register_interval_s:
            return  # an early publish (state change): keep the last interval's rates
        stats = self.store.statistics()
        written, read = self._rate_totals
        self._rates = ((stats.bytes_written - written) / dt, (stats.bytes_read - read) / dt)
        self._rate_totals = (stats.bytes_written, stats.bytes_read)
        self._rate_at = now

    async def publish(self) -> None:
        """Write the registration now (creating it, in a new session if need be)."""
        self._update_rates()
        value = json.dumps(self.registration()).encode()
        path = self.registration_path
        try:
            if self._registered:
                try:
                    await self.metadata.set(path, value)
                    return
                except NoSuchNode:
                    log.warning("bookie registration gone (session expired?): registering again")
            await self._create(path, value)
            self._registered = True
        except PigeonError as exc:
            log.warning("bookie registration failed path=%s error=%s", path, exc)

    async def _create(self, path: str, value: bytes) -> None:
        try:
            await self.metadata.create(path, value, ephemeral=True)
        except NodeExists:
            # left by a previous run of ours whose session has not expired yet
            try:
                await self.metadata.delete(path)
            except NoSuchNode:
                pass
            await self.metadata.create(path, value, ephemeral=True)
        except SessionExpired:
            log.warning("metadata session expired: starting a new one")
            await self.metadata.new_session()
            await self.metadata.create(path, value, ephemeral=True)

    async def _keep_registered(self) -> None:
        while True:
            with trio.move_on_after(self.config.register_interval_s):
                await self._wake.wait()
            self._wake = trio.Event()
            await self.publish()

    async def _watch_session(self) -> None:
        while True:
            await self.metadata.wait_session_expired()
            self._wake.set()  # publish() sees the node gone and registers again
            await trio.sleep(min(1.0, self.config.register_interval_s))

    # ------------------------------------------------------------------ protocol

    def _spawn(self, conn: Connection, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        (conn.nursery or self.nursery).start_soon(fn, *args)

    def on_addEntry(self, conn: Connection, req: Request) -> None:
        b = req.body
        segment_id, entry_id = b.segmentId, b.entryId
        # synchronous: adds are written in the order they arrive
        if b.recovery or b.resend:
            waiter = self._append_again(segment_id, entry_id, req.payload, b.lac, b.recovery)
        else:
            waiter = self.store.append(segment_id, entry_id, req.payload, lac=b.lac)
        request_id = req.request_id
        if len(b.forwardTo):
            self._replicate(conn, req, waiter)
            return

        def answer() -> None:
            err = waiter.error
            if err is not None:
                conn.respond_error(request_id, err)
            else:
                conn.respond(
                    request_id, "addResponse", {"segmentId": segment_id, "entryId": entry_id}
                )

        waiter.add_done_callback(answer)

    def _append_again(
        self, segment_id: int, entry_id: int, data: memoryview, lac: int, recovery: bool
    ) -> Any:
        """A recovery add (fenced segments accept it) or a resend (they do not); both
        acknowledge an entry already stored with identical bytes."""
        if not recovery:
            try:
                if self.store.segment_info(segment_id).fenced:
                    raise SegmentFenced(f"segment={segment_id} is fenced")
            except SegmentNotFound:
                pass
        return self.store.append(segment_id, entry_id, data, lac=lac, recovery=True)

    def _replicate(self, conn: Connection, req: Request, waiter: Any) -> None:
        """Leader-follower: forward the add to the followers, answer per :class:`Replication`."""
        b = req.body
        followers = [str(a) for a in b.forwardTo]
        state = Replication(
            conn, req.request_id, b.segmentId, b.entryId, len(followers), b.forwardAcks
        )
        for address in followers:
            self.forwarder.forward(
                b.segmentId,
                address,
                b.entryId,
                b.lac,
                req.payload,
                b.syncFrom,
                functools.partial(_follower_done, state, address),
            )
        waiter.add_done_callback(lambda: state.local(waiter.error))

    def connection_opened(self, conn: Connection) -> None:
        """Authorization, once per connection: only brokers and bookies (the
        ``superuser_roles``) may use a bookie; any other role has its requests refused."""
        if self.authenticator is None or conn.in_process or conn.role in self._superusers:
            self.connections["in_process" if conn.in_process else "tcp"] += 1
            return
        log.warning(
            "connection refused: role is not a superuser of this bookie conn=%s role=%s",
            conn.name,
            conn.role,
        )
        conn.handler = _Unauthorized(
            f"role {conn.role!r} may not use a bookie: only brokers and bookies"
            " (superuser_roles) read and write entries"
        )

    def connection_closed(self, conn: Connection) -> None:
        self._reads.pop(conn, None)
        self.connections["in_process" if conn.in_process else "tcp"] -= 1

    def on_readEntries(self, conn: Connection, req: Request) -> None:
        b = req.body
        queue = self._reads.get(conn)
        if queue is None:
            queue = self._reads[conn] = _ReadQueue()
        if queue.queued >= MAX_QUEUED_READS:
            raise ServiceUnavailable(f"more than {MAX_QUEUED_READS} reads queued: retry later")
        config = self.config
        max_count = min(b.maxCount or MAX_READ_COUNT, MAX_READ_COUNT)
        max_bytes = min(
            b.maxBytes or config.read_max_bytes,
            config.read_max_bytes,
            config.max_frame_size - _READ_HEADER_ROOM,
        )
        queue.queued += 1
        self._spawn(
            conn,
            self._read,
            queue,
            conn,
            req.request_id,
            b.segmentId,
            b.firstEntryId,
            b.lastEntryId,
            max_bytes,
            max_count,
        )

    async def _read(
        self,
        queue: _ReadQueue,
        conn: Connection,
        request_id: int,
        segment_id: int,
        first: int,
        last: int,
        max_bytes: int,
        max_count: int,
    ) -> None:
        try:
            async with queue.limit:
                async with queue.writable:
                    await conn.wait_writable()
                entries = await self.store.read_entries_async(
                    segment_id, first, last, max_bytes=max_bytes, max_count=max_count
                )
        except ConnectionClosed:
            return
        except PigeonError as exc:
            conn.respond_error(request_id, exc)
            return
        except OSError as exc:
            log.warning("read failed segment=%d entry=%d error=%s", segment_id, first, exc)
            conn.respond_error(request_id, StorageError(f"read failed: {exc}"))
            return
        except Exception as exc:  # never let a bad read take the bookie down
            log.exception("read failed segment=%d entry=%d", segment_id, first)
            conn.respond_error(request_id, InternalError(f"internal error reading: {exc!r}"))
            return
        finally:
            queue.queued -= 1
        sizes = [{"entryId": eid, "size": len(data)} for eid, data in entries]
        payload = [data for _eid, data in entries]  # written unjoined (DESIGN §12)
        fields = {"segmentId": segment_id, "entries": sizes}
        conn.respond(request_id, "readResponse", fields, payload)

    def on_readLac(self, conn: Connection, req: Request) -> None:
        info = self.store.segment_info(req.body.segmentId)
        conn.respond(req.request_id, "segmentState", _state(info))

    def on_segmentInfo(self, conn: Connection, req: Request) -> None:
        info = self.store.segment_info(req.body.segmentId)
        conn.respond(req.request_id, "segmentState", _state(info))

    def on_fence(self, conn: Connection, req: Request) -> None:
        self._spawn(conn, self._segment_op, conn, req.request_id, req.body.segmentId, "fence")

    def on_deleteSegment(self, conn: Connection, req: Request) -> None:
        self._spawn(conn, self._segment_op, conn, req.request_id, req.body.segmentId, "delete")

    async def _segment_op(
        self, conn: Connection, request_id: int, segment_id: int, op: Literal["fence", "delete"]
    ) -> None:
        """Fence (answered with the segment's state) or delete (answered ``ok``) in a task
        of the connection; every failure is answered with a typed error."""
        try:
            if op == "fence":
                await self.store.fence(segment_id)
                info = self.store.segment_info(segment_id)
                conn.respond(request_id, "segmentState", _state(info))
            else:
                await self.store.delete_segment(segment_id)
                conn.respond(request_id, "ok")
        except PigeonError as exc:
            conn.respond_error(request_id, exc)
        except OSError as exc:
            conn.respond_error(request_id, StorageError(f"{op} failed: {exc}"))
        except Exception as exc:
            log.exception("%s failed segment=%d", op, segment_id)
            doing = {"fence": "fencing", "delete": "deleting"}[op]
            conn.respond_error(request_id, InternalError(f"internal error {doing}: {exc!r}"))

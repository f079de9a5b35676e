"""The bookie's RPC service: the segment store on the network, and its registration.

Adds are applied to the store in the order they arrive on a connection (the handler
writes synchronously) and answered once durable under the store's fsync policy; many
adds are in flight at once, so one fsync covers a whole group of them.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from typing import Any, Literal

import trio

from pigeon.core._framing import DEFAULT_MAX_FRAME_SIZE
from pigeon.core._rpc import Connection, Request, serve_tcp
from pigeon.core._schema import BookieFrame
from pigeon.core.errors import ConfigError, PigeonError, StorageError

from pigeon.bookie._storage import SegmentStore

__all__ = ["BookieConfig", "BookieServer"]

log = logging.getLogger(__name__)

BOOKIES_PATH = "/pigeon/bookies/available"


@dataclass
class BookieConfig:
    host: str = "127.0.0.1"
    port: int = 3181
    data_dir: str = "./pigeon-data/bookie"
    metadata: str = ""
    fsync: Literal["always", "interval", "never"] = "always"
    fsync_interval_ms: float = 5.0
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    read_max_bytes: int = 8 * 1024 * 1024
    register_interval_s: float = 5.0
    advertised_address: str = ""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"bad value for 'port': {self.port} is not a TCP port")
        if self.fsync_interval_ms <= 0:
            raise ConfigError("bad value for 'fsync_interval_ms': must be positive")


def _state(info: Any) -> dict[str, Any]:
    return {
        "segmentId": info.segment_id,
        "lastEntryId": info.last_entry_id,
        "lac": info.lac,
        "fenced": info.fenced,
        "sizeBytes": info.size_bytes,
    }


class BookieServer:
    """Serves one :class:`SegmentStore` over the bookie protocol."""

    def __init__(self, config: BookieConfig, *, store: Any = None, metadata: Any = None) -> None:
        self.config = config
        self.metadata = metadata
        self.store = store or SegmentStore(
            config.data_dir, fsync=config.fsync, fsync_interval_ms=config.fsync_interval_ms
        )
        self.address: tuple[str, int] | None = None
        self.nursery: trio.Nursery = None  # type: ignore[assignment]

    @property
    def advertised(self) -> str:
        if self.config.advertised_address:
            return self.config.advertised_address
        assert self.address is not None
        return f"{self.address[0]}:{self.address[1]}"

    async def run(self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await nursery.start(self.store.run)
            self.address = await nursery.start(
                lambda task_status: serve_tcp(
                    self,
                    BookieFrame,
                    host=self.config.host,
                    port=self.config.port,
                    server_name="pigeon-bookie",
                    max_frame_size=self.config.max_frame_size,
                    max_message_size=self.config.max_frame_size,
                    task_status=task_status,
                )
            )
            if self.metadata is not None:
                await self._register()
                nursery.start_soon(self._refresh_registration)
            log.info("bookie serving address=%s data_dir=%s", self.advertised, self.config.data_dir)
            task_status.started(self.address)
            await trio.sleep_forever()

    # ------------------------------------------------------------------ registration

    def _registration(self) -> bytes:
        stats = self.store.statistics()
        try:
            free = shutil.disk_usage(self.config.data_dir).free
        except OSError:
            free = 0
        return json.dumps(
            {
                "address": self.advertised,
                "free_disk": free,
                "bytes_written": stats.bytes_written,
                "bytes_read": stats.bytes_read,
                "read_only": bool(getattr(stats, "read_only", False)),
                "time": time.time(),
            }
        ).encode()

    async def _register(self) -> None:
        path = f"{BOOKIES_PATH}/{self.advertised}"
        try:
            await self.metadata.create(path, self._registration(), ephemeral=True)
        except PigeonError:
            # a stale registration of ours (previous run) — replace it
            await self.metadata.delete(path)
            await self.metadata.create(path, self._registration(), ephemeral=True)

    async def _refresh_registration(self) -> None:
        path = f"{BOOKIES_PATH}/{self.advertised}"
        while True:
            await trio.sleep(self.config.register_interval_s)
            try:
                await self.metadata.set(path, self._registration())
            except PigeonError as exc:
                log.warning("bookie registration refresh failed error=%s", exc)
                try:
                    await self._register()
                except PigeonError:
                    pass

    # ------------------------------------------------------------------ protocol

    def on_addEntry(self, conn: Connection, req: Request) -> None:
        b = req.body
        segment_id, entry_id = b.segmentId, b.entryId
        waiter = self.store.append(segment_id, entry_id, req.payload, lac=b.lac)
        request_id = req.request_id

        async def answer() -> None:
            try:
                await waiter.wait()
            except PigeonError as exc:
                conn.respond_error(request_id, exc)
                return
            conn.respond(request_id, "addResponse", {"segmentId": segment_id, "entryId": entry_id})

        if waiter.done:
            if waiter.error is not None:
                raise waiter.error
            conn.respond(request_id, "addResponse", {"segmentId": segment_id, "entryId": entry_id})
        else:
            self.nursery.start_soon(answer)

    def on_readEntries(self, conn: Connection, req: Request) -> None:
        b = req.body
        max_bytes = min(b.maxBytes or self.config.read_max_bytes, self.config.read_max_bytes)
        entries = self.store.read_entries(
            b.segmentId, b.firstEntryId, b.lastEntryId, max_bytes=max_bytes, max_count=b.maxCount or 10_000
        )
        sizes = [{"entryId": eid, "size": len(data)} for eid, data in entries]
        payload = entries[0][1] if len(entries) == 1 else b"".join(data for _eid, data in entries)
        conn.respond(req.request_id, "readResponse", {"segmentId": b.segmentId, "entries": sizes}, payload)

    def on_readLac(self, conn: Connection, req: Request) -> None:
        conn.respond(req.request_id, "segmentState", _state(self.store.segment_info(req.body.segmentId)))

    def on_segmentInfo(self, conn: Connection, req: Request) -> None:
        conn.respond(req.request_id, "segmentState", _state(self.store.segment_info(req.body.segmentId)))

    def on_fence(self, conn: Connection, req: Request) -> None:
        segment_id = req.body.segmentId
        request_id = req.request_id

        async def fence() -> None:
            try:
                await self.store.fence(segment_id)
                conn.respond(request_id, "segmentState", _state(self.store.segment_info(segment_id)))
            except PigeonError as exc:
                conn.respond_error(request_id, exc)
            except OSError as exc:
                conn.respond_error(request_id, StorageError(f"fence failed: {exc}"))

        self.nursery.start_soon(fence)

    def on_deleteSegment(self, conn: Connection, req: Request) -> None:
        segment_id = req.body.segmentId
        request_id = req.request_id

        async def delete() -> None:
            try:
                await self.store.delete_segment(segment_id)
                conn.respond(request_id, "ok")
            except PigeonError as exc:
                conn.respond_error(request_id, exc)

        self.nursery.start_soon(delete)

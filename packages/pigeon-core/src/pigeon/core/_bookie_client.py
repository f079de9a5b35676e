"""Client side of the bookie protocol, used by replication policies inside brokers.

One :class:`BookieClient` keeps one pipelined connection per bookie address, opened on
first use inside the client's own nursery and reopened after a failure.  A bookie of this
very process (``pigeon standalone``'s) is reached over an in-process link instead of
loopback TCP (:meth:`BookieClient.add_local`, :mod:`pigeon.core._local_link`).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Sequence
from typing import Any

import trio

from pigeon.core._connection import Connection
from pigeon.core._framing import DEFAULT_MAX_FRAME_SIZE
from pigeon.core._local_link import LocalStream
from pigeon.core._rpc import connect_local, connect_tcp, split_address
from pigeon.core._schema import BookieFrame
from pigeon.core.auth import ClientAuthentication
from pigeon.core.errors import ConnectionClosed, ServiceUnavailable

__all__ = ["BookieClient"]

log = logging.getLogger(__name__)

AddCallback = Callable[[Any, BaseException | None], None]


def _extract_add(body: Any, payload: memoryview) -> int:
    return int(body.entryId)


def _extract_replicated(body: Any, payload: memoryview) -> tuple[int, list[str]]:
    """(durable copies, followers lost) of a leader-follower add."""
    return int(body.copies), [str(a) for a in body.lostReplicas]


def _extract_read(body: Any, payload: memoryview) -> list[tuple[int, memoryview]]:
    out: list[tuple[int, memoryview]] = []
    pos = 0
    for e in body.entries:
        size = e.size
        out.append((e.entryId, payload[pos : pos + size]))
        pos += size
    if pos != len(payload):
        raise ValueError("read response sizes do not match its payload")
    return out


#: the keys of a segment state (see BookieClient.fence) -> the SegmentState fields
_STATE_FIELDS = {
    "segment_id": "segmentId",
    "last_entry_id": "lastEntryId",
    "lac": "lac",
    "fenced": "fenced",
    "size_bytes": "sizeBytes",
}


def _extract_state(body: Any, payload: memoryview) -> dict[str, Any]:
    return {key: getattr(body, name) for key, name in _STATE_FIELDS.items()}


class BookieClient:
    """Connections to bookies, by ``host:port`` address."""

    def __init__(
        self,
        *,
        name: str = "pigeon-broker",
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        tls: ssl.SSLContext | None = None,
        authentication: ClientAuthentication | None = None,
    ):
        """``tls``: dial bookies over TLS with this context; ``authentication``: the
        credentials (the node's own role) every connection presents."""
        self.name = name
        self.max_frame_size = max_frame_size
        self.tls = tls
        self.authentication = authentication
        self._conns: dict[str, Connection] = {}
        self._locks: dict[str, trio.Lock] = {}
        self._nursery: trio.Nursery | None = None
        #: address -> until when (trio time) reads ask it last: it left a read unanswered
        self._slow: dict[str, float] = {}
        #: address -> opens an in-process link to that bookie (see :meth:`add_local`)
        self._local: dict[str, Callable[[], LocalStream]] = {}

    def add_local(self, address: str, open_link: Callable[[], LocalStream]) -> None:
        """Reach the bookie at ``address`` over in-process links: ``open_link()`` returns
        the client end of a new one (``BookieServer.open_local_link``), or raises
        :class:`ConnectionClosed` when that bookie has stopped.  The link is trusted:
        this client's TLS and credentials are for the other bookies."""
        self._local[address] = open_link

    # ---------------------------------------------------------------- responsiveness

    def note_slow(self, address: str, for_s: float = 10.0) -> None:
        """``address`` left a read unanswered: ask it last for ``for_s`` seconds."""
        self._slow[address] = trio.current_time() + for_s

    def is_slow(self, address: str) -> bool:
        until = self._slow.get(address)
        if until is None:
            return False
        if until <= trio.current_time():
            del self._slow[address]
            return False
        return True

    def by_responsiveness(self, addresses: Sequence[str]) -> list[str]:
        """``addresses`` in their order, those that were slow lately last."""
        return sorted(addresses, key=self.is_slow)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def connection(self, address: str) -> Connection:
        conn = self._conns.get(address)
        if conn is not None and not conn.closed:
            return conn
        if self._nursery is None:
            raise ServiceUnavailable("bookie client is not running")
        lock = self._locks.setdefault(address, trio.Lock())
        async with lock:
            conn = self._conns.get(address)
            if conn is not None and not conn.closed:
                return conn
            open_link = self._local.get(address)
            if open_link is not None:
                conn, _info = await connect_local(
                    open_link(),
                    BookieFrame,
                    self._nursery,
                    name=f"{address} (in-process)",
                    client_name=self.name,
                    max_frame_size=self.max_frame_size,
                )
                self._conns[address] = conn
                return conn
            host, port = split_address(address)
            conn, _info = await connect_tcp(
                host,
                port,
                BookieFrame,
                self._nursery,
                client_name=self.name,
                max_frame_size=self.max_frame_size,
                tls=self.tls,
                authentication=self.authentication,
            )
            self._conns[address] = conn
            return conn

    def connection_nowait(self, address: str) -> Connection | None:
        conn = self._conns.get(address)
        return conn if conn is not None and not conn.closed else None

    # ---------------------------------------------------------------- operations

    def add_entry_nowait(
        self,
        conn: Connection,
        segment_id: int,
        entry_id: int,
        lac: int,
        data: bytes | memoryview,
        callback: AddCallback,
        *,
        recovery: bool = False,
        resend: bool = False,
    ) -> None:
        fields: dict[str, Any] = {"segmentId": segment_id, "entryId": entry_id, "lac": lac}
        if recovery:
            fields["recovery"] = True
        if resend:
            fields["resend"] = True
        conn.request_nowait(
            "addEntry",
            fields,
            callback,
            payload=data,
            expect="addResponse",
            extract=_extract_add,
        )

    def add_replicated_nowait(
        self,
        conn: Connection,
        segment_id: int,
        entry_id: int,
        lac: int,
        data: bytes | memoryview,
        callback: AddCallback,
        *,
        forward_to: list[str],
        forward_acks: int,
        sync_from: int,
        resend: bool = False,
    ) -> None:
        """Leader-follower add: ``callback((copies, lost_replicas), error)``."""
        conn.request_nowait(
            "addEntry",
            {
                "segmentId": segment_id,
                "entryId": entry_id,
                "lac": lac,
                "resend": resend,
                "forwardTo": forward_to,
                "forwardAcks": forward_acks,
                "syncFrom": sync_from,
            },
            callback,
            payload=data,
            expect="addResponse",
            extract=_extract_replicated,
        )

    async def add_entry(
        self,
        address: str,
        segment_id: int,
        entry_id: int,
        lac: int,
        data: bytes | memoryview,
        *,
        recovery: bool = False,
    ) -> None:
        conn = await self.connection(address)
        await conn.request(
            "addEntry",
            {"segmentId": segment_id, "entryId": entry_id, "lac": lac, "recovery": recovery},
            payload=data,
            expect="addResponse",
            extract=_extract_add,
        )

    async def read_entries(
        self,
        address: str,
        segment_id: int,
        first: int,
        last: int,
        *,
        max_bytes: int = 8 << 20,
        max_count: int = 10_000,
    ) -> list[tuple[int, memoryview]]:
        conn = await self.connection(address)
        result: list[tuple[int, memoryview]] = await conn.request(
            "readEntries",
            {
                "segmentId": segment_id,
                "firstEntryId": first,
                "lastEntryId": last,
                "maxBytes": max_bytes,
                "maxCount": max_count,
            },
            expect="readResponse",
            extract=_extract_read,
        )
        return result

    async def fence(self, address: str, segment_id: int) -> dict[str, Any]:
        return await self._segment_state(address, "fence", segment_id)

    async def read_lac(self, address: str, segment_id: int) -> dict[str, Any]:
        return await self._segment_state(address, "readLac", segment_id)

    async def segment_info(self, address: str, segment_id: int) -> dict[str, Any]:
        return await self._segment_state(address, "segmentInfo", segment_id)

    async def _segment_state(self, address: str, kind: str, segment_id: int) -> dict[str, Any]:
        """A request answered with the segment's state (see :func:`_extract_state`)."""
        conn = await self.connection(address)
        result: dict[str, Any] = await conn.request(
            kind, {"segmentId": segment_id}, expect="segmentState", extract=_extract_state
        )
        return result

    async def delete_segment(self, address: str, segment_id: int) -> None:
        conn = await self.connection(address)
        await conn.request("deleteSegment", {"segmentId": segment_id})

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close(ConnectionClosed("bookie client closed"))
        self._conns.clear()

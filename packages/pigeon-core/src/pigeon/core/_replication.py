"""The built-in ``quorum`` replication policy (BookKeeper's protocol).

An entry ``i`` of a segment with ensemble ``E`` goes to the ``Qw`` bookies starting at
``i mod E``; it is acknowledged to the writer's caller once ``Qa`` of them acknowledged it
*and* every earlier entry is acknowledged, so callbacks always complete in entry order
and the last-add-confirmed (LAC) only moves forward.

Recovery of a segment whose writer died: fence it on every bookie of its ensemble (so the
old writer can add nothing more), then take the highest entry any bookie holds as the
segment's last entry.  (Ensemble changes after a bookie failure and re-replication of the
recovered tail are the cluster-mode work item; with the standalone ``E=Qw=Qa=1`` the
single bookie holds everything.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pigeon.core._bookie_client import BookieClient
from pigeon.core.errors import (
    ConfigError,
    ConnectionClosed,
    PigeonError,
    ServiceUnavailable,
    StorageError,
)

__all__ = ["QuorumPolicy", "QuorumWriter"]

log = logging.getLogger(__name__)

WriteCallback = Callable[[int, BaseException | None], None]


@dataclass(slots=True)
class _InFlight:
    callback: WriteCallback
    acks: int = 0
    failures: int = 0
    errors: list[BaseException] = field(default_factory=list)


class QuorumWriter:
    """Appends entries to one segment. Only one writer may ever exist per segment."""

    def __init__(
        self,
        client: BookieClient,
        segment_id: int,
        ensemble: Sequence[str],
        *,
        write_quorum: int,
        ack_quorum: int,
    ) -> None:
        self.client = client
        self.segment_id = segment_id
        self.ensemble = list(ensemble)
        self.write_quorum = write_quorum
        self.ack_quorum = ack_quorum
        self.next_entry_id = 0
        self.lac = -1
        self.bytes_written = 0
        self._in_flight: dict[int, _InFlight] = {}
        self._failed: BaseException | None = None
        self._conns: list[Any] = []

    async def open(self) -> None:
        self._conns = [await self.client.connection(a) for a in self.ensemble]

    @property
    def pending(self) -> int:
        return len(self._in_flight)

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def add_nowait(self, data: bytes | memoryview, callback: WriteCallback) -> int:
        """Send one entry; ``callback(entry_id, error)`` runs once, in entry order."""
        if self._failed is not None:
            raise self._failed
        entry_id = self.next_entry_id
        self.next_entry_id += 1
        self._in_flight[entry_id] = _InFlight(callback)
        e = len(self.ensemble)
        for k in range(self.write_quorum):
            index = (entry_id + k) % e
            conn = self._conns[index]
            if conn.closed:
                conn = self.client.connection_nowait(self.ensemble[index]) or conn
                self._conns[index] = conn
            try:
                self.client.add_entry_nowait(
                    conn,
                    self.segment_id,
                    entry_id,
                    self.lac,
                    data,
                    lambda result, error, eid=entry_id: self._on_ack(eid, error),
                )
            except ConnectionClosed as exc:
                self._on_ack(entry_id, exc)
        self.bytes_written += len(data)
        return entry_id

    def _on_ack(self, entry_id: int, error: BaseException | None) -> None:
        flight = self._in_flight.get(entry_id)
        if flight is None:
            return
        if error is None:
            flight.acks += 1
        else:
            flight.failures += 1
            flight.errors.append(error)
            if flight.failures > self.write_quorum - self.ack_quorum:
                self._fail(
                    error
                    if isinstance(error, PigeonError)
                    else StorageError(f"segment {self.segment_id}: {error}")
                )
                return
        self._complete_in_order()

    def _complete_in_order(self) -> None:
        while True:
            nxt = self.lac + 1
            flight = self._in_flight.get(nxt)
            if flight is None or flight.acks < self.ack_quorum:
                return
            del self._in_flight[nxt]
            self.lac = nxt
            try:
                flight.callback(nxt, None)
            except Exception:
                log.exception("write callback failed segment=%s entry=%s", self.segment_id, nxt)

    def _fail(self, error: BaseException) -> None:
        if self._failed is None:
            self._failed = error
            log.warning("segment writer failed segment=%s error=%s", self.segment_id, error)
        flights = sorted(self._in_flight.items())
        self._in_flight.clear()
        for eid, flight in flights:
            try:
                flight.callback(eid, error)
            except Exception:
                log.exception("write callback failed segment=%s entry=%s", self.segment_id, eid)


class QuorumPolicy:
    """Factory of segment writers/readers with the quorum protocol."""

    name = "quorum"

    def __init__(
        self,
        client: BookieClient,
        *,
        ensemble_size: int = 1,
        write_quorum: int = 1,
        ack_quorum: int = 1,
        **_options: Any,
    ) -> None:
        if not ensemble_size >= write_quorum >= ack_quorum >= 1:
            raise ConfigError(
                "replication needs ensemble_size >= write_quorum >= ack_quorum >= 1, got "
                f"{ensemble_size}/{write_quorum}/{ack_quorum}"
            )
        self.client = client
        self.ensemble_size = ensemble_size
        self.write_quorum = write_quorum
        self.ack_quorum = ack_quorum

    def choose_ensemble(self, bookies: Sequence[str], ensemble_size: int | None = None) -> list[str]:
        size = ensemble_size or self.ensemble_size
        if len(bookies) < size:
            raise ServiceUnavailable(f"need {size} writable bookies, {len(bookies)} available")
        return list(bookies[:size])

    async def create_writer(
        self,
        segment_id: int,
        ensemble: Sequence[str],
        *,
        write_quorum: int | None = None,
        ack_quorum: int | None = None,
    ) -> QuorumWriter:
        writer = QuorumWriter(
            self.client,
            segment_id,
            ensemble,
            write_quorum=write_quorum or self.write_quorum,
            ack_quorum=ack_quorum or self.ack_quorum,
        )
        await writer.open()
        return writer

    async def read(
        self,
        segment_id: int,
        ensemble: Sequence[str],
        first: int,
        last: int,
        *,
        max_bytes: int = 8 << 20,
        max_count: int = 10_000,
        write_quorum: int | None = None,
    ) -> list[tuple[int, memoryview]]:
        """Entries ``first..last`` (fewer if limits hit), from the first bookie that answers."""
        errors: list[BaseException] = []
        e = len(ensemble)
        qw = min(write_quorum or self.write_quorum, e)
        if qw == e:
            candidates = list(ensemble)
        else:
            # Striped: only the bookies holding ``first`` serve it; read one entry at a time.
            candidates = [ensemble[(first + k) % e] for k in range(qw)]
            last = first
        start = first % len(candidates) if candidates else 0
        for i in range(len(candidates)):
            address = candidates[(start + i) % len(candidates)]
            try:
                return await self.client.read_entries(
                    address, segment_id, first, last, max_bytes=max_bytes, max_count=max_count
                )
            except (ConnectionClosed, ServiceUnavailable, StorageError, OSError) as exc:
                errors.append(exc)
                if isinstance(exc, PigeonError) and not exc.retriable and len(candidates) == 1:
                    raise
        raise errors[-1] if errors else ServiceUnavailable("no bookie to read from")

    async def recover(
        self, segment_id: int, ensemble: Sequence[str], *, ack_quorum: int | None = None
    ) -> int:
        """Fence the segment everywhere and return its last entry id (-1 if empty)."""
        last = -1
        answered = 0
        errors: list[BaseException] = []
        for address in ensemble:
            try:
                state = await self.client.fence(address, segment_id)
            except (ConnectionClosed, StorageError, OSError) as exc:
                errors.append(exc)
                continue
            answered += 1
            last = max(last, int(state["last_entry_id"]))
        if answered < len(ensemble) - min(ack_quorum or self.ack_quorum, len(ensemble)) + 1:
            raise ServiceUnavailable(
                f"cannot recover segment {segment_id}: only {answered} of {len(ensemble)} "
                f"bookies answered ({errors[-1] if errors else 'no error'})"
            )
        return last

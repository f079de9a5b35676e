"""The quorum protocol's segment writer (BookKeeper's), and :func:`fail_in_order`.

An entry ``i`` of a segment with ensemble ``E`` goes to the ``Qw`` bookies starting at
``i mod E``; it is acknowledged to the writer's caller once ``Qa`` of them acknowledged it
*and* every earlier entry is acknowledged, so callbacks always complete in entry order
and the last-add-confirmed (LAC) only moves forward.  A bookie that fails mid-write is
replaced for the entries not yet acknowledged (an ensemble change: a new fragment in the
segment's metadata); entries it had acknowledged are copied to the replacement.  An
entry's bytes are held by reference until acknowledged, for resends and backfills.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from pigeon.core._bookie_client import BookieClient
from pigeon.core._policy import (
    ReplaceBookie,
    WriteCallback,
)
from pigeon.core.errors import (
    ConnectionClosed,
    PigeonError,
    StorageError,
    Timeout,
)

__all__ = ["QuorumWriter", "WriterBase", "fail_in_order"]

#: the replication layer's one logger (its modules share the name)
log = logging.getLogger("pigeon.core._replication")


@dataclass(slots=True)
class _InFlight:
    callback: WriteCallback
    data: bytes | memoryview
    sent_at: float = 0.0
    acked_by: set[int] = field(default_factory=set)
    failures: int = 0
    errors: list[BaseException] = field(default_factory=list)

    @property
    def acks(self) -> int:
        return len(self.acked_by)


class WriterBase:
    """What every segment writer shares: its entries in flight by id, the event set
    while none is, how it stops (:meth:`close`: no more adds; :meth:`abort`: every
    entry in flight fails too) and how it finds a replacement for a failed bookie
    (:meth:`_replacement`).  A subclass says how it fails (``_fail``)."""

    # set by a subclass that replaces bookies (:meth:`_replacement` reads them)
    client: BookieClient
    segment_id: int
    ensemble: list[str]
    lac: int
    replace_bookie: ReplaceBookie | None

    def __init__(self) -> None:
        self.closed = False
        self._idle = trio.Event()
        self._idle.set()
        self._in_flight: dict[int, Any] = {}
        self._failed: BaseException | None = None
        #: indexes of the ensemble being replaced, and of those down with no
        #: replacement yet
        self._changing: set[int] = set()
        self._down: set[int] = set()
        self.ensemble_changes = 0

    @property
    def pending(self) -> int:
        return len(self._in_flight)

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def abort(self, error: BaseException) -> None:
        """Stop the writer: every entry still in flight is called back with ``error``
        (its fate is settled by recovering the segment), and no later add is taken."""
        self.closed = True
        self._fail(error)

    def close(self) -> None:
        """No more adds (the segment is being closed); stops pending ensemble changes."""
        self.closed = True

    async def wait_idle(self) -> None:
        """Wait until no entry is in flight (all acknowledged, or the writer failed)."""
        await self._idle.wait()

    def _busy(self) -> None:
        """An entry is in flight: :meth:`wait_idle` waits from now on."""
        if self._idle.is_set():
            self._idle = trio.Event()

    def _fail(self, error: BaseException) -> None:
        raise NotImplementedError

    async def _replacement(
        self, index: int, write_on: Callable[[BaseException], None]
    ) -> tuple[str, Any, int] | None:
        """BookKeeper's ensemble change, up to a connected newcomer: ask
        ``replace_bookie`` for a bookie in place of ``ensemble[index]`` from the first
        entry not yet acknowledged on, and connect to it.  While none can be had,
        ``write_on(error)`` lets the writer go on without the failed bookie (its entries
        are under-replicated until the change) and the request is retried with backoff.
        Returns (address, connection, first entry), or None once the writer failed or
        was closed."""
        delay = 0.2
        while True:
            first = self.lac + 1
            try:
                assert self.replace_bookie is not None
                address = await self.replace_bookie(index, first)
                return address, await self.client.connection(address), first
            except (PigeonError, OSError) as exc:
                if self._failed is not None or self.closed:
                    return None
                log.warning(
                    "ensemble change pending segment=%s bookie=%s error=%s",
                    self.segment_id,
                    self.ensemble[index],
                    exc,
                )
                write_on(exc)
                await trio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _take_in(self, index: int, address: str, from_entry: int) -> None:
        """The newcomer ``address`` holds ``ensemble[index]``'s place from now on."""
        failed, self.ensemble[index] = self.ensemble[index], address
        self._changing.discard(index)
        self._down.discard(index)
        self.ensemble_changes += 1
        log.info(
            "ensemble changed segment=%s replaced=%s with=%s from_entry=%s",
            self.segment_id,
            failed,
            address,
            from_entry,
        )


class QuorumWriter(WriterBase):
    """Appends entries to one segment. Only one writer may ever exist per segment."""

    def __init__(
        self,
        client: BookieClient,
        segment_id: int,
        ensemble: Sequence[str],
        *,
        write_quorum: int,
        ack_quorum: int,
        add_timeout: float,
        replace_bookie: ReplaceBookie | None = None,
        nursery: trio.Nursery | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.segment_id = segment_id
        self.ensemble = list(ensemble)
        self.replace_bookie = replace_bookie
        self.nursery = nursery
        self._backfill: dict[int, dict[int, bytes | memoryview]] = {}
        self.write_quorum = write_quorum
        self.ack_quorum = ack_quorum
        #: ``_targets`` of each first index
        self._rotations: list[tuple[int, ...]] = []
        self.next_entry_id = 0
        self.lac = -1
        self.bytes_written = 0
        self._in_flight: dict[int, _InFlight] = {}
        self._conns: list[Any] = []
        self._watching = False
        #: an add a bookie leaves unanswered this long counts as that bookie failing
        self.add_timeout = add_timeout

    async def open(self) -> None:
        self._conns = [await self.client.connection(a) for a in self.ensemble]

    async def _watch_stalls(self) -> None:
        """A bookie that leaves an add unanswered for ``add_timeout`` (paused, cut off)
        is treated as failed: its connection is aborted, which fails its adds and starts
        an ensemble change, as a lost connection would."""
        while not self.closed and self._failed is None:
            await trio.sleep(self.add_timeout / 4)
            deadline = trio.current_time() - self.add_timeout
            for entry_id, flight in list(self._in_flight.items()):
                if flight.sent_at > deadline:
                    break
                for index in self._targets(entry_id):
                    if index in flight.acked_by or index in self._changing:
                        continue
                    conn = self._conns[index]
                    if not conn.closed:
                        log.warning(
                            "bookie stalled segment=%s bookie=%s entry=%s waited=%.1fs",
                            self.segment_id,
                            self.ensemble[index],
                            entry_id,
                            trio.current_time() - flight.sent_at,
                        )
                        conn.abort(Timeout(f"bookie {self.ensemble[index]} did not answer"))

    def _targets(self, entry_id: int) -> tuple[int, ...]:
        """The ensemble indexes that store ``entry_id`` (striped: they rotate with it);
        the rotations computed once (the ensemble's size and the write quorum stay)."""
        e = len(self.ensemble)
        rotations = self._rotations
        if len(rotations) != e:
            w = self.write_quorum
            rotations = self._rotations = [
                tuple((first + k) % e for k in range(w)) for first in range(e)
            ]
        return rotations[entry_id % e]

    def add_nowait(self, data: bytes | memoryview, callback: WriteCallback) -> int:
        """Send one entry; ``callback(entry_id, error)`` runs once, in entry order."""
        if self._failed is not None:
            raise self._failed
        entry_id = self.next_entry_id
        self.next_entry_id += 1
        self._in_flight[entry_id] = _InFlight(callback, data, trio.current_time())
        self._busy()
        if not self._watching and self.nursery is not None:
            self._watching = True
            self.nursery.start_soon(self._watch_stalls)
        flight = self._in_flight[entry_id]
        for index in self._targets(entry_id):
            if index in self._down:
                self._count_failure(
                    flight, ConnectionClosed(f"bookie {self.ensemble[index]} is down")
                )
            elif index not in self._changing:  # else sent once the replacement is known
                self._send(entry_id, index, data)
        self.bytes_written += len(data)
        return entry_id

    def _send(self, entry_id: int, index: int, data: bytes | memoryview) -> None:
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
                functools.partial(self._on_add, entry_id, index),
            )
        except ConnectionClosed as exc:
            self._on_ack(entry_id, index, exc)

    def _on_add(self, entry_id: int, index: int, _result: Any, error: BaseException | None) -> None:
        self._on_ack(entry_id, index, error)

    def _on_ack(self, entry_id: int, index: int, error: BaseException | None) -> None:
        flight = self._in_flight.get(entry_id)
        if flight is None:
            return
        if error is None:
            flight.acked_by.add(index)
            self._complete_in_order()
            return
        if self._can_replace(error):
            # BookKeeper's ensemble change: the failed bookie is replaced for every entry
            # not yet acknowledged by it; the write goes on without failing anyone.
            if index not in self._changing:
                self._changing.add(index)
                assert self.nursery is not None
                self.nursery.start_soon(self._change_ensemble, index)
            elif index in self._down:
                self._count_failure(flight, error)
            return
        self._count_failure(flight, error)

    def _count_failure(self, flight: _InFlight, error: BaseException) -> None:
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

    def _count_down(self, index: int, error: BaseException) -> None:
        """Bookie ``index`` is down with no replacement yet: its share counts as failed."""
        if index in self._down:
            return
        self._down.add(index)
        for entry_id, flight in sorted(self._in_flight.items()):
            if self._failed is not None:
                return
            if index in self._targets(entry_id) and index not in flight.acked_by:
                self._count_failure(flight, error)

    def _can_replace(self, error: BaseException) -> bool:
        if self.replace_bookie is None or self.nursery is None or self._failed is not None:
            return False
        if isinstance(error, PigeonError):
            return error.retriable  # a fenced segment must not be written elsewhere
        return isinstance(error, OSError)

    async def _change_ensemble(self, index: int) -> None:
        # No spare bookie yet: write on with the others while the ack quorum holds.
        found = await self._replacement(index, functools.partial(self._count_down, index))
        if found is None:
            return
        address, conn, _first = found
        self._conns[index] = conn
        self._take_in(index, address, self.lac + 1)
        # Every entry of the new fragment (all still in flight: above the LAC) must be on
        # the new bookie, also those the failed one had acknowledged before it died.
        for entry_id, data in sorted(self._backfill.pop(index, {}).items()):
            self._send_backfill(entry_id, index, data)
        now = trio.current_time()
        for entry_id, flight in sorted(self._in_flight.items()):
            if index in self._targets(entry_id):
                flight.acked_by.discard(index)
                flight.sent_at = now  # the new bookie gets its full add timeout
                self._send(entry_id, index, flight.data)

    def _send_backfill(self, entry_id: int, index: int, data: bytes | memoryview) -> None:
        """Copy an already acknowledged entry to a replacement bookie (best effort: the
        auditor re-replicates whatever this misses)."""

        def done(result: Any, error: BaseException | None) -> None:
            if error is not None:
                log.warning(
                    "backfill failed segment=%s entry=%s error=%s", self.segment_id, entry_id, error
                )

        try:
            self.client.add_entry_nowait(
                self._conns[index], self.segment_id, entry_id, self.lac, data, done
            )
        except ConnectionClosed as exc:
            done(None, exc)

    def _complete_in_order(self) -> None:
        while True:
            nxt = self.lac + 1
            flight = self._in_flight.get(nxt)
            if flight is None or flight.acks < self.ack_quorum:
                return
            del self._in_flight[nxt]
            self.lac = nxt
            if not self._in_flight:
                self._idle.set()
            if self._changing:
                # Acknowledged by the others while a replacement is being found: the new
                # fragment starts at or before this entry, so the new bookie gets it too.
                for index in self._targets(nxt):
                    if index in self._changing and index not in flight.acked_by:
                        self._backfill.setdefault(index, {})[nxt] = flight.data
            try:
                flight.callback(nxt, None)
            except Exception:
                log.exception("write callback failed segment=%s entry=%s", self.segment_id, nxt)

    def _fail(self, error: BaseException) -> None:
        if self._failed is None:
            self._failed = error
            log.warning("segment writer failed segment=%s error=%s", self.segment_id, error)
        flights = [(eid, flight.callback) for eid, flight in self._in_flight.items()]
        self._in_flight.clear()
        self._idle.set()
        fail_in_order(self.segment_id, flights, error)


def fail_in_order(
    segment_id: int, flights: list[tuple[int, WriteCallback]], error: BaseException
) -> None:
    """Call back every in-flight entry with ``error``, in entry order."""
    for entry_id, callback in sorted(flights, key=lambda f: f[0]):
        try:
            callback(entry_id, error)
        except Exception:
            log.exception("write callback failed segment=%s entry=%s", segment_id, entry_id)

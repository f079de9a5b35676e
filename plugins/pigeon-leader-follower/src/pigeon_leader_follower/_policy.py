"""The leader-follower replication policy (the original PigeonMQ design).

Every segment has ``E`` replicas (its ensemble).  One of them leads: the writer sends each
entry to the leader only, naming the followers; the leader stores it, forwards it to them
over one ordered stream each (:mod:`pigeon.bookie._forward`) and answers with the number
of durable copies once ``Qa - 1`` followers confirmed.  The writer acknowledges entries in
order once they have ``Qa`` copies.

Failures:

- a follower the leader cannot reach is reported in the answers (``lostReplicas``); the
  writer replaces it (an ensemble change: a new fragment in the segment's metadata) and the
  leader brings the newcomer up to date from its own copy, starting at the fragment's first
  entry, before forwarding new entries to it;
- when the leader dies (or turns read-only), the writer elects a new one among the
  followers: the one holding the most entries (it holds every acknowledged entry of the
  fragment), then the least loaded, then the first in the ensemble; replaces the dead
  leader's slot with a new follower and resends every unacknowledged entry to the new
  leader.  Resends are idempotent on every bookie, so entries some follower already had
  are acknowledged again, never written twice;
- a fenced segment (recovery by another broker) refuses the adds on every replica, and
  the writer fails.

Recovery, reads and the auditor see an ordinary ensemble in which every bookie holds
every entry (``Qw = E``): recovery is :func:`pigeon.core.replication.recover_segment`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio

from pigeon.core.errors import (
    ConnectionClosed,
    PigeonError,
    SegmentFenced,
    SegmentNotFound,
    ServiceUnavailable,
    StorageError,
    Timeout,
)
from pigeon.core.replication import (
    BookieClient,
    BookieLoad,
    PolicyBase,
    ReplaceBookie,
    WriteCallback,
    WriterBase,
    add_entry_timeout,
    fail_in_order,
)

__all__ = ["LeaderFollowerPolicy", "LeaderFollowerWriter"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Flight:
    data: bytes | memoryview
    callback: WriteCallback
    acked: bool = False
    sent_at: float = 0.0


def _replaceable(error: BaseException) -> bool:
    """A bookie being unavailable (choose another), not a refusal (fail)."""
    if isinstance(error, PigeonError):
        return error.retriable
    return isinstance(error, OSError)


class LeaderFollowerWriter(WriterBase):
    """Appends entries to one segment through its leader. One writer per segment."""

    def __init__(
        self,
        client: BookieClient,
        segment_id: int,
        ensemble: Sequence[str],
        *,
        ack_quorum: int,
        replace_bookie: ReplaceBookie | None = None,
        nursery: trio.Nursery | None = None,
        bookie_load: BookieLoad | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.segment_id = segment_id
        self.ensemble = list(ensemble)
        self.ack_quorum = min(ack_quorum, len(self.ensemble))
        self.write_quorum = len(self.ensemble)
        self.replace_bookie = replace_bookie
        self.nursery = nursery
        self.bookie_load = bookie_load
        self.leader = 0
        self.next_entry_id = 0
        self.lac = -1
        self.bytes_written = 0
        self.leader_changes = 0
        self._conn: Any = None
        self._gen = 0  # answers from a leader replaced since are ignored
        self._electing = False
        self._sync_from = 0  # first entry of the current fragment
        self._syncing = 0
        self._last_data: bytes | memoryview | None = None
        self._in_flight: dict[int, _Flight] = {}
        self._watching = False

    async def open(self) -> None:
        self._conn = await self.client.connection(self.ensemble[self.leader])

    async def _watch_stalls(self) -> None:
        """A leader that leaves an add unanswered for the add timeout (paused, cut off)
        is treated as failed: its connection is aborted, which starts a leader change."""
        while not self.closed and self._failed is None:
            await trio.sleep(add_entry_timeout() / 4)
            deadline = trio.current_time() - add_entry_timeout()
            oldest = next((f for f in self._in_flight.values() if not f.acked), None)
            conn = self._conn
            if (
                oldest is not None
                and oldest.sent_at <= deadline
                and not self._electing
                and conn is not None
                and not conn.closed
            ):
                log.warning(
                    "leader stalled segment=%s leader=%s waited=%.1fs",
                    self.segment_id,
                    self.ensemble[self.leader],
                    trio.current_time() - oldest.sent_at,
                )
                conn.abort(Timeout(f"leader {self.ensemble[self.leader]} did not answer"))

    # ------------------------------------------------------------------ state

    @property
    def leader_address(self) -> str:
        return self.ensemble[self.leader]

    def _maybe_idle(self) -> None:
        if (not self._in_flight and not self._syncing) or self._failed is not None:
            self._idle.set()

    def _followers(self) -> list[str]:
        skip = self._changing | self._down
        return [a for i, a in enumerate(self.ensemble) if i != self.leader and i not in skip]

    # ------------------------------------------------------------------ adds

    def add_nowait(self, data: bytes | memoryview, callback: WriteCallback) -> int:
        """Send one entry; ``callback(entry_id, error)`` runs once, in entry order."""
        if self._failed is not None:
            raise self._failed
        entry_id = self.next_entry_id
        self.next_entry_id += 1
        self._in_flight[entry_id] = _Flight(data, callback, sent_at=trio.current_time())
        if not self._watching and self.nursery is not None:
            self._watching = True
            self.nursery.start_soon(self._watch_stalls)
        self._busy()
        self.bytes_written += len(data)
        if not self._electing:
            self._send(entry_id, data)
        return entry_id

    def _send(self, entry_id: int, data: bytes | memoryview, *, resend: bool = False) -> None:
        gen = self._gen
        try:
            self.client.add_replicated_nowait(
                self._conn,
                self.segment_id,
                entry_id,
                self.lac,
                data,
                lambda result, error: self._on_answer(gen, entry_id, result, error),
                forward_to=self._followers(),
                forward_acks=self.ack_quorum - 1,
                sync_from=self._sync_from,
                resend=resend,
            )
        except ConnectionClosed as exc:
            self._on_answer(gen, entry_id, None, exc)

    def _resend_pending(self) -> None:
        now = trio.current_time()
        for entry_id, flight in sorted(self._in_flight.items()):
            if not flight.acked:
                flight.sent_at = now
                self._send(entry_id, flight.data, resend=True)

    def _on_answer(self, gen: int, entry_id: int, result: Any, error: BaseException | None) -> None:
        if gen != self._gen or self._failed is not None:
            return  # sent to a leader replaced since: resent to the new one
        flight = self._in_flight.get(entry_id)
        if flight is None or flight.acked:
            return
        if error is not None:
            if _replaceable(error) and self.nursery is not None and not self.closed:
                self._start_leader_change(error)
            else:
                self._fail(error)
            return
        copies, lost = result
        copies = copies or 1  # a bookie with no follower to forward to answers plainly
        for address in lost:
            self._lost(address, ConnectionClosed(f"follower {address} lost"))
        if copies >= self.ack_quorum:
            flight.acked = True
            self._complete_in_order()
        elif not self._changing:
            # too few copies and no replacement coming (none possible)
            self._fail(
                ServiceUnavailable(
                    f"segment {self.segment_id} entry {entry_id}: {copies} durable copies,"
                    f" {self.ack_quorum} needed"
                )
            )
        # else: resent once the replacement joins

    def _complete_in_order(self) -> None:
        while True:
            nxt = self.lac + 1
            flight = self._in_flight.get(nxt)
            if flight is None or not flight.acked:
                break
            del self._in_flight[nxt]
            self.lac = nxt
            self._last_data = flight.data
            try:
                flight.callback(nxt, None)
            except Exception:
                log.exception("write callback failed segment=%s entry=%s", self.segment_id, nxt)
        self._maybe_idle()

    def _fail(self, error: BaseException) -> None:
        if self._failed is None:
            self._failed = (
                error
                if isinstance(error, PigeonError)
                else StorageError(f"segment {self.segment_id}: {error}")
            )
            log.warning("segment writer failed segment=%s error=%s", self.segment_id, error)
        flights = [(eid, flight.callback) for eid, flight in self._in_flight.items()]
        self._in_flight.clear()
        self._idle.set()
        fail_in_order(self.segment_id, flights, self._failed)

    # ------------------------------------------------------------------ followers

    def _lost(self, address: str, error: BaseException) -> None:
        """A follower is gone: replace it (or write on without it while none is free)."""
        try:
            index = self.ensemble.index(address)
        except ValueError:
            return  # replaced already
        if index in self._changing or index == self.leader:
            return
        if self.replace_bookie is None or self.nursery is None or self.closed:
            self._mark_down(index, error)
            return
        self._changing.add(index)
        self.nursery.start_soon(self._change_ensemble, index)

    def _mark_down(self, index: int, error: BaseException) -> None:
        if index in self._down:
            return
        self._down.add(index)
        alive = len(self.ensemble) - len(self._down)
        if alive < self.ack_quorum:
            self._fail(
                ServiceUnavailable(
                    f"segment {self.segment_id}: {alive} replicas left, {self.ack_quorum}"
                    f" needed ({error})"
                )
            )

    async def _change_ensemble(self, index: int) -> None:
        def write_on(error: BaseException) -> None:
            """Write on with the others while the ack quorum holds."""
            self._mark_down(index, error)
            self._resend_pending()

        found = await self._replacement(index, write_on)
        if found is None or self._failed is not None:
            return
        address, _conn, first = found
        self._sync_from = first
        self._take_in(index, address, first)
        if self._electing:
            return  # the new leader gets everything pending, followers included
        if any(not f.acked for f in self._in_flight.values()):
            self._resend_pending()  # the leader brings the newcomer up first
        elif self.lac >= first and self._last_data is not None:
            self._sync_newcomer()

    def _sync_newcomer(self) -> None:
        """Nothing pending: resend the last acknowledged entry, so that the leader copies
        the fragment's acknowledged entries to the new follower now."""
        assert self._last_data is not None
        self._syncing += 1
        self._busy()

        def done(result: Any, error: BaseException | None) -> None:
            self._syncing -= 1
            if error is not None:
                log.warning("follower sync failed segment=%s error=%s", self.segment_id, error)
            self._maybe_idle()

        try:
            self.client.add_replicated_nowait(
                self._conn,
                self.segment_id,
                self.lac,
                self.lac,
                self._last_data,
                done,
                forward_to=self._followers(),
                forward_acks=len(self._followers()),
                sync_from=self._sync_from,
                resend=True,
            )
        except ConnectionClosed as exc:
            done(None, exc)

    # ------------------------------------------------------------------ the leader

    def _start_leader_change(self, error: BaseException) -> None:
        if self._electing:
            return
        self._electing = True
        self._gen += 1
        log.warning(
            "segment leader lost segment=%s leader=%s error=%s",
            self.segment_id,
            self.leader_address,
            error,
        )
        assert self.nursery is not None
        self.nursery.start_soon(self._change_leader)

    async def _change_leader(self) -> None:
        old = self.leader
        skip = self._changing | self._down | {old}
        best: tuple[tuple[int, float, int], int] | None = None
        for index, address in enumerate(self.ensemble):
            if index in skip:
                continue
            try:
                # a candidate that does not answer (paused, cut off) is passed over
                with trio.fail_after(add_entry_timeout()):
                    state = await self.client.segment_info(address, self.segment_id)
                if state["fenced"]:
                    self._fail(SegmentFenced(f"segment={self.segment_id} is fenced"))
                    return
                last = int(state["last_entry_id"])
            except SegmentNotFound:
                last = -1
            except (PigeonError, OSError, trio.TooSlowError) as exc:
                log.warning(
                    "leader candidate unreachable segment=%s bookie=%s error=%s",
                    self.segment_id,
                    address,
                    exc,
                )
                continue
            load = self.bookie_load(address) if self.bookie_load is not None else 0.0
            # most entries first (it holds every acknowledged one), then least loaded
            key = (last, -load, -index)
            if best is None or key > best[0]:
                best = (key, index)
        if self._failed is not None:
            return
        if best is None:
            self._fail(ServiceUnavailable(f"segment {self.segment_id}: no follower left to lead"))
            return
        if best[0][0] < self.lac:
            # the followers that answered lack acknowledged entries: leading from them
            # would leave holes; the ledger recovers the segment instead
            self._fail(
                ServiceUnavailable(
                    f"segment {self.segment_id}: no answering follower holds every"
                    f" acknowledged entry (up to {self.lac})"
                )
            )
            return
        self.leader = best[1]
        try:
            with trio.fail_after(add_entry_timeout()):
                self._conn = await self.client.connection(self.leader_address)
        except (PigeonError, OSError, trio.TooSlowError) as exc:
            self._fail(ServiceUnavailable(f"segment {self.segment_id}: new leader: {exc}"))
            return
        self.leader_changes += 1
        log.info(
            "segment leader elected segment=%s leader=%s held_up_to=%s",
            self.segment_id,
            self.leader_address,
            best[0][0],
        )
        self._electing = False
        if not self.closed and old not in self._changing:
            self._lost(self.ensemble[old], ConnectionClosed("leader lost"))
        self._resend_pending()


class LeaderFollowerPolicy(PolicyBase):
    """Factory of leader-follower segment writers, readers and recovery; the ensemble
    (least loaded first: it leads) is chosen by :class:`PolicyBase`."""

    name = "leader-follower"

    def new_writer(
        self,
        segment_id: int,
        ensemble: Sequence[str],
        *,
        write_quorum: int | None = None,
        **options: Any,
    ) -> LeaderFollowerWriter:
        """The leader-follower writer (connected by :meth:`PolicyBase.create_writer`);
        ``write_quorum`` is passed over: every replica holds every entry."""
        return LeaderFollowerWriter(
            self.client, segment_id, ensemble, bookie_load=self.bookie_load, **options
        )

    def segment_write_quorum(self, ensemble: Sequence[str], write_quorum: int | None) -> int:
        """Every replica holds every entry: reads and recovery (:class:`PolicyBase`'s) see
        an ensemble with ``Qw = E``."""
        return len(ensemble)

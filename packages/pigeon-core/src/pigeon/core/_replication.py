"""The built-in ``quorum`` replication policy (BookKeeper's protocol).

An entry ``i`` of a segment with ensemble ``E`` goes to the ``Qw`` bookies starting at
``i mod E``; it is acknowledged to the writer's caller once ``Qa`` of them acknowledged it
*and* every earlier entry is acknowledged, so callbacks always complete in entry order
and the last-add-confirmed (LAC) only moves forward.

A bookie that fails mid-write is replaced for the entries not yet acknowledged (an
ensemble change: a new fragment in the segment's metadata); entries it had acknowledged
are copied to the replacement.  Recovery of a segment whose writer died
(:func:`recover_segment`): fence it, read forward from the LAC, re-replicate what is found
and end the segment at the first entry that cannot have been acknowledged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from pigeon.core._bookie_client import BookieClient
from pigeon.core._policy import (
    BookieLoad,
    ReplaceBookie,
    ReplicationPolicy,
    SegmentWriter,
    WriteCallback,
)
from pigeon.core.errors import (
    ConfigError,
    ConnectionClosed,
    CorruptEntry,
    EntryNotFound,
    PigeonError,
    SegmentNotFound,
    ServiceUnavailable,
    StorageError,
    Timeout,
)

__all__ = [
    "BookieLoad",
    "PolicyBase",
    "QuorumPolicy",
    "QuorumWriter",
    "ReplicaRepairs",
    "fail_in_order",
    "read_replicas",
    "recover_segment",
]

log = logging.getLogger(__name__)

#: a fence, recovery read or recovery add that a bookie does not answer in this time is
#: given up (the bookie counts as not answering)
RECOVERY_OP_TIMEOUT_S = 5.0
#: recovery adds in flight to one bookie at a time
RECOVERY_COPY_WINDOW = 256
#: once enough bookies answered a fence, how long the others may still take
FENCE_GRACE_S = 0.5
#: an add a bookie leaves unanswered this long counts as that bookie failing (Pulsar's
#: bookkeeper_client_timeout_in_seconds plays this part)
ADD_ENTRY_TIMEOUT_S = 10.0


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
        replace_bookie: ReplaceBookie | None = None,
        nursery: trio.Nursery | None = None,
    ) -> None:
        self.client = client
        self.segment_id = segment_id
        self.ensemble = list(ensemble)
        self.replace_bookie = replace_bookie
        self.nursery = nursery
        self._changing: set[int] = set()
        self._down: set[int] = set()
        self._backfill: dict[int, dict[int, bytes | memoryview]] = {}
        self.ensemble_changes = 0
        self.closed = False
        self._idle = trio.Event()
        self._idle.set()
        self.write_quorum = write_quorum
        self.ack_quorum = ack_quorum
        self.next_entry_id = 0
        self.lac = -1
        self.bytes_written = 0
        self._in_flight: dict[int, _InFlight] = {}
        self._failed: BaseException | None = None
        self._conns: list[Any] = []
        self._watching = False
        self.add_timeout = ADD_ENTRY_TIMEOUT_S

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

    @property
    def pending(self) -> int:
        return len(self._in_flight)

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

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def _targets(self, entry_id: int) -> list[int]:
        e = len(self.ensemble)
        return [(entry_id + k) % e for k in range(self.write_quorum)]

    def add_nowait(self, data: bytes | memoryview, callback: WriteCallback) -> int:
        """Send one entry; ``callback(entry_id, error)`` runs once, in entry order."""
        if self._failed is not None:
            raise self._failed
        entry_id = self.next_entry_id
        self.next_entry_id += 1
        self._in_flight[entry_id] = _InFlight(callback, data, trio.current_time())
        if self._idle.is_set():
            self._idle = trio.Event()
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
        failed = self.ensemble[index]
        delay = 0.2
        while True:
            try:
                assert self.replace_bookie is not None
                address = await self.replace_bookie(index, self.lac + 1)
                conn = await self.client.connection(address)
                break
            except (PigeonError, OSError) as exc:
                if self._failed is not None or self.closed:
                    return
                # No spare bookie yet: write on with the others while the ack quorum
                # holds (entries are under-replicated until the change), and try again.
                log.warning(
                    "ensemble change pending segment=%s bookie=%s error=%s",
                    self.segment_id,
                    failed,
                    exc,
                )
                self._count_down(index, exc)
                await trio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.ensemble[index] = address
        self._conns[index] = conn
        self._changing.discard(index)
        self._down.discard(index)
        self.ensemble_changes += 1
        log.info(
            "ensemble changed segment=%s replaced=%s with=%s from_entry=%s",
            self.segment_id,
            failed,
            address,
            self.lac + 1,
        )
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


class PolicyBase:
    """What every replication policy shares: its sizes, checked, the choice of an
    ensemble (the least loaded writable bookies when loads are known, else in order)
    and the repair of damaged copies found by reads (:class:`ReplicaRepairs`)."""

    name = ""

    def __init__(
        self,
        client: BookieClient,
        *,
        ensemble_size: int = 1,
        write_quorum: int = 1,
        ack_quorum: int = 1,
        bookie_load: BookieLoad | None = None,
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
        self.bookie_load = bookie_load
        self.repairs = ReplicaRepairs(client)

    async def stored_last_entry(self, segment_id: int, ensemble: Sequence[str]) -> int:
        """The highest entry id any bookie of ``ensemble`` holds of the segment (-1:
        none holds any); ServiceUnavailable when a bookie that does not answer might
        hold more than those that do."""
        top = -1
        errors: list[BaseException] = []
        for address in dict.fromkeys(ensemble):
            try:
                state = await self.client.segment_info(address, segment_id)
            except SegmentNotFound:
                continue
            except (ConnectionClosed, ServiceUnavailable, StorageError, OSError) as exc:
                errors.append(exc)
                continue
            top = max(top, int(state["last_entry_id"]))
        if errors:
            raise ServiceUnavailable(
                f"segment {segment_id}: {len(errors)} bookies did not answer ({errors[-1]})"
            )
        return top

    def choose_ensemble(
        self, bookies: Sequence[str], ensemble_size: int | None = None
    ) -> list[str]:
        size = ensemble_size or self.ensemble_size
        if len(bookies) < size:
            raise ServiceUnavailable(f"need {size} writable bookies, {len(bookies)} available")
        if self.bookie_load is not None:
            load = self.bookie_load
            bookies = sorted(bookies, key=lambda b: (load(b), b))
        return list(bookies[:size])


#: entries a read copies at most to one bookie that lacks the tail of a segment
REPAIR_MAX_ENTRIES = 1024
#: how long a read may spend repairing the copies it found damaged
REPAIR_TIMEOUT_S = 5.0
#: a bookie that leaves a read unanswered this long (paused, cut off) is passed over
#: for the next replica, and asked last for a while (BookKeeper's speculative read
#: timeout and slow-bookie reordering play this part)
READ_TIMEOUT_S = 2.0
#: the errors with which a bookie that answered says it has no intact copy
_DAMAGED = (CorruptEntry, EntryNotFound, SegmentNotFound)


async def read_replicas(
    client: BookieClient,
    segment_id: int,
    replicas: Sequence[str],
    first: int,
    last: int,
    *,
    max_bytes: int = 8 << 20,
    max_count: int = 10_000,
    write_set: Callable[[int], Sequence[str]] | None = None,
    repairs: ReplicaRepairs | None = None,
) -> list[tuple[int, memoryview]]:
    """Entries ``first..last`` (fewer if limits hit) from the first of ``replicas``
    (bookies that should all hold ``first``) that has ``first`` intact.

    A bookie whose copy of ``first`` is damaged (CorruptEntry) or missing (EntryNotFound,
    SegmentNotFound: a truncated file, a lost disk) is passed over for the next one; the
    read is logged, and with ``repairs`` the good entries are copied back to it (see
    :class:`ReplicaRepairs`; only for segments no writer appends to any more).  When
    every replica answered and none has ``first`` intact, the error says so
    (CorruptEntry if any copy is damaged, else EntryNotFound); when some did not
    answer, a retriable error (they may have it).
    """
    unreachable: list[BaseException] = []
    damaged: dict[str, PigeonError] = {}
    for address in client.by_responsiveness(replicas):
        try:
            with trio.fail_after(READ_TIMEOUT_S):
                got = await client.read_entries(
                    address, segment_id, first, last, max_bytes=max_bytes, max_count=max_count
                )
        except _DAMAGED as exc:
            damaged[address] = exc
            continue
        except (ConnectionClosed, ServiceUnavailable, StorageError, OSError) as exc:
            unreachable.append(exc)
            continue
        except trio.TooSlowError:
            client.note_slow(address)
            unreachable.append(Timeout(f"bookie {address} did not answer a read in time"))
            continue
        if not got:
            damaged[address] = EntryNotFound(f"segment={segment_id} entry={first} not stored")
            continue
        if damaged:
            log.warning(
                "entry read from another replica segment=%s entry=%s bookie=%s damaged_on=%s",
                segment_id,
                first,
                address,
                {a: str(exc) for a, exc in damaged.items()},
            )
            if repairs is not None:
                await repairs.repair(
                    segment_id, address, damaged, got, write_set or (lambda _e: replicas)
                )
        return got
    if damaged and not unreachable:
        detail = "; ".join(f"{a}: {exc}" for a, exc in damaged.items())
        if any(isinstance(exc, CorruptEntry) for exc in damaged.values()):
            raise CorruptEntry(
                f"segment={segment_id} entry={first} is damaged or missing on every replica"
                f" ({detail})"
            )
        raise EntryNotFound(
            f"segment={segment_id} entry={first} is on none of its replicas ({detail})"
        )
    if unreachable:
        if damaged:
            raise ServiceUnavailable(
                f"segment={segment_id} entry={first}: damaged on {sorted(damaged)}, other"
                f" replicas unreachable ({unreachable[-1]})"
            )
        raise unreachable[-1]
    raise ServiceUnavailable("no bookie to read from")


async def read_striped(
    client: BookieClient,
    segment_id: int,
    ensemble: Sequence[str],
    write_quorum: int,
    first: int,
    last: int,
    *,
    max_bytes: int = 8 << 20,
    max_count: int = 10_000,
    repairs: ReplicaRepairs | None = None,
) -> list[tuple[int, memoryview]]:
    """Entries ``first..last`` of a striped fragment (``write_quorum < len(ensemble)``),
    read from every bookie of ``ensemble`` at once, each from the first id it holds.

    Each bookie holds only the ids whose write set names it, so no one bookie serves
    the range: the answers are merged and the result ends before the first id none of
    them returned (a bookie that failed, or lacks entries, is covered by the others
    holding the same ids).  [] when nobody returned ``first``: the caller then reads
    that entry alone, which says why.  With ``repairs``, a bookie that stopped short of
    ids it should hold gets them copied back (see :class:`ReplicaRepairs`).  Each entry
    travels ``write_quorum`` times, against one round trip per entry otherwise.
    """
    e = len(ensemble)

    def write_set(entry_id: int) -> list[str]:
        return [ensemble[(entry_id + k) % e] for k in range(write_quorum)]

    count = min(max_count, last - first + 1)
    answers: dict[str, list[tuple[int, memoryview]] | BaseException] = {}
    # Any e - write_quorum + 1 bookies hold every id between them: once that many
    # answered, stragglers (paused, cut off) are not waited for.
    enough = e - write_quorum + 1
    asked: list[str] = []
    answered = trio.Event()

    async def read_one(address: str, start: int) -> None:
        try:
            answers[address] = await client.read_entries(
                address,
                segment_id,
                start,
                min(last, start + count - 1),
                max_bytes=max_bytes,
                max_count=count,
            )
        except (PigeonError, OSError) as exc:
            answers[address] = exc  # covered by the other holders, or said by the caller
        ok = sum(1 for got in answers.values() if not isinstance(got, BaseException))
        if ok >= enough or len(answers) == len(asked):
            answered.set()

    async with trio.open_nursery() as nursery:
        for address in ensemble:
            # the first id >= first this bookie holds
            start = next(i for i in range(first, first + e) if address in write_set(i))
            if start <= last:
                asked.append(address)
                nursery.start_soon(read_one, address, start)
        with trio.move_on_after(READ_TIMEOUT_S):
            await answered.wait()
        for address in asked:
            if address not in answers:
                client.note_slow(address)
        nursery.cancel_scope.cancel()
    merged: dict[int, memoryview] = {}
    for got in answers.values():
        if not isinstance(got, BaseException):
            for entry_id, data in got:
                merged.setdefault(entry_id, data)
    out: list[tuple[int, memoryview]] = []
    total = 0
    entry_id = first
    while entry_id in merged and len(out) < count:
        data = merged[entry_id]
        if out and total + len(data) > max_bytes:
            break
        out.append((entry_id, data))
        total += len(data)
        entry_id += 1
    if out and repairs is not None:
        for address, got in answers.items():
            error: PigeonError
            if isinstance(got, _DAMAGED):  # it lacks (or has damaged) the first it holds
                error = got
                short = [i for i, _ in out if address in write_set(i)]
            elif isinstance(got, list) and got:  # ids missing below the last it returned
                held = {i for i, _ in got}
                short = [
                    i
                    for i, _ in out
                    if i < got[-1][0] and address in write_set(i) and i not in held
                ]
                error = EntryNotFound(f"segment={segment_id}: ids missing below {got[-1][0]}")
            else:
                continue  # unreachable, or nothing asked: nothing known to repair
            if short:
                await repairs.repair(
                    segment_id,
                    next(a for a in write_set(short[0]) if a != address),
                    {address: error},
                    [item for item in out if item[0] >= short[0]],
                    write_set,
                )
    return out


class ReplicaRepairs:
    """Copies good entries back to bookies whose copy a read found damaged or missing.

    A damaged entry is sent as a recovery add: the bookie rewrites it in place where its
    bytes provably belong, and refuses otherwise.  A bookie missing the tail of the
    segment (its file was truncated) gets the entries after its last one, in order, up
    to the ones just read (at most :data:`REPAIR_MAX_ENTRIES` per read; the next reads
    go on).  Only one repair per (bookie, segment) runs at a time, each bounded by
    :data:`REPAIR_TIMEOUT_S`; a failed repair is logged and left to the next read (or
    the auditor).  Callers repair only segments no writer appends to any more: a
    recovery add racing the writer's own add would fail the writer's.
    """

    def __init__(self, client: BookieClient) -> None:
        self.client = client
        self._busy: set[tuple[str, int]] = set()
        #: entries written back by repairs
        self.repaired = 0

    async def repair(
        self,
        segment_id: int,
        good: str,
        damaged: dict[str, PigeonError],
        got: Sequence[tuple[int, bytes | memoryview]],
        write_set: Callable[[int], Sequence[str]],
    ) -> None:
        with trio.move_on_after(REPAIR_TIMEOUT_S) as scope:
            for address, error in damaged.items():
                key = (address, segment_id)
                if key in self._busy:
                    continue
                self._busy.add(key)
                try:
                    await self._repair_one(segment_id, good, address, error, got, write_set)
                except (PigeonError, OSError) as exc:
                    log.warning(
                        "replica repair failed segment=%s entry=%s bookie=%s error=%s",
                        segment_id,
                        got[0][0],
                        address,
                        exc,
                    )
                finally:
                    self._busy.discard(key)
        if scope.cancelled_caught:
            log.warning("replica repair timed out segment=%s entry=%s", segment_id, got[0][0])

    async def _repair_one(
        self,
        segment_id: int,
        good: str,
        address: str,
        error: PigeonError,
        got: Sequence[tuple[int, bytes | memoryview]],
        write_set: Callable[[int], Sequence[str]],
    ) -> None:
        first = got[0][0]
        if isinstance(error, CorruptEntry):
            await self.client.add_entry(address, segment_id, first, -1, got[0][1], recovery=True)
            self.repaired += 1
            log.info("replica repaired segment=%s entry=%s bookie=%s", segment_id, first, address)
            return
        try:
            have = int((await self.client.segment_info(address, segment_id))["last_entry_id"])
        except SegmentNotFound:
            have = -1
        if have >= first:
            log.warning(
                "replica lacks an entry below its last one, not repairable by a read"
                " segment=%s entry=%s bookie=%s last_entry=%s",
                segment_id,
                first,
                address,
                have,
            )
            return
        # Append, in order, what it should hold after its last entry: the ids before
        # this read (fetched from ``good`` first, else from another holder), then those
        # just read.  An id it should hold that no holder has stops the repair there.
        todo: list[tuple[int, bytes | memoryview]] = []
        i = have + 1
        while i < first and len(todo) < REPAIR_MAX_ENTRIES:
            holders = [m for m in write_set(i) if m != address]
            if len(holders) == len(write_set(i)):  # not one of its ids
                i += 1
                continue
            holders.sort(key=lambda m: m != good)
            fetched = await read_replicas(
                self.client,
                segment_id,
                holders,
                i,
                first - 1,
                max_count=REPAIR_MAX_ENTRIES - len(todo),
            )
            todo.append(fetched[0])
            i = fetched[0][0] + 1
            for eid, data in fetched[1:]:
                if any(address in write_set(j) for j in range(i, eid)):
                    break  # the source skipped an id it should hold: read it on its own
                if address in write_set(eid):
                    todo.append((eid, data))
                i = eid + 1
        if i >= first:
            todo.extend(item for item in got if address in write_set(item[0]))
        copied = 0
        for entry_id, payload in todo[:REPAIR_MAX_ENTRIES]:
            await self.client.add_entry(address, segment_id, entry_id, -1, payload, recovery=True)
            copied += 1
        self.repaired += copied
        log.info(
            "replica tail repaired segment=%s bookie=%s from_entry=%s entries=%s",
            segment_id,
            address,
            have + 1,
            copied,
        )


def fail_in_order(
    segment_id: int, flights: list[tuple[int, WriteCallback]], error: BaseException
) -> None:
    """Call back every in-flight entry with ``error``, in entry order."""
    for entry_id, callback in sorted(flights, key=lambda f: f[0]):
        try:
            callback(entry_id, error)
        except Exception:
            log.exception("write callback failed segment=%s entry=%s", segment_id, entry_id)


class QuorumPolicy(PolicyBase):
    """Factory of segment writers/readers with the quorum protocol."""

    name = "quorum"

    async def create_writer(
        self,
        segment_id: int,
        ensemble: Sequence[str],
        *,
        write_quorum: int | None = None,
        ack_quorum: int | None = None,
        replace_bookie: ReplaceBookie | None = None,
        nursery: trio.Nursery | None = None,
    ) -> QuorumWriter:
        writer = QuorumWriter(
            self.client,
            segment_id,
            ensemble,
            write_quorum=write_quorum or self.write_quorum,
            ack_quorum=ack_quorum or self.ack_quorum,
            replace_bookie=replace_bookie,
            nursery=nursery,
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
        repair: bool = False,
    ) -> list[tuple[int, memoryview]]:
        """Entries ``first..last`` (fewer if limits hit), from the first bookie of the
        entry's write set that has ``first`` intact; see :func:`read_replicas` for the
        errors and for ``repair``."""
        e = len(ensemble)
        qw = min(write_quorum or self.write_quorum, e)
        repairs = self.repairs if repair else None
        if qw < e and last > first:
            got = await read_striped(
                self.client,
                segment_id,
                ensemble,
                qw,
                first,
                last,
                max_bytes=max_bytes,
                max_count=max_count,
                repairs=repairs,
            )
            if got:
                return got
            # ``first`` came from no bookie: the one-entry read below says why (and
            # repairs what it can)
        if qw == e:
            candidates = list(ensemble)
        else:
            # Striped: only the bookies holding ``first`` serve it.
            candidates = [ensemble[(first + k) % e] for k in range(qw)]
            last = first
        start = first % len(candidates) if candidates else 0
        order = [candidates[(start + i) % len(candidates)] for i in range(len(candidates))]
        return await read_replicas(
            self.client,
            segment_id,
            order,
            first,
            last,
            max_bytes=max_bytes,
            max_count=max_count,
            write_set=lambda entry: [ensemble[(entry + k) % e] for k in range(qw)],
            repairs=repairs,
        )

    async def recover(
        self,
        segment_id: int,
        ensemble: Sequence[str],
        *,
        ack_quorum: int | None = None,
        write_quorum: int | None = None,
        first_entry: int = 0,
    ) -> int:
        """Fence the segment, read forward past the LAC and re-replicate what is found;
        return the last entry id (-1 if empty).  ``ensemble`` is the segment's last
        fragment's, which starts at ``first_entry`` (every entry before it was
        acknowledged)."""
        e = len(ensemble)
        qw = min(write_quorum or self.write_quorum, e)
        qa = min(ack_quorum or self.ack_quorum, qw)
        return await recover_segment(
            self.client,
            segment_id,
            ensemble,
            write_set=lambda entry: [ensemble[(entry + k) % e] for k in range(qw)],
            write_quorum=qw,
            ack_quorum=qa,
            first_entry=first_entry,
        )


async def recover_segment(
    client: BookieClient,
    segment_id: int,
    ensemble: Sequence[str],
    *,
    write_set: Callable[[int], Sequence[str]],
    write_quorum: int,
    ack_quorum: int,
    first_entry: int = 0,
) -> int:
    """Recovery of a segment whose writer is gone (BookKeeper's): fence it on every
    bookie that answers, so the old writer can add nothing more; then read forward from
    the highest LAC any of them knows.  An entry found on any bookie may have been
    acknowledged: it is recovered and written again (a recovery add) to every answering
    bookie of its write set that lacks it.  The first entry that enough bookies of its
    write set do not hold (more than ``write_quorum - ack_quorum``, so it cannot have
    reached an ack quorum) ends the segment.  Returns the last entry id (-1: empty).

    Raises ServiceUnavailable when too few bookies answer to decide.
    """
    states: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    async def fence(address: str) -> None:
        try:
            states[address] = await client.fence(address, segment_id)
        except (ConnectionClosed, ServiceUnavailable, StorageError, OSError) as exc:
            errors.append(exc)

    needed = len(ensemble) - min(ack_quorum, len(ensemble)) + 1
    members = list(dict.fromkeys(ensemble))
    # A bookie that does not answer (paused, cut off) must not hold recovery up: once
    # enough have answered, the others get a short grace; none waits longer than
    # RECOVERY_OP_TIMEOUT_S.
    enough = trio.Event()

    async def fence_one(address: str) -> None:
        await fence(address)
        if len(states) >= needed or len(states) + len(errors) == len(members):
            enough.set()

    with trio.move_on_after(RECOVERY_OP_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for address in members:
                nursery.start_soon(fence_one, address)
            await enough.wait()
            if len(states) + len(errors) < len(members):
                nursery.cancel_scope.deadline = min(
                    nursery.cancel_scope.deadline, trio.current_time() + FENCE_GRACE_S
                )
    if len(states) < needed:
        raise ServiceUnavailable(
            f"cannot recover segment {segment_id}: only {len(states)} of {len(ensemble)} "
            f"bookies answered ({errors[-1] if errors else 'no error'})"
        )
    # entries before the last fragment were all acknowledged when it was created
    lac = max(first_entry - 1, *(int(s["lac"]) for s in states.values()))
    top = max(int(s["last_entry_id"]) for s in states.values())
    held: dict[str, dict[int, bytes | memoryview]] = {}
    for address, state in list(states.items()):
        tail = await _read_tail(client, address, segment_id, lac + 1, state)
        if tail is None:
            # a bookie whose tail could not be read did not answer: it must not count
            # as one that lacks the entries
            del states[address]
        else:
            held[address] = tail
    if len(states) < needed:
        raise ServiceUnavailable(
            f"cannot recover segment {segment_id}: only {len(states)} of {len(ensemble)} "
            "bookies could be read"
        )
    last = lac
    copies: dict[str, list[tuple[int, bytes | memoryview]]] = {}
    for entry in range(lac + 1, top + 1):
        targets = list(write_set(entry))
        have = [a for a in targets if entry in held.get(a, {})]
        if not have:
            # a bookie that answered and lacks it never got it (adds arrive in order)
            lacking = sum(1 for a in targets if a in states)
            if lacking > write_quorum - ack_quorum:
                break
            raise ServiceUnavailable(
                f"cannot recover segment {segment_id}: entry {entry} is on no bookie that"
                f" answered, and {len(targets) - lacking} of its bookies did not answer"
            )
        data = held[have[0]][entry]
        for address in targets:
            if address in states and address not in have:
                copies.setdefault(address, []).append((entry, data))
        last = entry
    copied = 0
    async with trio.open_nursery() as nursery:
        for address, entries in copies.items():

            async def copy(
                address: str = address, entries: list[tuple[int, bytes | memoryview]] = entries
            ) -> None:
                nonlocal copied
                copied += await _copy_entries(client, address, segment_id, lac, entries)

            nursery.start_soon(copy)
    log.info(
        "segment recovered segment=%s last_entry=%s lac=%s re_replicated=%s answered=%s/%s",
        segment_id,
        last,
        lac,
        copied,
        len(states),
        len(ensemble),
    )
    return last


async def _copy_entries(
    client: BookieClient,
    address: str,
    segment_id: int,
    lac: int,
    entries: list[tuple[int, bytes | memoryview]],
) -> int:
    """Recovery adds of ``entries`` to one bookie, pipelined RECOVERY_COPY_WINDOW at a
    time; stops at the first that fails or does not answer within RECOVERY_OP_TIMEOUT_S
    (the entries are recovered all the same: they exist; the auditor restores their
    copies).  Returns how many were copied."""
    copied = 0
    try:
        with trio.fail_after(RECOVERY_OP_TIMEOUT_S):
            conn = await client.connection(address)
        for start in range(0, len(entries), RECOVERY_COPY_WINDOW):
            chunk = entries[start : start + RECOVERY_COPY_WINDOW]
            await _add_window(client, conn, segment_id, lac, chunk)
            copied += len(chunk)
    except (PigeonError, OSError, trio.TooSlowError) as exc:
        log.warning(
            "recovery re-replication stopped segment=%s bookie=%s copied=%d left=%d error=%s",
            segment_id,
            address,
            copied,
            len(entries) - copied,
            str(exc) or "no answer in time",
        )
    return copied


async def _add_window(
    client: BookieClient,
    conn: Any,
    segment_id: int,
    lac: int,
    chunk: list[tuple[int, bytes | memoryview]],
) -> None:
    """Send ``chunk``'s recovery adds at once, in order; wait until all are answered."""
    left = len(chunk)
    failure: list[BaseException] = []
    answered = trio.Event()

    def on_added(_result: Any, error: BaseException | None) -> None:
        nonlocal left
        left -= 1
        if error is not None:
            failure.append(error)
        if left == 0 or error is not None:
            answered.set()

    for entry, data in chunk:
        client.add_entry_nowait(conn, segment_id, entry, lac, data, on_added, recovery=True)
    with trio.fail_after(RECOVERY_OP_TIMEOUT_S):
        await answered.wait()
    if failure:
        raise ServiceUnavailable(str(failure[0]))


async def _read_tail(
    client: BookieClient, address: str, segment_id: int, first: int, state: dict[str, Any]
) -> dict[int, bytes | memoryview] | None:
    """The entries ``first..`` one bookie holds (it may skip ids: striping); None when
    the bookie could not be read to the end."""
    out: dict[int, bytes | memoryview] = {}
    last = int(state["last_entry_id"])
    entry = first
    while entry <= last:
        try:
            with trio.fail_after(RECOVERY_OP_TIMEOUT_S):
                got = await client.read_entries(address, segment_id, entry, last)
        except trio.TooSlowError:
            log.warning(
                "recovery read timed out segment=%s bookie=%s entry=%s", segment_id, address, entry
            )
            return None
        except (EntryNotFound, CorruptEntry):
            entry += 1  # skipped (not in this bookie's share) or damaged here
            continue
        except (ConnectionClosed, ServiceUnavailable, StorageError, OSError) as exc:
            log.warning(
                "recovery read failed segment=%s bookie=%s entry=%s error=%s",
                segment_id,
                address,
                entry,
                exc,
            )
            return None
        if not got:
            break
        for entry_id, data in got:
            out[entry_id] = bytes(data)
        entry = got[-1][0] + 1
    return out


if TYPE_CHECKING:  # mypy checks that the quorum policy and writer follow the protocols
    _policy: type[ReplicationPolicy] = QuorumPolicy
    _writer: type[SegmentWriter] = QuorumWriter

"""Reads of a segment's replicas: passing over a damaged, missing or silent copy for
an intact one (:func:`read_replicas`), reading a striped range in one call per bookie
(:func:`read_striped`), and repairing the damaged copies found (:class:`ReplicaRepairs`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import trio

from pigeon.core._bookie_client import BookieClient
from pigeon.core.errors import (
    AuthenticationError,
    AuthorizationError,
    ConnectionClosed,
    CorruptEntry,
    EntryNotFound,
    PigeonError,
    SegmentNotFound,
    ServiceUnavailable,
    StorageError,
    Timeout,
    TlsError,
)

__all__ = ["UNANSWERED", "ReplicaRepairs", "read_replicas", "read_striped"]

#: the replication layer's one logger (its modules share the name)
log = logging.getLogger("pigeon.core._replication")

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
#: the errors with which a bookie did not answer (it may hold what was asked); a bookie
#: whose TLS or credentials check refused this node did not answer either: one
#: misconfigured bookie must not fail reads and recovery the others can serve
UNANSWERED = (
    ConnectionClosed,
    ServiceUnavailable,
    StorageError,
    OSError,
    TlsError,
    AuthenticationError,
    AuthorizationError,
)


async def read_replicas(
    client: BookieClient,
    segment_id: int,
    replicas: Sequence[str],
    first: int,
    last: int,
    *,
    write_set: Callable[[int], Sequence[str]] | None = None,
    repairs: ReplicaRepairs | None = None,
    max_bytes: int = 8 << 20,
    max_count: int = 10_000,
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
        except UNANSWERED as exc:
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

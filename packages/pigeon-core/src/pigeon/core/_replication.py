"""The built-in ``quorum`` replication policy (BookKeeper's protocol).

:class:`QuorumPolicy` writes with :class:`~pigeon.core._quorum_writer.QuorumWriter` (an
entry goes to ``Qw`` bookies and is acknowledged in entry order once ``Qa`` of them have
it; a bookie that fails mid-write is replaced), reads with
:mod:`pigeon.core._replica_reads` (an intact copy wherever it is, damaged ones repaired),
and recovers a segment whose writer died (:func:`recover_segment`): fence it, read
forward from the LAC, re-replicate what is found and end the segment at the first entry
that cannot have been acknowledged.  :class:`PolicyBase` is what every policy shares
(the leader-follower plugin's too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import trio

from pigeon.core._bookie_client import BookieClient
from pigeon.core._policy import (
    BookieLoad,
    ReplaceBookie,
    ReplicationPolicy,
    SegmentWriter,
)
from pigeon.core._quorum_writer import QuorumWriter, WriterBase, fail_in_order
from pigeon.core._replica_reads import UNANSWERED, ReplicaRepairs, read_replicas, read_striped
from pigeon.core.errors import (
    ConfigError,
    CorruptEntry,
    EntryNotFound,
    PigeonError,
    SegmentNotFound,
    ServiceUnavailable,
)

__all__ = [
    "BookieLoad",
    "PolicyBase",
    "QuorumPolicy",
    "QuorumWriter",
    "ReplicaRepairs",
    "WriterBase",
    "fail_in_order",
    "read_replicas",
    "read_striped",
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


class OpeningWriter(SegmentWriter, Protocol):
    """A segment writer that connects to its ensemble before its first add."""

    async def open(self) -> None: ...


class PolicyBase:
    """What every replication policy shares: its sizes, checked, the choice of an
    ensemble (the least loaded writable bookies when loads are known, else in order),
    reads and recovery of a fragment whose entry ``i`` is on the ``Qw`` bookies from
    ``ensemble[i % E]`` on (a policy says its ``Qw`` with :meth:`segment_write_quorum`
    and its writer with :meth:`new_writer`) and the repair of damaged copies found by
    reads (:class:`ReplicaRepairs`)."""

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
            except UNANSWERED as exc:
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

    async def create_writer(
        self,
        segment_id: int,
        ensemble: Sequence[str],
        *,
        write_quorum: int | None = None,
        ack_quorum: int | None = None,
        replace_bookie: ReplaceBookie | None = None,
        nursery: trio.Nursery | None = None,
    ) -> OpeningWriter:
        """The policy's writer (:meth:`new_writer`) with the policy's quorums unless
        given, connected to its ensemble."""
        writer = self.new_writer(
            segment_id,
            ensemble,
            write_quorum=write_quorum or self.write_quorum,
            ack_quorum=ack_quorum or self.ack_quorum,
            replace_bookie=replace_bookie,
            nursery=nursery,
        )
        await writer.open()
        return writer

    def new_writer(self, segment_id: int, ensemble: Sequence[str], **options: Any) -> OpeningWriter:
        """A writer of a new segment, not yet connected; ``options`` are
        ``write_quorum``, ``ack_quorum``, ``replace_bookie`` and ``nursery``."""
        raise NotImplementedError

    def segment_write_quorum(self, ensemble: Sequence[str], write_quorum: int | None) -> int:
        """Qw of a fragment of ``ensemble`` written with ``write_quorum`` (None: the
        policy's): entry ``i`` is on the Qw bookies from ``ensemble[i % E]`` on."""
        return min(write_quorum or self.write_quorum, len(ensemble))

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
        qw = self.segment_write_quorum(ensemble, write_quorum)
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
            write_set=lambda entry: [ensemble[(entry + k) % e] for k in range(qw)],
            repairs=repairs,
            max_bytes=max_bytes,
            max_count=max_count,
        )

    async def recover(
        self,
        segment_id: int,
        ensemble: Sequence[str],
        *,
        first_entry: int = 0,
        ack_quorum: int | None = None,
        write_quorum: int | None = None,
    ) -> int:
        """Fence the segment, read forward past the LAC and re-replicate what is found
        (:func:`recover_segment`); return the last entry id (-1 if empty).  ``ensemble``
        is the segment's last fragment's, which starts at ``first_entry`` (every entry
        before it was acknowledged)."""
        e = len(ensemble)
        qw = self.segment_write_quorum(ensemble, write_quorum)
        return await recover_segment(
            self.client,
            segment_id,
            ensemble,
            write_set=lambda entry: [ensemble[(entry + k) % e] for k in range(qw)],
            write_quorum=qw,
            ack_quorum=min(ack_quorum or self.ack_quorum, qw),
            first_entry=first_entry,
        )


class QuorumPolicy(PolicyBase):
    """Factory of segment writers/readers with the quorum protocol."""

    name = "quorum"

    def new_writer(self, segment_id: int, ensemble: Sequence[str], **options: Any) -> QuorumWriter:
        # read here, at each new writer, so that a test may shorten it (monkeypatch)
        return QuorumWriter(
            self.client, segment_id, ensemble, add_timeout=ADD_ENTRY_TIMEOUT_S, **options
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
        except UNANSWERED as exc:
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
        except UNANSWERED as exc:
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

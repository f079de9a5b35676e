"""What a replication policy and its segment writers offer, as :class:`typing.Protocol`
classes: the broker's managed ledger and auditor are written against these, and every
policy a plugin registers (``pigeon_replication_policies``) must follow them.

A policy does not have to inherit from anything; :class:`pigeon.core.replication.PolicyBase`
holds what the two shipped policies (``quorum``, ``leader-follower``) share, and
:class:`pigeon.core.testing.ReplicationPolicyContract` is the suite a policy runs against
itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypedDict, Unpack, runtime_checkable

if TYPE_CHECKING:
    import trio

    from pigeon.core._bookie_client import BookieClient

__all__ = [
    "BookieLoad",
    "ReadOptions",
    "RecoverOptions",
    "ReplaceBookie",
    "ReplicationPolicy",
    "SegmentWriter",
    "WriteCallback",
    "WriterOptions",
]

#: ``callback(entry_id, error)`` of one add: ``error`` is None once the entry is
#: acknowledged (an ack quorum holds it and every earlier entry is acknowledged)
WriteCallback = Callable[[int, BaseException | None], None]

#: ``replace(index, first_entry_id) -> new bookie address``: the ledger picks a bookie
#: outside the ensemble, records a new fragment in the segment's metadata and returns it.
ReplaceBookie = Callable[[int, int], Awaitable[str]]

#: ``bookie_load(address) -> bytes/s`` the bookie reported (brokers pass their directory's)
BookieLoad = Callable[[str], float]


@runtime_checkable
class SegmentWriter(Protocol):
    """Appends entries to one segment; only one writer ever exists per segment.

    Made by :meth:`ReplicationPolicy.create_writer`.  Entries get consecutive ids from 0
    and are acknowledged in id order; a writer that failed takes no more adds, and the
    ledger then recovers the segment (:meth:`ReplicationPolicy.recover`) to settle the
    entries it left in flight.
    """

    @property
    def next_entry_id(self) -> int:
        """The id the next :meth:`add_nowait` gives its entry."""

    @property
    def lac(self) -> int:
        """Last add confirmed: every entry up to it is acknowledged (-1: none)."""

    @property
    def bytes_written(self) -> int:
        """Bytes of the entries added so far (the ledger rolls to a new segment on it)."""

    @property
    def pending(self) -> int:
        """Entries added and not yet called back."""

    @property
    def failed(self) -> BaseException | None:
        """The error that stopped the writer (None while it works)."""

    def add_nowait(self, data: bytes | memoryview, callback: WriteCallback) -> int:
        """Send one entry and return its id; ``callback(entry_id, error)`` runs once per
        entry, in entry order.  Raises :attr:`failed` if the writer failed."""

    def close(self) -> None:
        """Take no more adds (the segment is being closed); entries in flight go on."""

    def abort(self, error: BaseException) -> None:
        """Stop: every entry still in flight is called back with ``error`` and no later
        add is taken."""

    async def wait_idle(self) -> None:
        """Wait until no entry is in flight (all acknowledged, or the writer failed)."""


@runtime_checkable
class ReplicationPolicy(Protocol):
    """Writes, reads and recovers segments on bookies; one object per broker.

    The factory registered under a policy's name is called as ``factory(client, *,
    ensemble_size=E, write_quorum=Qw, ack_quorum=Qa, bookie_load=load)``.  Per segment
    the ledger passes the segment's own quorums (which may be smaller than the
    policy's when few bookies are writable); ``None`` means the policy's.

    Optional: ``stored_last_entry(segment_id, ensemble) -> int``, the highest entry id
    any bookie of ``ensemble`` holds (:class:`~pigeon.core.replication.PolicyBase` has
    it); the ledger uses it, when present, to tell a lost tail from a damaged entry.
    """

    @property
    def client(self) -> BookieClient:
        """The bookie client the policy talks through (the broker deletes segments and
        the auditor copies entries with it too)."""

    #: the defaults of a segment: E bookies in its ensemble, Qw copies written of each
    #: entry, Qa copies acknowledged before the entry is
    ensemble_size: int
    write_quorum: int
    ack_quorum: int

    def choose_ensemble(
        self, bookies: Sequence[str], ensemble_size: int | None = None
    ) -> list[str]:
        """The ensemble of a new segment among the writable ``bookies`` (ServiceUnavailable
        when there are too few)."""

    async def create_writer(
        self, segment_id: int, ensemble: Sequence[str], **options: Unpack[WriterOptions]
    ) -> SegmentWriter:
        """A connected writer of a new segment (see :class:`WriterOptions`)."""

    async def read(
        self,
        segment_id: int,
        ensemble: Sequence[str],
        first: int,
        last: int,
        **options: Unpack[ReadOptions],
    ) -> list[tuple[int, memoryview]]:
        """Entries ``first..last`` of the fragment ``ensemble`` holds, in order (fewer when
        a limit of :class:`ReadOptions` is hit): a damaged or missing copy is passed over
        for an intact one and, with ``repair``, rewritten from it.  When every replica
        answered and none holds ``first`` intact: CorruptEntry (a copy is damaged) or
        EntryNotFound; when some did not answer, a retriable error."""

    async def recover(
        self, segment_id: int, ensemble: Sequence[str], **options: Unpack[RecoverOptions]
    ) -> int:
        """Fence a segment whose writer is gone, re-replicate its tail and return its last
        entry id (-1: empty).  ``ensemble`` is the last fragment's, which starts at
        ``first_entry`` (:class:`RecoverOptions`)."""


# The keyword options of the policy's methods, each of which may be left out.  A policy
# spells them out as keyword-only parameters with the defaults given here; a quorum left
# out or None is the policy's own.


class WriterOptions(TypedDict, total=False):
    """Of :meth:`ReplicationPolicy.create_writer`."""

    #: Qw of the segment
    write_quorum: int | None
    #: Qa of the segment
    ack_quorum: int | None
    #: called when a bookie of the ensemble fails (None: no bookie is replaced)
    replace_bookie: ReplaceBookie | None
    #: where the writer's background work runs (ensemble changes, stall watch)
    nursery: trio.Nursery | None


class ReadOptions(TypedDict, total=False):
    """Of :meth:`ReplicationPolicy.read`."""

    #: bytes of payload a read returns at most, bar a first entry larger alone (default
    #: 8 MiB)
    max_bytes: int
    #: return this many entries at most (default 10 000)
    max_count: int
    #: Qw the fragment was written with
    write_quorum: int | None
    #: rewrite the damaged or missing copies passed over from the intact one (default
    #: False; only for segments no writer appends to any more)
    repair: bool


class RecoverOptions(TypedDict, total=False):
    """Of :meth:`ReplicationPolicy.recover`."""

    #: Qa the fragment was written with
    ack_quorum: int | None
    #: Qw the fragment was written with
    write_quorum: int | None
    #: the fragment's first entry: every entry before it was acknowledged (default 0)
    first_entry: int

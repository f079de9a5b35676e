"""Kafka's classic consumer-group coordinator, as a state machine without socket I/O.

The classic protocol (JoinGroup / SyncGroup / Heartbeat / LeaveGroup) keeps the partition
assignors on the clients: the coordinator only runs each group's membership state machine,
picks the protocol every member supports, elects a leader, hands the leader the member list
and passes the leader's assignment on to each member. Behaviour follows Kafka's
``GroupCoordinator`` (the pre-KIP-848 one):

::

    Empty --join--> PreparingRebalance --every member rejoined / rebalance timeout-->
    CompletingRebalance --leader's SyncGroup--> Stable --join / leave / expiry-->
    PreparingRebalance ...          (a generation with no member left goes back to Empty)

- JoinGroup with an empty member id (v4+) gets ``MEMBER_ID_REQUIRED`` and a generated id
  ``{client_id}-{uuid}``; the member is *pending* until it joins with that id (or its
  session timeout passes).
- A rebalance completes once every known member has rejoined (and no pending member is
  left), or when the group's rebalance timeout (the largest of its members') passes; members
  that did not rejoin are removed. A rebalance out of ``Empty`` first waits
  ``group_initial_rebalance_delay_ms``, extended by that much while new members keep
  arriving, up to the rebalance timeout, so consumers starting together share a generation.
- Completing a rebalance bumps the generation, answers every waiting JoinGroup (the leader's
  answer carries the members and their metadata) and starts waiting for SyncGroups; the
  leader's SyncGroup stores the assignments and answers every member waiting in SyncGroup.
  Members that have not sent SyncGroup within the rebalance timeout are removed.
- A member that sends no heartbeat, join, sync or commit within its session timeout is
  removed (except while it waits inside a JoinGroup or SyncGroup call) and the group
  rebalances. The last member leaving brings the group to ``Empty`` through an empty
  generation (its generation id is bumped, never reset, as in Kafka).
- Static membership (``group.instance.id``, KIP-345) is refused with ``UNSUPPORTED_VERSION``,
  the answer Kafka gives when its static membership is disabled.

Every method returns a ``kio.schema.errors.ErrorCode`` (or a result carrying one); nothing
raises for a client's mistake. Timers are kept in one heap and fired by :meth:`run`, which
reads ``trio.current_time()`` so tests drive the coordinator with ``MockClock``.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import math
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import trio
from kio.schema.errors import ErrorCode

from pigeon.broker._kafka_wire import Later

log = logging.getLogger(__name__)

__all__ = [
    "CoordinatorStatistics",
    "GroupCoordinator",
    "GroupSnapshot",
    "GroupState",
    "JoinResult",
    "JoinedMember",
    "MemberSnapshot",
    "SyncResult",
]


class GroupState(enum.Enum):
    """Kafka's classic group states; the value is the name DescribeGroups/ListGroups show."""

    EMPTY = "Empty"
    PREPARING_REBALANCE = "PreparingRebalance"
    COMPLETING_REBALANCE = "CompletingRebalance"
    STABLE = "Stable"
    DEAD = "Dead"


@dataclass(frozen=True, slots=True)
class JoinedMember:
    """One member as the leader's JoinGroup answer lists it."""

    member_id: str
    group_instance_id: str | None
    metadata: bytes


@dataclass(frozen=True, slots=True)
class JoinResult:
    """The answer to one JoinGroup; ``members`` is filled for the leader only."""

    error: ErrorCode
    member_id: str = ""
    generation_id: int = -1
    protocol_type: str | None = None
    protocol_name: str | None = None
    leader: str = ""
    members: tuple[JoinedMember, ...] = ()


@dataclass(frozen=True, slots=True)
class SyncResult:
    """The answer to one SyncGroup: this member's assignment from the leader."""

    error: ErrorCode
    assignment: bytes = b""
    protocol_type: str | None = None
    protocol_name: str | None = None


@dataclass(frozen=True, slots=True)
class MemberSnapshot:
    """A member as DescribeGroups shows it (metadata and assignment only when Stable)."""

    member_id: str
    group_instance_id: str | None
    client_id: str
    client_host: str
    metadata: bytes
    assignment: bytes


@dataclass(frozen=True, slots=True)
class GroupSnapshot:
    """An immutable view of one group (``protocol_name`` is ``""`` unless Stable)."""

    group_id: str
    state: GroupState
    generation_id: int
    protocol_type: str
    protocol_name: str
    leader: str | None
    members: tuple[MemberSnapshot, ...]


@dataclass(frozen=True, slots=True)
class CoordinatorStatistics:
    """Counts for metrics: groups by state, members, calls waiting for a rebalance."""

    groups: dict[str, int]
    members: int
    pending_members: int
    waiting_joins: int
    waiting_syncs: int
    timers: int


class _Timer:
    """A deadline in the coordinator's heap; ``heap_key`` is where the heap holds it."""

    __slots__ = ("deadline", "fire", "heap_key")

    def __init__(self, fire: Callable[[], None]) -> None:
        self.fire = fire
        self.deadline: float | None = None
        self.heap_key: float | None = None


@dataclass(eq=False, slots=True)
class _Member:
    member_id: str
    client_id: str
    client_host: str
    session_timeout: float
    rebalance_timeout: float
    protocol_type: str
    protocols: tuple[tuple[str, bytes], ...]
    session: _Timer
    assignment: bytes = b""
    join_waiter: Later[JoinResult] | None = None
    sync_waiter: Later[SyncResult] | None = None

    def metadata(self, protocol: str | None) -> bytes:
        for name, metadata in self.protocols:
            if name == protocol:
                return metadata
        return b""


@dataclass(eq=False, slots=True)
class _Group:
    group_id: str
    join_timer: _Timer
    sync_timer: _Timer
    state: GroupState = GroupState.EMPTY
    generation_id: int = 0
    protocol_type: str | None = None
    protocol_name: str | None = None
    leader: str | None = None
    members: dict[str, _Member] = field(default_factory=dict)
    pending: dict[str, _Timer] = field(default_factory=dict)
    pending_sync: set[str] = field(default_factory=set)
    # The initial delayed join: extended while new members arrive, until this is spent.
    initial_join: bool = False
    initial_remaining: float = 0.0
    new_member_added: bool = False

    def rebalance_timeout(self) -> float:
        return max((m.rebalance_timeout for m in self.members.values()), default=0.0)

    def candidate_protocols(self) -> set[str]:
        """Protocols every member supports."""
        sets = [{name for name, _ in m.protocols} for m in self.members.values()]
        return set.intersection(*sets) if sets else set()

    def supports(self, protocol_type: str, protocols: Sequence[tuple[str, bytes]]) -> bool:
        if not protocol_type or not protocols:
            return False
        if not self.members:
            return True
        candidates = self.candidate_protocols()
        return protocol_type == self.protocol_type and any(
            name in candidates for name, _ in protocols
        )

    def select_protocol(self) -> str:
        """Each member votes for its most preferred candidate; ties go to the leader's order."""
        candidates = self.candidate_protocols()
        votes: dict[str, int] = {}
        for member in self.members.values():
            vote = next(name for name, _ in member.protocols if name in candidates)
            votes[vote] = votes.get(vote, 0) + 1
        leader = self.members[self.leader] if self.leader else next(iter(self.members.values()))
        order = [name for name, _ in leader.protocols if name in candidates]
        return max(order, key=lambda name: (votes.get(name, 0), -order.index(name)))

    def all_joined(self) -> bool:
        return not self.pending and all(m.join_waiter is not None for m in self.members.values())


class GroupCoordinator:
    """The classic group coordinator of one broker: every group it coordinates.

    ``on_generation(group_id, generation_id)`` is called each time a group completes a
    rebalance (including the empty generation a group goes ``Empty`` with). Times are
    milliseconds at the API, as on the wire.
    """

    def __init__(
        self,
        *,
        group_initial_rebalance_delay_ms: int = 3000,
        group_min_session_timeout_ms: int = 6000,
        group_max_session_timeout_ms: int = 1_800_000,
        on_generation: Callable[[str, int], None] | None = None,
    ) -> None:
        self._initial_delay = group_initial_rebalance_delay_ms / 1000
        self._min_session = group_min_session_timeout_ms
        self._max_session = group_max_session_timeout_ms
        self._on_generation = on_generation
        self._groups: dict[str, _Group] = {}
        self._heap: list[tuple[float, int, _Timer]] = []
        self._seq = itertools.count()
        self._sleep_until = math.inf
        self._wakeup = trio.Event()

    # -- timers -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Fire expired deadlines (sessions, rebalances, pending members) until cancelled.

        Nothing expires unless this runs: start it in the front door's nursery.
        """
        task_status.started()
        while True:
            self.expire()
            self._wakeup = trio.Event()
            self._sleep_until = self._heap[0][0] if self._heap else math.inf
            with trio.move_on_at(self._sleep_until):
                await self._wakeup.wait()

    def expire(self) -> None:
        """Fire every deadline at or before ``trio.current_time()``."""
        now = trio.current_time()
        while self._heap and self._heap[0][0] <= now:
            key, _, timer = heapq.heappop(self._heap)
            if timer.heap_key != key:
                continue  # a duplicate left by a deadline moved earlier
            timer.heap_key = None
            if timer.deadline is None:
                continue
            if timer.deadline > now:
                self._push(timer, timer.deadline)
                continue
            timer.deadline = None
            timer.fire()

    def _arm(self, timer: _Timer, delay: float) -> None:
        deadline = trio.current_time() + delay
        timer.deadline = deadline
        if timer.heap_key is None or deadline < timer.heap_key:
            self._push(timer, deadline)

    def _push(self, timer: _Timer, deadline: float) -> None:
        timer.heap_key = deadline
        heapq.heappush(self._heap, (deadline, next(self._seq), timer))
        if deadline < self._sleep_until:
            self._wakeup.set()

    # -- queries ------------------------------------------------------------------------

    def group(self, group_id: str) -> GroupSnapshot | None:
        """A snapshot of ``group_id``, or None if this coordinator does not know it."""
        group = self._groups.get(group_id)
        if group is None:
            return None
        stable = group.state is GroupState.STABLE
        protocol = group.protocol_name if stable else None
        return GroupSnapshot(
            group_id=group.group_id,
            state=group.state,
            generation_id=group.generation_id,
            protocol_type=group.protocol_type or "",
            protocol_name=protocol or "",
            leader=group.leader,
            members=tuple(
                MemberSnapshot(
                    member_id=m.member_id,
                    group_instance_id=None,
                    client_id=m.client_id,
                    client_host=m.client_host,
                    metadata=m.metadata(protocol) if stable else b"",
                    assignment=m.assignment if stable else b"",
                )
                for m in group.members.values()
            ),
        )

    def groups(self) -> list[GroupSnapshot]:
        """Every group this coordinator knows (none is Dead: dead groups are dropped)."""
        return [snap for gid in list(self._groups) if (snap := self.group(gid)) is not None]

    def statistics(self) -> CoordinatorStatistics:
        """How many groups (by state), members and waiting calls this coordinator holds."""
        states: dict[str, int] = {}
        members = [m for g in self._groups.values() for m in g.members.values()]
        for group in self._groups.values():
            states[group.state.value] = states.get(group.state.value, 0) + 1
        return CoordinatorStatistics(
            groups=states,
            members=len(members),
            pending_members=sum(len(g.pending) for g in self._groups.values()),
            waiting_joins=sum(m.join_waiter is not None for m in members),
            waiting_syncs=sum(m.sync_waiter is not None for m in members),
            timers=len(self._heap),
        )

    def is_member(self, group_id: str, member_id: str, generation_id: int) -> bool:
        """True if ``member_id`` belongs to ``group_id``'s current generation."""
        group = self._groups.get(group_id)
        return (
            group is not None
            and member_id in group.members
            and generation_id == group.generation_id
        )

    def check_commit(self, group_id: str, member_id: str, generation_id: int) -> ErrorCode:
        """May this OffsetCommit go through? Kafka's checks, in Kafka's order.

        Generation ``-1`` (with any member id) is a "simple" commit from a consumer outside
        any group: allowed if the group is unknown or Empty. A member's commit counts as a
        heartbeat. ``REBALANCE_IN_PROGRESS`` while the group waits for its leader's
        assignment; a commit during PreparingRebalance with the current generation is
        allowed (members commit before they rejoin).
        """
        group = self._groups.get(group_id)
        if group is None:
            return ErrorCode.none if generation_id < 0 else ErrorCode.illegal_generation
        if group.state is GroupState.DEAD:
            return ErrorCode.coordinator_not_available
        if generation_id < 0 and group.state is GroupState.EMPTY:
            return ErrorCode.none
        if group.state is GroupState.COMPLETING_REBALANCE:
            return ErrorCode.rebalance_in_progress
        return self._touch(group, member_id, generation_id)

    def _touch(self, group: _Group, member_id: str, generation_id: int) -> ErrorCode:
        """Restart the session of ``member_id`` if it is a member of this generation:
        NONE, UNKNOWN_MEMBER_ID or ILLEGAL_GENERATION."""
        member = group.members.get(member_id)
        if member is None:
            return ErrorCode.unknown_member_id
        if generation_id != group.generation_id:
            return ErrorCode.illegal_generation
        self._arm(member.session, member.session_timeout)
        return ErrorCode.none

    # -- JoinGroup ----------------------------------------------------------------------

    async def join_group(
        self,
        group_id: str,
        member_id: str,
        *,
        protocol_type: str,
        protocols: Sequence[tuple[str, bytes]],
        session_timeout_ms: int,
        rebalance_timeout_ms: int | None = None,
        group_instance_id: str | None = None,
        client_id: str = "",
        client_host: str = "",
        require_known_member_id: bool = True,
    ) -> JoinResult:
        """Join (or rejoin) ``group_id``; waits until the rebalance completes.

        ``rebalance_timeout_ms`` None or negative means the session timeout (JoinGroup v0).
        ``require_known_member_id`` is JoinGroup v4+'s two-step join (MEMBER_ID_REQUIRED).
        """
        answer = self._join(
            group_id,
            member_id,
            protocol_type=protocol_type,
            protocols=tuple(protocols),
            session_timeout_ms=session_timeout_ms,
            rebalance_timeout_ms=rebalance_timeout_ms,
            group_instance_id=group_instance_id,
            client_id=client_id,
            client_host=client_host,
            require_known_member_id=require_known_member_id,
        )
        if isinstance(answer, JoinResult):
            return answer
        return await answer.wait()

    def _join(
        self,
        group_id: str,
        member_id: str,
        *,
        protocol_type: str,
        protocols: tuple[tuple[str, bytes], ...],
        session_timeout_ms: int,
        rebalance_timeout_ms: int | None,
        group_instance_id: str | None,
        client_id: str,
        client_host: str,
        require_known_member_id: bool,
    ) -> JoinResult | Later[JoinResult]:
        if not group_id:
            return JoinResult(ErrorCode.invalid_group_id, member_id)
        if group_instance_id is not None:
            return JoinResult(ErrorCode.unsupported_version, member_id)
        if not self._min_session <= session_timeout_ms <= self._max_session:
            return JoinResult(ErrorCode.invalid_session_timeout, member_id)
        group = self._groups.get(group_id)
        if group is None:
            if member_id:
                return JoinResult(ErrorCode.unknown_member_id, member_id)
            if not protocol_type or not protocols:  # no group is created for a bad join
                return JoinResult(ErrorCode.inconsistent_group_protocol, member_id)
            group = self._new_group(group_id)
        if group.state is GroupState.DEAD:
            return JoinResult(ErrorCode.coordinator_not_available, member_id)
        if not group.supports(protocol_type, protocols):
            return JoinResult(ErrorCode.inconsistent_group_protocol, member_id)
        session = session_timeout_ms / 1000
        rebalance = (
            session
            if rebalance_timeout_ms is None or rebalance_timeout_ms < 0
            else rebalance_timeout_ms / 1000
        )
        if not member_id or member_id in group.pending:
            if not member_id:
                member_id = f"{client_id}-{uuid.uuid4()}"
                if require_known_member_id:
                    self._add_pending(group, member_id, session)
                    return JoinResult(ErrorCode.member_id_required, member_id)
            else:
                pending = group.pending.pop(member_id)
                pending.deadline = None
            new = _Member(
                member_id=member_id,
                client_id=client_id,
                client_host=client_host,
                session_timeout=session,
                rebalance_timeout=rebalance,
                protocol_type=protocol_type,
                protocols=protocols,
                session=_Timer(lambda: None),
            )
            new.session.fire = lambda: self._session_expired(group, new)
            return self._add_member_and_rebalance(group, new)
        member = group.members.get(member_id)
        if member is None:
            return JoinResult(ErrorCode.unknown_member_id, member_id)
        unchanged = member.protocols == protocols
        member.client_id, member.client_host = client_id, client_host
        member.session_timeout, member.rebalance_timeout = session, rebalance
        member.protocol_type, member.protocols = protocol_type, protocols
        self._arm(member.session, session)
        if group.state is GroupState.PREPARING_REBALANCE:
            return self._await_join(group, member)
        if unchanged and (
            group.state is GroupState.COMPLETING_REBALANCE or member_id != group.leader
        ):
            # A rejoin with nothing new (a follower that missed its answer): the current
            # generation, no rebalance — Kafka's answer too.
            return self._join_result(group, member)
        waiter = self._await_join(group, member)
        self._prepare_rebalance(group)
        return waiter

    def _new_group(self, group_id: str) -> _Group:
        group = _Group(group_id, join_timer=_Timer(lambda: None), sync_timer=_Timer(lambda: None))
        group.join_timer.fire = lambda: self._join_deadline(group)
        group.sync_timer.fire = lambda: self._sync_deadline(group)
        self._groups[group_id] = group
        return group

    def _add_pending(self, group: _Group, member_id: str, session: float) -> None:
        timer = _Timer(lambda: self._pending_expired(group, member_id))
        group.pending[member_id] = timer
        self._arm(timer, session)

    def _pending_expired(self, group: _Group, member_id: str) -> None:
        if group.pending.pop(member_id, None) is not None:
            self._maybe_complete_join(group)
        never_formed = group.generation_id == 0 and not group.members and not group.pending
        if never_formed and self._groups.get(group.group_id) is group:
            # Only ever asked for a member id, never joined: forget it, as if never seen.
            del self._groups[group.group_id]

    def _add_member_and_rebalance(self, group: _Group, member: _Member) -> Later[JoinResult]:
        if not group.members:
            group.protocol_type = member.protocol_type
        if group.leader is None:
            group.leader = member.member_id
        group.members[member.member_id] = member
        group.new_member_added = True
        self._arm(member.session, member.session_timeout)
        waiter = self._await_join(group, member)
        if group.state is not GroupState.PREPARING_REBALANCE:
            self._prepare_rebalance(group)
        return waiter

    def _await_join(self, group: _Group, member: _Member) -> Later[JoinResult]:
        if member.join_waiter is not None:
            # The same member joined again before its previous call was answered (a retry
            # on a new connection): the older call is told to rejoin.
            member.join_waiter.set(JoinResult(ErrorCode.rebalance_in_progress, member.member_id))
        waiter: Later[JoinResult] = Later()
        member.join_waiter = waiter
        if group.state is GroupState.PREPARING_REBALANCE:
            self._maybe_complete_join(group)
        return waiter

    def _join_result(self, group: _Group, member: _Member) -> JoinResult:
        leader = member.member_id == group.leader
        return JoinResult(
            ErrorCode.none,
            member_id=member.member_id,
            generation_id=group.generation_id,
            protocol_type=group.protocol_type,
            protocol_name=group.protocol_name,
            leader=group.leader or "",
            members=tuple(
                JoinedMember(m.member_id, None, m.metadata(group.protocol_name))
                for m in group.members.values()
            )
            if leader
            else (),
        )

    # -- rebalancing --------------------------------------------------------------------

    def _prepare_rebalance(self, group: _Group) -> None:
        if group.state is GroupState.COMPLETING_REBALANCE:
            for member in group.members.values():
                member.assignment = b""
                if member.sync_waiter is not None:
                    member.sync_waiter.set(SyncResult(ErrorCode.rebalance_in_progress))
                    member.sync_waiter = None
                    self._arm(member.session, member.session_timeout)  # answered: a new session
        group.sync_timer.deadline = None
        group.pending_sync.clear()
        timeout = group.rebalance_timeout()
        if group.state is GroupState.EMPTY:
            group.initial_join = True
            group.new_member_added = False
            delay = min(self._initial_delay, timeout)
            group.initial_remaining = max(timeout - self._initial_delay, 0.0)
        else:
            group.initial_join = False
            delay = timeout
        group.state = GroupState.PREPARING_REBALANCE
        self._arm(group.join_timer, delay)
        self._maybe_complete_join(group)

    def _maybe_complete_join(self, group: _Group) -> None:
        if (
            group.state is GroupState.PREPARING_REBALANCE
            and not group.initial_join
            and group.all_joined()
        ):
            self._complete_join(group)

    def _join_deadline(self, group: _Group) -> None:
        if group.state is not GroupState.PREPARING_REBALANCE:
            return
        if group.initial_join and group.new_member_added and group.initial_remaining > 0:
            group.new_member_added = False
            delay = min(self._initial_delay, group.initial_remaining)
            group.initial_remaining = max(group.initial_remaining - delay, 0.0)
            self._arm(group.join_timer, delay)
            return
        self._complete_join(group)

    def _complete_join(self, group: _Group) -> None:
        group.join_timer.deadline = None
        group.initial_join = False
        for member in [m for m in group.members.values() if m.join_waiter is None]:
            self._remove_member(group, member)  # did not rejoin in time
        if group.leader is None and group.members:
            group.leader = next(iter(group.members))
        group.generation_id += 1
        if group.members:
            group.protocol_name = group.select_protocol()
            group.state = GroupState.COMPLETING_REBALANCE
        else:
            group.protocol_name = None
            group.state = GroupState.EMPTY
        for member in group.members.values():
            assert member.join_waiter is not None
            member.join_waiter.set(self._join_result(group, member))
            member.join_waiter = None
            self._arm(member.session, member.session_timeout)
        if group.members:
            group.pending_sync = set(group.members)
            self._arm(group.sync_timer, group.rebalance_timeout())
        log.info(
            "kafka group rebalanced group=%s generation=%d members=%d protocol=%s",
            group.group_id,
            group.generation_id,
            len(group.members),
            group.protocol_name,
        )
        if self._on_generation is not None:
            self._on_generation(group.group_id, group.generation_id)

    def _sync_deadline(self, group: _Group) -> None:
        if group.state not in (GroupState.COMPLETING_REBALANCE, GroupState.STABLE):
            return
        late = [group.members[mid] for mid in group.pending_sync if mid in group.members]
        group.pending_sync.clear()
        for member in late:
            self._remove_member(group, member)
        if late:
            self._prepare_rebalance(group)

    def _session_expired(self, group: _Group, member: _Member) -> None:
        if group.members.get(member.member_id) is not member:
            return
        if member.join_waiter is not None or member.sync_waiter is not None:
            # Waiting inside a call: the rebalance and sync deadlines govern it.
            self._arm(member.session, member.session_timeout)
            return
        self._remove_member_and_update(group, member)

    def _remove_member(self, group: _Group, member: _Member) -> None:
        del group.members[member.member_id]
        member.session.deadline = None
        group.pending_sync.discard(member.member_id)
        if member.join_waiter is not None:
            member.join_waiter.set(JoinResult(ErrorCode.unknown_member_id, member.member_id))
            member.join_waiter = None
        if member.sync_waiter is not None:
            member.sync_waiter.set(SyncResult(ErrorCode.unknown_member_id))
            member.sync_waiter = None
        if group.leader == member.member_id:
            joined = [m.member_id for m in group.members.values() if m.join_waiter is not None]
            group.leader = joined[0] if joined else next(iter(group.members), None)

    def _remove_member_and_update(self, group: _Group, member: _Member) -> None:
        self._remove_member(group, member)
        if group.state in (GroupState.STABLE, GroupState.COMPLETING_REBALANCE):
            self._prepare_rebalance(group)
        elif group.state is GroupState.PREPARING_REBALANCE:
            self._maybe_complete_join(group)

    # -- SyncGroup, Heartbeat, LeaveGroup -----------------------------------------------

    async def sync_group(
        self,
        group_id: str,
        member_id: str,
        generation_id: int,
        assignments: Iterable[tuple[str, bytes]] = (),
        *,
        protocol_type: str | None = None,
        protocol_name: str | None = None,
        group_instance_id: str | None = None,
    ) -> SyncResult:
        """Send this generation's SyncGroup; followers wait for the leader's assignments."""
        answer = self._sync(
            group_id,
            member_id,
            generation_id,
            dict(assignments),
            protocol_type,
            protocol_name,
            group_instance_id,
        )
        if isinstance(answer, SyncResult):
            return answer
        return await answer.wait()

    def _sync(
        self,
        group_id: str,
        member_id: str,
        generation_id: int,
        assignments: dict[str, bytes],
        protocol_type: str | None,
        protocol_name: str | None,
        group_instance_id: str | None,
    ) -> SyncResult | Later[SyncResult]:
        if group_instance_id is not None:
            return SyncResult(ErrorCode.unsupported_version)
        group = self._groups.get(group_id)
        if group is None:
            return SyncResult(ErrorCode.unknown_member_id)
        if group.state is GroupState.DEAD:
            return SyncResult(ErrorCode.coordinator_not_available)
        member = group.members.get(member_id)
        if member is None:
            return SyncResult(ErrorCode.unknown_member_id)
        if generation_id != group.generation_id:
            return SyncResult(ErrorCode.illegal_generation)
        if (protocol_type is not None and protocol_type != group.protocol_type) or (
            protocol_name is not None and protocol_name != group.protocol_name
        ):
            return SyncResult(ErrorCode.inconsistent_group_protocol)
        if group.state is GroupState.PREPARING_REBALANCE:
            return SyncResult(ErrorCode.rebalance_in_progress)
        group.pending_sync.discard(member_id)
        self._arm(member.session, member.session_timeout)
        if group.state is GroupState.STABLE:
            return self._sync_result(group, member)
        # CompletingRebalance: wait for the leader's assignments.
        if member.sync_waiter is not None:
            member.sync_waiter.set(SyncResult(ErrorCode.rebalance_in_progress))
        waiter: Later[SyncResult] = Later()
        member.sync_waiter = waiter
        if member_id == group.leader:
            for m in group.members.values():
                m.assignment = assignments.get(m.member_id, b"")
            group.state = GroupState.STABLE
            for m in group.members.values():
                if m.sync_waiter is not None:
                    m.sync_waiter.set(self._sync_result(group, m))
                    m.sync_waiter = None
                    self._arm(m.session, m.session_timeout)
        return waiter

    @staticmethod
    def _sync_result(group: _Group, member: _Member) -> SyncResult:
        return SyncResult(
            ErrorCode.none, member.assignment, group.protocol_type, group.protocol_name
        )

    def heartbeat(
        self,
        group_id: str,
        member_id: str,
        generation_id: int,
        *,
        group_instance_id: str | None = None,
    ) -> ErrorCode:
        """A member's heartbeat: NONE, or what it must do (rejoin, give up its id, ...)."""
        if group_instance_id is not None:
            return ErrorCode.unsupported_version
        group = self._groups.get(group_id)
        if group is None:
            return ErrorCode.unknown_member_id
        if group.state is GroupState.DEAD:
            return ErrorCode.coordinator_not_available
        error = self._touch(group, member_id, generation_id)
        if error is ErrorCode.none and group.state is GroupState.PREPARING_REBALANCE:
            return ErrorCode.rebalance_in_progress
        return error

    def leave_group(
        self, group_id: str, members: Iterable[tuple[str, str | None]]
    ) -> tuple[ErrorCode, list[tuple[str, str | None, ErrorCode]]]:
        """Remove ``(member_id, group_instance_id)`` members; the group rebalances.

        Returns the top-level error and one error per member (LeaveGroup v3+'s batch).
        """
        leaving = list(members)
        group = self._groups.get(group_id)
        if group is None:
            return ErrorCode.none, [(m, i, ErrorCode.unknown_member_id) for m, i in leaving]
        if group.state is GroupState.DEAD:
            return ErrorCode.coordinator_not_available, []
        results: list[tuple[str, str | None, ErrorCode]] = []
        for member_id, instance_id in leaving:
            if member_id in group.pending:
                group.pending.pop(member_id).deadline = None
                self._maybe_complete_join(group)
                results.append((member_id, instance_id, ErrorCode.none))
            elif (member := group.members.get(member_id)) is not None:
                self._remove_member_and_update(group, member)
                results.append((member_id, instance_id, ErrorCode.none))
            else:
                results.append((member_id, instance_id, ErrorCode.unknown_member_id))
        return ErrorCode.none, results

    def delete_group(self, group_id: str) -> ErrorCode:
        """Drop an Empty group (DeleteGroups): NON_EMPTY_GROUP while it has members."""
        group = self._groups.get(group_id)
        if group is None:
            return ErrorCode.group_id_not_found
        if group.members or group.state is not GroupState.EMPTY:
            return ErrorCode.non_empty_group
        group.state = GroupState.DEAD
        for timer in (group.join_timer, group.sync_timer, *group.pending.values()):
            timer.deadline = None
        del self._groups[group_id]
        return ErrorCode.none

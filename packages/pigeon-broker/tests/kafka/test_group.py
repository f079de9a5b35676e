"""The classic consumer-group coordinator: membership, generations, timeouts (MockClock).

Consumers are simulated as a real client behaves (join, sync, heartbeat every second,
rejoin on REBALANCE_IN_PROGRESS); the leader's "assignor" gives each member
``{member_id}@{generation}`` so every test can tell who got what in which generation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import trio
from kafka_group_support import SimulatedMember, assign
from kio.schema.errors import ErrorCode

from pigeon.broker._kafka_group import GroupCoordinator, GroupState, JoinResult

GROUP = "orders-app"
PROTOCOLS = (("range", b"meta-range"), ("roundrobin", b"meta-rr"))
SESSION_MS = 10_000
REBALANCE_MS = 30_000


@pytest.fixture
async def coordinator(nursery: trio.Nursery) -> GroupCoordinator:
    coordinator = GroupCoordinator()  # Kafka's defaults: 3 s initial delay, 6 s..30 min
    await nursery.start(coordinator.run)
    return coordinator


async def wait_until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` in virtual time; the simulated consumers change it as they go."""
    with trio.fail_after(120):
        while True:
            if condition():
                return
            await trio.sleep(0.1)


async def join(
    coordinator: GroupCoordinator,
    member_id: str = "",
    *,
    client_id: str = "client",
    protocols: Sequence[tuple[str, bytes]] = PROTOCOLS,
    session_ms: int = SESSION_MS,
    rebalance_ms: int = REBALANCE_MS,
) -> JoinResult:
    """JoinGroup as a v4+ client does it: a second call when asked for a member id."""
    while True:
        result = await coordinator.join_group(
            GROUP,
            member_id,
            protocol_type="consumer",
            protocols=protocols,
            session_timeout_ms=session_ms,
            rebalance_timeout_ms=rebalance_ms,
            client_id=client_id,
            client_host="/127.0.0.1",
        )
        if result.error is not ErrorCode.member_id_required:
            return result
        member_id = result.member_id


async def join_two(coordinator: GroupCoordinator) -> list[JoinResult]:
    """Two new members join together (one rebalance); their results, in arrival order."""
    results: list[JoinResult] = []

    async def joiner() -> None:
        results.append(await join(coordinator))

    async with trio.open_nursery() as joins:
        joins.start_soon(joiner)
        joins.start_soon(joiner)
    return results


class Consumer(SimulatedMember):
    """A consumer's group loop; ``hung`` stops its heartbeats, ``stop()`` leaves."""

    def __init__(self, coordinator: GroupCoordinator, name: str) -> None:
        super().__init__(coordinator, name)
        self.leader = False
        self.hung = False
        self.left = False
        self.history: list[int] = []  # generations this consumer was assigned in

    async def run(self) -> None:
        while not self.left:
            joined = await join(self.coordinator, self.member_id, client_id=self.name)
            assert joined.error is ErrorCode.none, joined
            self.member_id, self.leader = joined.member_id, joined.leader == joined.member_id
            synced = await self.coordinator.sync_group(
                GROUP, self.member_id, joined.generation_id, assign(joined) if self.leader else ()
            )
            if synced.error is ErrorCode.rebalance_in_progress:
                continue
            assert synced.error is ErrorCode.none, synced
            self.generation, self.assignment = joined.generation_id, synced.assignment
            self.history.append(self.generation)
            while True:
                await trio.sleep(1)
                if self.left:
                    return
                if self.hung:
                    await trio.sleep_forever()
                error = self.coordinator.heartbeat(GROUP, self.member_id, self.generation)
                if error is ErrorCode.rebalance_in_progress:
                    break
                assert error is ErrorCode.none, error


async def start(
    nursery: trio.Nursery, coordinator: GroupCoordinator, *names: str, gap: float = 0
) -> list[Consumer]:
    consumers = []
    for name in names:
        consumer = Consumer(coordinator, name)
        nursery.start_soon(consumer.run)
        consumers.append(consumer)
        await trio.sleep(gap)
    return consumers


async def start_settled(
    nursery: trio.Nursery, coordinator: GroupCoordinator, *names: str
) -> list[Consumer]:
    """Start consumers together and wait until each owns its generation-1 assignment."""
    consumers = await start(nursery, coordinator, *names)
    await wait_until(lambda: all(c.owns_its_assignment(1) for c in consumers))
    return consumers


def stable_at(coordinator: GroupCoordinator, generation: int, members: int) -> bool:
    snap = coordinator.group(GROUP)
    return (
        snap is not None
        and snap.state is GroupState.STABLE
        and snap.generation_id == generation
        and len(snap.members) == members
    )


# -- forming a group --------------------------------------------------------------------


async def test_members_starting_together_land_in_one_generation(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    # Started 2 s apart: each arrival extends the initial delay (3 s) so no one is
    # left for a second rebalance.
    consumers = await start(nursery, coordinator, "c1", "c2", "c3", gap=2)
    await trio.sleep(0.5)
    waiting = coordinator.statistics()
    assert (waiting.groups, waiting.members, waiting.waiting_joins) == (
        {"PreparingRebalance": 1},
        3,
        3,
    )
    await wait_until(lambda: all(c.owns_its_assignment(1) for c in consumers))
    stable = coordinator.statistics()
    assert (stable.groups, stable.members, stable.waiting_joins, stable.waiting_syncs) == (
        {"Stable": 1},
        3,
        0,
        0,
    )
    assert [c.history for c in consumers] == [[1], [1], [1]]
    assert sum(c.leader for c in consumers) == 1
    assert len({c.member_id for c in consumers}) == 3
    assert all(c.member_id.startswith(f"{c.name}-") for c in consumers)
    snap = coordinator.group(GROUP)
    assert snap is not None
    assert (snap.state, snap.generation_id, snap.protocol_name) == (GroupState.STABLE, 1, "range")


async def test_initial_delay_is_waited_then_extended_up_to_the_rebalance_timeout(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    t0 = trio.current_time()
    alone = await coordinator.join_group(
        "alone", "", protocol_type="consumer", protocols=PROTOCOLS,
        session_timeout_ms=SESSION_MS, require_known_member_id=False,
    )  # fmt: skip
    assert alone.generation_id == 1
    assert trio.current_time() - t0 == pytest.approx(3.0)  # waited the delay all the same

    answered: list[tuple[float, int]] = []

    async def member() -> None:
        result = await join(coordinator, rebalance_ms=7000)
        answered.append((trio.current_time() - t0, result.generation_id))

    t0 = trio.current_time()
    async with trio.open_nursery() as joins:
        for at in (0, 2, 4, 6.5):  # each arrival extends the delay by 3 s, capped at 7 s
            await trio.sleep_until(t0 + at)
            joins.start_soon(member)
    assert answered == [(pytest.approx(7.0), 1)] * 4


async def test_leader_gets_members_with_metadata_of_the_chosen_protocol(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    results: list[JoinResult] = []

    async def member(protocols: Sequence[tuple[str, bytes]]) -> None:
        results.append(await join(coordinator, protocols=protocols))

    async with trio.open_nursery() as joins:
        joins.start_soon(member, (("range", b"r1"), ("roundrobin", b"rr1")))
        joins.start_soon(member, (("sticky", b"s2"), ("roundrobin", b"rr2")))
    leader = next(r for r in results if r.leader == r.member_id)
    follower = next(r for r in results if r.leader != r.member_id)
    assert leader.protocol_name == follower.protocol_name == "roundrobin"  # the common one
    assert sorted(m.metadata for m in leader.members) == [b"rr1", b"rr2"]
    assert follower.members == ()
    inconsistent = await join(coordinator, protocols=(("sticky", b""),))
    assert inconsistent.error is ErrorCode.inconsistent_group_protocol


async def test_member_id_required_then_join_with_the_given_id(
    coordinator: GroupCoordinator, autojump_clock: trio.abc.Clock
) -> None:
    first = await coordinator.join_group(
        GROUP, "", protocol_type="consumer", protocols=PROTOCOLS,
        session_timeout_ms=SESSION_MS, client_id="rdkafka",
    )  # fmt: skip
    assert first.error is ErrorCode.member_id_required
    assert first.member_id.startswith("rdkafka-") and first.generation_id == -1
    second = await join(coordinator, first.member_id, client_id="rdkafka")
    assert (second.error, second.member_id, second.generation_id) == (
        ErrorCode.none,
        first.member_id,
        1,
    )
    # JoinGroup v0-v3 cannot do the two-step join: the member id comes with the answer.
    old = await coordinator.join_group(
        "other", "", protocol_type="consumer", protocols=PROTOCOLS,
        session_timeout_ms=SESSION_MS, client_id="py", require_known_member_id=False,
    )  # fmt: skip
    assert old.error is ErrorCode.none and old.member_id.startswith("py-")


async def test_a_pending_member_that_never_returns_does_not_block_the_group(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    (c1,) = await start_settled(nursery, coordinator, "c1")
    ghost = await coordinator.join_group(
        GROUP, "", protocol_type="consumer", protocols=PROTOCOLS, session_timeout_ms=SESSION_MS
    )
    assert ghost.error is ErrorCode.member_id_required  # ... and never comes back
    (c2,) = await start(nursery, coordinator, "c2")
    t0 = trio.current_time()
    await wait_until(lambda: c1.owns_its_assignment(2) and c2.owns_its_assignment(2))
    assert trio.current_time() - t0 == pytest.approx(SESSION_MS / 1000, abs=1.5)


# -- rebalancing ----------------------------------------------------------------------------


async def test_a_fourth_member_rebalances_everyone_into_a_new_generation(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    consumers = await start_settled(nursery, coordinator, "c1", "c2", "c3")
    t0 = trio.current_time()
    consumers += await start(nursery, coordinator, "c4")
    await wait_until(lambda: all(c.owns_its_assignment(2) for c in consumers))
    assert trio.current_time() - t0 < 3  # everyone rejoined at its next heartbeat
    assert [c.history for c in consumers] == [[1, 2], [1, 2], [1, 2], [2]]
    assert sum(c.leader for c in consumers) == 1


async def test_heartbeat_during_rebalance_says_rebalance_in_progress(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    a = await join(coordinator)
    assert (await coordinator.sync_group(GROUP, a.member_id, 1, assign(a))).error is ErrorCode.none
    assert coordinator.heartbeat(GROUP, a.member_id, 1) is ErrorCode.none
    nursery.start_soon(join, coordinator)  # a newcomer: its join waits for the rebalance
    await trio.sleep(0.5)
    assert coordinator.heartbeat(GROUP, a.member_id, 1) is ErrorCode.rebalance_in_progress
    snap = coordinator.group(GROUP)
    assert snap is not None and snap.state is GroupState.PREPARING_REBALANCE
    # The old generation may still commit before it rejoins (as in Kafka).
    assert coordinator.check_commit(GROUP, a.member_id, 1) is ErrorCode.none


async def test_a_member_that_stops_heartbeating_is_removed_after_its_session_timeout(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    consumers = await start_settled(nursery, coordinator, "c1", "c2", "c3")
    hung, *alive = consumers
    hung.hung = True
    t0 = trio.current_time()
    await wait_until(lambda: all(c.owns_its_assignment(2) for c in alive))
    # Removed a session timeout after its last heartbeat (at most 1 s before t0).
    assert SESSION_MS / 1000 - 1 <= trio.current_time() - t0 <= SESSION_MS / 1000 + 3
    assert stable_at(coordinator, 2, members=2)
    assert coordinator.heartbeat(GROUP, hung.member_id, 1) is ErrorCode.unknown_member_id


async def test_leave_group_rebalances_the_others(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    consumers = await start_settled(nursery, coordinator, "c1", "c2", "c3")
    leaver, *stay = consumers
    leaver.left = True
    top, per_member = coordinator.leave_group(GROUP, [(leaver.member_id, None), ("ghost", None)])
    assert top is ErrorCode.none
    assert [e for _, _, e in per_member] == [ErrorCode.none, ErrorCode.unknown_member_id]
    await wait_until(lambda: all(c.owns_its_assignment(2) for c in stay))
    assert stable_at(coordinator, 2, members=2)


async def test_last_member_leaving_empties_the_group_and_keeps_its_generation(
    autojump_clock: trio.abc.Clock,
) -> None:
    generations: list[tuple[str, int]] = []
    coordinator = GroupCoordinator(on_generation=lambda g, n: generations.append((g, n)))
    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        a = await join(coordinator)
        await coordinator.sync_group(GROUP, a.member_id, a.generation_id, assign(a))
        coordinator.leave_group(GROUP, [(a.member_id, None)])
        snap = coordinator.group(GROUP)
        assert snap is not None and snap.state is GroupState.EMPTY and snap.members == ()
        assert snap.generation_id == 2  # Kafka's empty generation: bumped, never reset
        assert coordinator.check_commit(GROUP, "", -1) is ErrorCode.none  # simple commit
        b = await join(coordinator)
        assert b.generation_id == 3 and b.leader == b.member_id
        nursery.cancel_scope.cancel()
    assert generations == [(GROUP, 1), (GROUP, 2), (GROUP, 3)]


async def test_a_member_that_does_not_rejoin_within_the_rebalance_timeout_is_dropped(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    results: list[JoinResult] = []

    async def joiner(member_id: str = "") -> None:
        results.append(await join(coordinator, member_id))

    async with trio.open_nursery() as joins:
        joins.start_soon(joiner)
        joins.start_soon(joiner)
    a, b = results
    leader = a if a.leader == a.member_id else b
    await coordinator.sync_group(GROUP, leader.member_id, 1, assign(leader))
    results.clear()
    nursery.start_soon(joiner)  # a newcomer starts a rebalance
    await trio.sleep(0.5)
    t0 = trio.current_time()
    nursery.start_soon(joiner, a.member_id)  # a rejoins; b only keeps heartbeating
    while len(results) < 2:
        assert coordinator.heartbeat(GROUP, b.member_id, 1) is ErrorCode.rebalance_in_progress
        await trio.sleep(1)
    assert trio.current_time() - t0 == pytest.approx(REBALANCE_MS / 1000, abs=1.5)
    assert {r.generation_id for r in results} == {2}
    assert a.member_id in {r.member_id for r in results}
    assert coordinator.heartbeat(GROUP, b.member_id, 2) is ErrorCode.unknown_member_id
    assert not coordinator.is_member(GROUP, b.member_id, 2)


async def test_a_leader_that_never_syncs_is_removed_and_the_followers_rejoin(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    results = await join_two(coordinator)
    follower = next(r for r in results if r.leader != r.member_id)
    leader_beats: list[ErrorCode] = []

    async def leader_heartbeats() -> None:  # alive, but never sends its assignment
        while not leader_beats or leader_beats[-1] is ErrorCode.none:
            leader_beats.append(coordinator.heartbeat(GROUP, follower.leader, 1))
            await trio.sleep(1)

    nursery.start_soon(leader_heartbeats)
    t0 = trio.current_time()
    synced = await coordinator.sync_group(GROUP, follower.member_id, 1)
    assert synced.error is ErrorCode.rebalance_in_progress
    assert trio.current_time() - t0 == pytest.approx(REBALANCE_MS / 1000, abs=0.5)
    again = await join(coordinator, follower.member_id)
    assert again.error is ErrorCode.none, again
    assert (again.generation_id, again.leader) == (2, follower.member_id)
    await trio.sleep(1.5)  # the leader's next heartbeat learns it is out
    assert leader_beats[-1] is ErrorCode.unknown_member_id


# -- SyncGroup ------------------------------------------------------------------------------


async def test_follower_sync_waits_for_the_leader(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    results = await join_two(coordinator)
    leader = next(r for r in results if r.leader == r.member_id)
    follower = next(r for r in results if r.leader != r.member_id)
    got: list[bytes] = []

    async def follower_sync() -> None:
        synced = await coordinator.sync_group(GROUP, follower.member_id, 1)
        got.append(synced.assignment)

    nursery.start_soon(follower_sync)
    await trio.sleep(5)
    assert got == []  # still waiting for the leader
    assert coordinator.check_commit(GROUP, follower.member_id, 1) is (
        ErrorCode.rebalance_in_progress
    )
    mine = await coordinator.sync_group(GROUP, leader.member_id, 1, assign(leader))
    assert mine.assignment == f"{leader.member_id}@1".encode()
    assert mine.protocol_name == "range"
    await wait_until(lambda: got == [f"{follower.member_id}@1".encode()])
    assert stable_at(coordinator, 1, members=2)
    # A late SyncGroup in Stable gets the stored assignment at once.
    late = await coordinator.sync_group(GROUP, follower.member_id, 1)
    assert late.assignment == f"{follower.member_id}@1".encode()


# -- errors -------------------------------------------------------------------------------


async def test_stale_generation_is_illegal(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    consumers = await start_settled(nursery, coordinator, "c1", "c2")
    consumers += await start(nursery, coordinator, "c3")
    await wait_until(lambda: all(c.owns_its_assignment(2) for c in consumers))
    member = consumers[0].member_id
    assert coordinator.heartbeat(GROUP, member, 1) is ErrorCode.illegal_generation
    assert (await coordinator.sync_group(GROUP, member, 1)).error is ErrorCode.illegal_generation
    assert coordinator.check_commit(GROUP, member, 1) is ErrorCode.illegal_generation
    assert coordinator.check_commit(GROUP, member, 2) is ErrorCode.none
    assert coordinator.is_member(GROUP, member, 2) and not coordinator.is_member(GROUP, member, 1)


async def test_unknown_member_and_unknown_group(
    coordinator: GroupCoordinator, nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    await start_settled(nursery, coordinator, "c1")
    assert coordinator.heartbeat(GROUP, "nobody", 1) is ErrorCode.unknown_member_id
    assert (await coordinator.sync_group(GROUP, "nobody", 1)).error is ErrorCode.unknown_member_id
    assert (await join(coordinator, "nobody")).error is ErrorCode.unknown_member_id
    assert coordinator.check_commit(GROUP, "nobody", 1) is ErrorCode.unknown_member_id
    # A simple commit (no group membership) is refused while the group has members.
    assert coordinator.check_commit(GROUP, "", -1) is ErrorCode.unknown_member_id
    assert coordinator.heartbeat("no-such-group", "m", 1) is ErrorCode.unknown_member_id
    assert coordinator.check_commit("no-such-group", "", -1) is ErrorCode.none
    assert coordinator.check_commit("no-such-group", "m", 3) is ErrorCode.illegal_generation


async def test_bad_joins_get_kafka_errors(
    coordinator: GroupCoordinator, autojump_clock: trio.abc.Clock
) -> None:
    async def bad(**overrides: object) -> ErrorCode:
        kwargs: dict[str, object] = {
            "protocol_type": "consumer",
            "protocols": PROTOCOLS,
            "session_timeout_ms": SESSION_MS,
        }
        kwargs.update(overrides)
        group_id = str(kwargs.pop("group_id", GROUP))
        return (await coordinator.join_group(group_id, "", **kwargs)).error  # type: ignore[arg-type]

    assert await bad(group_id="") is ErrorCode.invalid_group_id
    assert await bad(session_timeout_ms=1000) is ErrorCode.invalid_session_timeout
    assert await bad(session_timeout_ms=3_600_000) is ErrorCode.invalid_session_timeout
    assert await bad(protocols=()) is ErrorCode.inconsistent_group_protocol
    assert await bad(protocol_type="") is ErrorCode.inconsistent_group_protocol
    # Static membership (group.instance.id) is refused the way Kafka refuses it when off.
    assert await bad(group_instance_id="pod-1") is ErrorCode.unsupported_version
    assert coordinator.groups() == []  # no group was created by a refused join
    # A client that is given a member id and never comes back leaves nothing behind.
    ghost = await coordinator.join_group(
        GROUP, "", protocol_type="consumer", protocols=PROTOCOLS, session_timeout_ms=SESSION_MS
    )
    assert ghost.error is ErrorCode.member_id_required
    assert [g.group_id for g in coordinator.groups()] == [GROUP]
    await trio.sleep(SESSION_MS / 1000 + 0.1)
    assert coordinator.groups() == []


async def test_delete_group_only_when_empty(
    coordinator: GroupCoordinator, autojump_clock: trio.abc.Clock
) -> None:
    a = await join(coordinator)
    assert coordinator.delete_group(GROUP) is ErrorCode.non_empty_group
    coordinator.leave_group(GROUP, [(a.member_id, None)])
    assert coordinator.delete_group(GROUP) is ErrorCode.none
    assert coordinator.group(GROUP) is None
    assert coordinator.delete_group(GROUP) is ErrorCode.group_id_not_found

"""Consumers that hang, leave, crash and come back: the group always converges.

Each seed runs a few minutes of virtual time in which simulated consumers misbehave at
random (stall past their session timeout, leave, vanish without leaving, restart with a
new id), while a monitor checks what a group's users rely on at every step: one leader,
generations that only grow, and in Stable every member holding exactly what the leader
assigned it in that generation. Then the misbehaviour stops and every live consumer must
end up in one generation with its own assignment.
"""

from __future__ import annotations

import random

import pytest
import trio
from kafka_group_support import SimulatedMember, assign, assignment_of
from kio.schema.errors import ErrorCode

from pigeon.broker._kafka_group import GroupCoordinator, GroupState

GROUP = "chaos"
SESSION_MS = 10_000
REBALANCE_MS = 20_000
CHAOS_SECONDS = 300


class RobustConsumer(SimulatedMember):
    """A consumer's group loop as real clients write it: on errors it rejoins."""

    def __init__(self, coordinator: GroupCoordinator, name: str, rng: random.Random) -> None:
        super().__init__(coordinator, name)
        self.rng = rng
        self.chaos = True
        self.alive = True

    async def run(self) -> None:
        while True:
            if not self.alive:
                await trio.sleep(1)
                continue
            joined = await self.coordinator.join_group(
                GROUP,
                self.member_id,
                protocol_type="consumer",
                protocols=[("range", self.name.encode())],
                session_timeout_ms=SESSION_MS,
                rebalance_timeout_ms=REBALANCE_MS,
                client_id=self.name,
            )
            if joined.error is ErrorCode.member_id_required:
                self.member_id = joined.member_id
                continue
            if joined.error is ErrorCode.unknown_member_id:
                self.member_id = ""
                continue
            assert joined.error in (ErrorCode.none, ErrorCode.rebalance_in_progress), joined
            if joined.error is not ErrorCode.none:
                continue
            self.member_id = joined.member_id
            assignments = assign(joined)
            await self.maybe_misbehave()
            synced = await self.coordinator.sync_group(
                GROUP, self.member_id, joined.generation_id, assignments
            )
            if synced.error is not ErrorCode.none:
                self.forget_if(synced.error)
                continue
            self.generation, self.assignment = joined.generation_id, synced.assignment
            while self.alive:
                await trio.sleep(1)
                await self.maybe_misbehave()
                if not self.alive:
                    break
                error = self.coordinator.heartbeat(GROUP, self.member_id, self.generation)
                if error is not ErrorCode.none:
                    self.forget_if(error)
                    break

    def forget_if(self, error: ErrorCode) -> None:
        assert error in (
            ErrorCode.rebalance_in_progress,
            ErrorCode.illegal_generation,
            ErrorCode.unknown_member_id,
        ), error
        if error is ErrorCode.unknown_member_id:
            self.member_id = ""

    async def maybe_misbehave(self) -> None:
        if not self.chaos:
            return
        roll = self.rng.random()
        if roll < 0.02:  # stall: sometimes past the session timeout
            await trio.sleep(self.rng.uniform(1, 2 * SESSION_MS / 1000))
        elif roll < 0.03:  # leave politely, come back later as a new member
            self.coordinator.leave_group(GROUP, [(self.member_id, None)])
            self.member_id = ""
            await trio.sleep(self.rng.uniform(0, 20))
        elif roll < 0.04:  # crash: vanish without a word, restart with a new id
            self.member_id = ""
            await trio.sleep(self.rng.uniform(0, 30))


@pytest.mark.parametrize("seed", range(6))
async def test_group_converges_after_chaos(seed: int, autojump_clock: trio.abc.Clock) -> None:
    rng = random.Random(seed)
    coordinator = GroupCoordinator()
    violations: list[str] = []

    async def monitor() -> None:
        last_generation = 0
        while True:
            snap = coordinator.group(GROUP)
            if snap is not None:
                if snap.generation_id < last_generation:
                    violations.append(f"generation went back to {snap.generation_id}")
                last_generation = snap.generation_id
                ids = [m.member_id for m in snap.members]
                if snap.members and snap.leader not in ids:
                    violations.append(f"leader {snap.leader} is not a member")
                if snap.state is GroupState.STABLE:
                    for m in snap.members:
                        if m.assignment != assignment_of(m.member_id, snap.generation_id):
                            violations.append(f"{m.member_id} holds {m.assignment!r}")
            await trio.sleep(0.25)

    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        nursery.start_soon(monitor)
        consumers = [RobustConsumer(coordinator, f"c{i}", rng) for i in range(5)]
        for consumer in consumers:
            nursery.start_soon(consumer.run)
            await trio.sleep(rng.uniform(0, 5))
        await trio.sleep(CHAOS_SECONDS)
        for consumer in consumers:
            consumer.chaos = False
        consumers[0].alive = False  # one stays down for good
        live = consumers[1:]
        with trio.fail_after(120):
            while True:
                snap = coordinator.group(GROUP)
                if (
                    snap is not None
                    and snap.state is GroupState.STABLE
                    and len(snap.members) == len(live)
                    and all(c.owns_its_assignment(snap.generation_id) for c in live)
                ):
                    break
                await trio.sleep(0.5)
        assert {m.member_id for m in snap.members} == {c.member_id for c in live}
        nursery.cancel_scope.cancel()
    assert violations == []

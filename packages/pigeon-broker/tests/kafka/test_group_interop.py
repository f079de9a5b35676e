"""A real client's bytes: aiokafka's own request structs in, its own response parser out.

kio is generated from Kafka's schemas; this checks the other side of the wire too: what
aiokafka 0.14 encodes for each group API version it speaks is read by our handlers, and
what they answer is parsed by aiokafka's response classes, field for field.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import trio
from aiokafka.protocol import admin, group
from kio.index import load_request_schema
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader, entity_writer

from pigeon.broker._kafka_group import GroupCoordinator
from pigeon.broker._kafka_group_api import GROUP_HANDLERS

GROUP = "aiokafka-group"
PROTOCOLS = [("roundrobin", b"topics:orders")]


async def over_the_wire(coordinator: GroupCoordinator, struct: Any) -> Any:
    """Send aiokafka's encoded ``struct`` to its handler; parse the answer with aiokafka."""
    data = struct.encode()
    request, size = entity_reader(load_request_schema(struct.API_KEY, struct.API_VERSION))(data, 0)
    assert size == len(data)
    _, _, handler = GROUP_HANDLERS[struct.API_KEY]
    response = await handler(coordinator, request, client_id="aiokafka", client_host="/127.0.0.1")
    buffer = io.BytesIO()
    entity_writer(type(response))(buffer, response)
    answer = buffer.getvalue()
    parsed = struct.RESPONSE_TYPE.decode(io.BytesIO(answer))
    assert parsed.encode() == answer  # aiokafka read every byte, no more, no less
    return parsed


def join_struct(version: int, member_id: str) -> Any:
    if version == 0:
        return group.JoinGroupRequest_v0(GROUP, 10_000, member_id, "consumer", PROTOCOLS)
    if version in (1, 2):
        cls = group.JoinGroupRequest_v1 if version == 1 else group.JoinGroupRequest_v2
        return cls(GROUP, 10_000, 30_000, member_id, "consumer", PROTOCOLS)
    return group.JoinGroupRequest_v5(GROUP, 10_000, 30_000, member_id, None, "consumer", PROTOCOLS)


def sync_struct(version: int, member_id: str, generation: int, assignment: list[Any]) -> Any:
    if version == 3:
        return group.SyncGroupRequest_v3(GROUP, generation, member_id, None, assignment)
    cls = group.SyncGroupRequest_v0 if version == 0 else group.SyncGroupRequest_v1
    return cls(GROUP, generation, member_id, assignment)


@pytest.mark.parametrize(
    ("join_v", "sync_v", "other_v"), [(0, 0, 0), (1, 1, 1), (2, 1, 1), (5, 3, 1)]
)
async def test_aiokafka_group_conversation(
    join_v: int, sync_v: int, other_v: int, autojump_clock: trio.abc.Clock
) -> None:
    coordinator = GroupCoordinator()
    joined: list[Any] = []

    async def member() -> None:
        answer = await over_the_wire(coordinator, join_struct(join_v, ""))
        if join_v >= 4:
            assert answer.error_code == ErrorCode.member_id_required
            answer = await over_the_wire(coordinator, join_struct(join_v, answer.member_id))
        joined.append(answer)

    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        async with trio.open_nursery() as members:
            members.start_soon(member)
            members.start_soon(member)
        assert [j.error_code for j in joined] == [0, 0]
        leader = next(j for j in joined if j.leader_id == j.member_id)
        follower = next(j for j in joined if j.leader_id != j.member_id)
        assert leader.group_protocol == follower.group_protocol == "roundrobin"
        assert sorted(m[0] for m in leader.members) == sorted(j.member_id for j in joined)
        assert all(m[-1] == b"topics:orders" for m in leader.members)
        assert follower.members == []

        plan = [(j.member_id, f"partitions-of-{j.member_id}".encode()) for j in joined]
        synced: list[Any] = []

        async def sync(who: Any, assignment: list[Any]) -> None:
            struct = sync_struct(sync_v, who.member_id, who.generation_id, assignment)
            synced.append((who.member_id, await over_the_wire(coordinator, struct)))

        async with trio.open_nursery() as syncs:
            syncs.start_soon(sync, follower, [])
            await trio.sleep(1)
            syncs.start_soon(sync, leader, plan)
        assert sorted((m, s.error_code, s.member_assignment) for m, s in synced) == sorted(
            (m, 0, a) for m, a in plan
        )

        heartbeat_cls = group.HeartbeatRequest_v0 if other_v == 0 else group.HeartbeatRequest_v1
        beat = await over_the_wire(
            coordinator, heartbeat_cls(GROUP, follower.generation_id, follower.member_id)
        )
        assert beat.error_code == 0

        for describe_v in (0, 1, 2):
            cls = getattr(admin, f"DescribeGroupsRequest_v{describe_v}")
            (described,) = (await over_the_wire(coordinator, cls([GROUP]))).groups
            assert described[:5] == (0, GROUP, "Stable", "consumer", "roundrobin")
            assert sorted(described[5]) == sorted(
                (j.member_id, "aiokafka", "/127.0.0.1", b"topics:orders", a)
                for j, (_, a) in zip(joined, plan, strict=True)
            )
        listed = await over_the_wire(coordinator, admin.ListGroupsRequest_v1())
        assert listed.groups == [(GROUP, "consumer")]

        leave_cls = group.LeaveGroupRequest_v0 if other_v == 0 else group.LeaveGroupRequest_v1
        left = await over_the_wire(coordinator, leave_cls(GROUP, leader.member_id))
        assert left.error_code == 0
        beat = await over_the_wire(
            coordinator, heartbeat_cls(GROUP, follower.generation_id, follower.member_id)
        )
        assert beat.error_code == ErrorCode.rebalance_in_progress
        nursery.cancel_scope.cancel()

"""The group APIs' handlers, every supported version, through real kio serialization.

Each request is written to bytes and read back before it reaches its handler, and each
response is written and read back before it is checked, so a field a version lacks (or a
null a version cannot carry) fails here rather than on a client's socket.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import typing
from typing import Any

import pytest
import trio
from kio.index import load_request_schema, load_response_schema
from kio.schema.errors import ErrorCode
from kio.schema.types import GroupId
from kio.serial import entity_reader, entity_writer
from kio.static.primitive import i32, i32Timedelta

from pigeon.broker._kafka_group import GroupCoordinator
from pigeon.broker._kafka_group_api import GROUP_HANDLERS

JOIN, HEARTBEAT, LEAVE, SYNC, DESCRIBE, LIST = 11, 12, 13, 14, 15, 16
GROUP = "kcat-group"


def versions(api_key: int) -> list[int]:
    low, high, _ = GROUP_HANDLERS[api_key]
    return list(range(low, high + 1))


def test_served_versions_are_what_current_clients_negotiate() -> None:
    served = {key: (low, high) for key, (low, high, _) in GROUP_HANDLERS.items()}
    assert served == {
        JOIN: (0, 9),
        HEARTBEAT: (0, 4),
        LEAVE: (0, 5),
        SYNC: (0, 5),
        DESCRIBE: (0, 5),
        LIST: (0, 4),
    }


def wire(entity: Any) -> Any:
    """``entity`` written by kio and read back."""
    buffer = io.BytesIO()
    entity_writer(type(entity))(buffer, entity)
    data = buffer.getvalue()
    value, size = entity_reader(type(entity))(data, 0)
    assert size == len(data)
    return value


def make(cls: type[Any], **values: Any) -> Any:
    """A kio entity with the given fields this version has."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def nested(cls: type[Any], name: str) -> type[Any]:
    item: type[Any] = typing.get_args(typing.get_type_hints(cls)[name])[0]
    return item


def ms(value: int) -> i32Timedelta:
    return i32Timedelta.parse(datetime.timedelta(milliseconds=value))


async def call(coordinator: GroupCoordinator, api_key: int, version: int, **values: Any) -> Any:
    request = wire(make(load_request_schema(api_key, version), **values))
    _, _, handler = GROUP_HANDLERS[api_key]
    response = await handler(coordinator, request, client_id="kcat", client_host="/10.0.0.7")
    assert type(response) is load_response_schema(api_key, version)
    return wire(response)


@pytest.fixture
async def coordinator(nursery: trio.Nursery) -> GroupCoordinator:
    coordinator = GroupCoordinator()
    await nursery.start(coordinator.run)
    return coordinator


async def stable_member(coordinator: GroupCoordinator) -> str:
    joined = await coordinator.join_group(
        GROUP,
        "",
        protocol_type="consumer",
        protocols=[("range", b"subscription")],
        session_timeout_ms=10_000,
        client_id="kcat",
        client_host="/10.0.0.7",
        require_known_member_id=False,
    )
    await coordinator.sync_group(
        GROUP, joined.member_id, joined.generation_id, [(joined.member_id, b"assigned")]
    )
    return joined.member_id


@pytest.mark.parametrize("version", versions(JOIN))
async def test_join_group(
    coordinator: GroupCoordinator, version: int, autojump_clock: trio.abc.Clock
) -> None:
    protocol = nested(load_request_schema(JOIN, version), "protocols")
    request = {
        "group_id": GroupId(GROUP),
        "session_timeout": ms(10_000),
        "rebalance_timeout": ms(20_000),
        "member_id": "",
        "protocol_type": "consumer",
        "protocols": (make(protocol, name="range", metadata=b"subscription"),),
    }
    first = await call(coordinator, JOIN, version, **request)
    if version >= 4:
        assert first.error_code is ErrorCode.member_id_required
        assert first.member_id.startswith("kcat-") and first.generation_id == -1
        first = await call(coordinator, JOIN, version, **(request | {"member_id": first.member_id}))
    assert first.error_code is ErrorCode.none
    assert (first.generation_id, first.leader, first.protocol_name) == (1, first.member_id, "range")
    assert [(m.member_id, m.metadata) for m in first.members] == [
        (first.member_id, b"subscription")
    ]
    if version >= 7:
        assert first.protocol_type == "consumer"
    # An error answer is a valid response of this version too (no protocol, no members).
    unknown = await call(coordinator, JOIN, version, **(request | {"member_id": "nobody"}))
    assert unknown.error_code is ErrorCode.unknown_member_id
    assert unknown.protocol_name == ("" if version < 7 else None)
    assert unknown.members == ()


@pytest.mark.parametrize("version", versions(SYNC))
async def test_sync_group(
    coordinator: GroupCoordinator, version: int, autojump_clock: trio.abc.Clock
) -> None:
    joined = await coordinator.join_group(
        GROUP, "", protocol_type="consumer", protocols=[("range", b"")],
        session_timeout_ms=10_000, require_known_member_id=False,
    )  # fmt: skip
    assignment = nested(load_request_schema(SYNC, version), "assignments")
    request = {
        "group_id": GroupId(GROUP),
        "generation_id": i32(joined.generation_id),
        "member_id": joined.member_id,
        "protocol_type": "consumer",
        "protocol_name": "range",
        "assignments": (make(assignment, member_id=joined.member_id, assignment=b"p0,p1"),),
    }
    synced = await call(coordinator, SYNC, version, **request)
    assert (synced.error_code, synced.assignment) == (ErrorCode.none, b"p0,p1")
    if version >= 5:
        assert (synced.protocol_type, synced.protocol_name) == ("consumer", "range")
    stale = await call(coordinator, SYNC, version, **(request | {"generation_id": i32(0)}))
    assert (stale.error_code, stale.assignment) == (ErrorCode.illegal_generation, b"")


@pytest.mark.parametrize("version", versions(HEARTBEAT))
async def test_heartbeat(
    coordinator: GroupCoordinator, version: int, autojump_clock: trio.abc.Clock
) -> None:
    member = await stable_member(coordinator)
    request = {"group_id": GroupId(GROUP), "generation_id": i32(1), "member_id": member}
    assert (await call(coordinator, HEARTBEAT, version, **request)).error_code is ErrorCode.none
    stale = await call(coordinator, HEARTBEAT, version, **(request | {"generation_id": i32(7)}))
    assert stale.error_code is ErrorCode.illegal_generation
    unknown = await call(coordinator, HEARTBEAT, version, **(request | {"member_id": "nobody"}))
    assert unknown.error_code is ErrorCode.unknown_member_id


@pytest.mark.parametrize("version", versions(LEAVE))
async def test_leave_group(
    coordinator: GroupCoordinator, version: int, autojump_clock: trio.abc.Clock
) -> None:
    member = await stable_member(coordinator)
    if version < 3:
        left = await call(coordinator, LEAVE, version, group_id=GroupId(GROUP), member_id=member)
        assert left.error_code is ErrorCode.none
        again = await call(coordinator, LEAVE, version, group_id=GroupId(GROUP), member_id=member)
        assert again.error_code is ErrorCode.unknown_member_id
    else:
        identity = nested(load_request_schema(LEAVE, version), "members")
        left = await call(
            coordinator,
            LEAVE,
            version,
            group_id=GroupId(GROUP),
            members=(make(identity, member_id=member), make(identity, member_id="nobody")),
        )
        assert left.error_code is ErrorCode.none
        assert [(m.member_id, m.error_code) for m in left.members] == [
            (member, ErrorCode.none),
            ("nobody", ErrorCode.unknown_member_id),
        ]
    assert (snap := coordinator.group(GROUP)) is not None and snap.members == ()


@pytest.mark.parametrize("version", versions(DESCRIBE))
async def test_describe_groups(
    coordinator: GroupCoordinator, version: int, autojump_clock: trio.abc.Clock
) -> None:
    member = await stable_member(coordinator)
    described = await call(
        coordinator,
        DESCRIBE,
        version,
        groups=(GroupId(GROUP), GroupId("nope")),
        include_authorized_operations=False,
    )
    ours, unknown = described.groups
    assert (ours.error_code, ours.group_id, ours.group_state) == (ErrorCode.none, GROUP, "Stable")
    assert (ours.protocol_type, ours.protocol_data) == ("consumer", "range")
    assert [
        (m.member_id, m.client_id, m.client_host, m.member_metadata, m.member_assignment)
        for m in ours.members
    ] == [(member, "kcat", "/10.0.0.7", b"subscription", b"assigned")]
    assert (unknown.group_id, unknown.group_state, unknown.members) == ("nope", "Dead", ())


@pytest.mark.parametrize("version", versions(LIST))
async def test_list_groups(
    coordinator: GroupCoordinator, version: int, autojump_clock: trio.abc.Clock
) -> None:
    await stable_member(coordinator)
    listed = await call(coordinator, LIST, version)
    assert listed.error_code is ErrorCode.none
    assert [(g.group_id, g.protocol_type) for g in listed.groups] == [(GROUP, "consumer")]
    if version >= 4:
        assert listed.groups[0].group_state == "Stable"
        none = await call(coordinator, LIST, version, states_filter=("Empty",))
        assert none.groups == ()
        some = await call(coordinator, LIST, version, states_filter=("stable",))
        assert [g.group_id for g in some.groups] == [GROUP]

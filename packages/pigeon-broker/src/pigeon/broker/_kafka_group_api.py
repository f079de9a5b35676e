"""Kafka's classic group APIs: kio requests into the group coordinator, kio responses out.

Each handler takes a request of any supported version (typed ``Any``, as in the other Kafka
handler modules) and answers with the response class of that same version
(``kio.index.load_response_schema(api_key, version)``). kio generates one dataclass per
version, and versions differ only in which fields exist, so responses are built by one
helper, :func:`_build`, that passes the fields the version has and drops the others; a
``None`` string becomes ``""`` where the version cannot carry null (as Kafka's own
``KafkaApis`` does for JoinGroup's protocol name before v7). Fields a request version lacks
are read with ``getattr(request, name, default)``.

Every handler is called as ``handler(coordinator, request, *, client_id, client_host)``
(the client id of the request header and the peer's host, which JoinGroup records for
DescribeGroups; the others take them as ``**_``); :data:`GROUP_HANDLERS` maps each API key
to the versions served and its handler, for the front door's ApiVersions and dispatch.
"""

from __future__ import annotations

import dataclasses
import datetime
import typing
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kio.index import load_response_schema
from kio.schema.errors import ErrorCode
from kio.schema.types import GroupId
from kio.static.primitive import i32, i32Timedelta
from kio.static.protocol import ResponsePayload

from pigeon.broker._kafka_group import GroupCoordinator, GroupState

__all__ = [
    "GROUP_HANDLERS",
    "describe_groups",
    "heartbeat",
    "join_group",
    "leave_group",
    "list_groups",
    "sync_group",
]

_NO_THROTTLE = i32Timedelta.parse(datetime.timedelta(0))
_GROUP_TYPE = "classic"  # ListGroups v5's type of every group served here


# -- building responses of any version ----------------------------------------------------

_E = TypeVar("_E")


_FieldInfo = tuple[frozenset[str], frozenset[str], dict[str, Any]]
_FIELDS: dict[type[Any], _FieldInfo] = {}


def _fields(cls: type[Any]) -> _FieldInfo:
    """(field names, non-nullable str fields, type hints) of a kio dataclass, cached."""
    info = _FIELDS.get(cls)
    if info is None:
        hints = typing.get_type_hints(cls)
        names = frozenset(f.name for f in dataclasses.fields(cls))
        strings = frozenset(name for name in names if hints[name] is str)
        info = _FIELDS[cls] = (names, strings, hints)
    return info


def _build(cls: type[_E], **values: object) -> _E:
    """``cls(**values)`` with only the fields this version has."""
    names, strings, _ = _fields(cls)
    kwargs = {
        name: ("" if value is None and name in strings else value)
        for name, value in values.items()
        if name in names
    }
    return cls(**kwargs)


def _nested(cls: type[Any], name: str) -> type[Any]:
    """The entity class of the tuple field ``name`` (e.g. JoinGroupResponse.members)."""
    item: type[Any] = typing.get_args(_fields(cls)[2][name])[0]
    return item


def _response_type(request: Any) -> type[Any]:
    return load_response_schema(request.__api_key__, request.__version__)


def _answer(cls: type[Any], **values: object) -> ResponsePayload:
    """The response ``cls`` (no throttling) with the fields this version has."""
    response: ResponsePayload = _build(cls, throttle_time=_NO_THROTTLE, **values)
    return response


def _ms(delta: datetime.timedelta) -> int:
    return round(delta.total_seconds() * 1000)


# -- handlers -----------------------------------------------------------------------------


async def join_group(
    coordinator: GroupCoordinator,
    request: Any,
    *,
    client_id: str = "",
    client_host: str = "",
) -> ResponsePayload:
    """JoinGroup v0-v9; v4+ asks a new member to come back with an id first."""
    rebalance: datetime.timedelta | None = getattr(request, "rebalance_timeout", None)
    result = await coordinator.join_group(
        str(request.group_id),
        request.member_id,
        protocol_type=request.protocol_type,
        protocols=[(p.name, p.metadata) for p in request.protocols],
        session_timeout_ms=_ms(request.session_timeout),
        rebalance_timeout_ms=None if rebalance is None else _ms(rebalance),
        group_instance_id=getattr(request, "group_instance_id", None),
        client_id=client_id,
        client_host=client_host,
        require_known_member_id=request.__version__ >= 4,
    )
    cls = _response_type(request)
    member_cls = _nested(cls, "members")
    return _answer(
        cls,
        error_code=result.error,
        generation_id=i32(result.generation_id),
        protocol_type=result.protocol_type,
        protocol_name=result.protocol_name,
        leader=result.leader,
        skip_assignment=False,
        member_id=result.member_id,
        members=tuple(
            _build(
                member_cls,
                member_id=m.member_id,
                group_instance_id=m.group_instance_id,
                metadata=m.metadata,
            )
            for m in result.members
        ),
    )


async def sync_group(coordinator: GroupCoordinator, request: Any, **_: str) -> ResponsePayload:
    """SyncGroup v0-v5; a follower's call waits for the leader's."""
    result = await coordinator.sync_group(
        str(request.group_id),
        request.member_id,
        int(request.generation_id),
        [(a.member_id, a.assignment) for a in request.assignments],
        protocol_type=getattr(request, "protocol_type", None),
        protocol_name=getattr(request, "protocol_name", None),
        group_instance_id=getattr(request, "group_instance_id", None),
    )
    return _answer(
        _response_type(request),
        error_code=result.error,
        protocol_type=result.protocol_type,
        protocol_name=result.protocol_name,
        assignment=result.assignment,
    )


async def heartbeat(coordinator: GroupCoordinator, request: Any, **_: str) -> ResponsePayload:
    """Heartbeat v0-v4."""
    error = coordinator.heartbeat(
        str(request.group_id),
        request.member_id,
        int(request.generation_id),
        group_instance_id=getattr(request, "group_instance_id", None),
    )
    return _answer(_response_type(request), error_code=error)


async def leave_group(coordinator: GroupCoordinator, request: Any, **_: str) -> ResponsePayload:
    """LeaveGroup v0-v2 (one member) and v3-v5 (a batch, one error per member)."""
    batch = getattr(request, "members", None)
    if batch is None:
        leaving = [(str(getattr(request, "member_id", "")), None)]  # v0-v2: one member
    else:
        leaving = [(m.member_id, m.group_instance_id) for m in batch]
    error, results = coordinator.leave_group(str(request.group_id), leaving)
    if batch is None and error is ErrorCode.none and results:
        error = results[0][2]  # v0-v2 carry the member's error at the top, as Kafka does
    cls = _response_type(request)
    names = _fields(cls)[0]
    member_cls = _nested(cls, "members") if "members" in names else None
    return _answer(
        cls,
        error_code=error,
        members=()
        if member_cls is None
        else tuple(
            _build(member_cls, member_id=m, group_instance_id=i, error_code=e)
            for m, i, e in results
        ),
    )


async def describe_groups(
    coordinator: GroupCoordinator, request: Any, *, hidden: frozenset[str] = frozenset(), **_: str
) -> ResponsePayload:
    """DescribeGroups v0-v5: state, protocol and members (metadata when Stable); the
    ``hidden`` groups (the role may not use them) are answered GROUP_AUTHORIZATION_FAILED
    and nothing else."""
    cls = _response_type(request)
    group_cls = _nested(cls, "groups")
    member_cls = _nested(group_cls, "members")
    described = []
    for group_id in request.groups:
        if str(group_id) in hidden:
            described.append(
                _build(
                    group_cls,
                    error_code=ErrorCode.group_authorization_failed,
                    group_id=GroupId(group_id),
                    group_state="",
                    protocol_type="",
                    protocol_data="",
                    members=(),
                )
            )
            continue
        snap = coordinator.group(str(group_id))
        # Kafka describes an unknown group as Dead, without error
        described.append(
            _build(
                group_cls,
                error_code=ErrorCode.none,
                group_id=GroupId(group_id),
                group_state=GroupState.DEAD.value if snap is None else snap.state.value,
                protocol_type="" if snap is None else snap.protocol_type,
                protocol_data="" if snap is None else snap.protocol_name,
                members=()
                if snap is None
                else tuple(
                    _build(
                        member_cls,
                        member_id=m.member_id,
                        group_instance_id=m.group_instance_id,
                        client_id=m.client_id,
                        client_host=m.client_host,
                        member_metadata=m.metadata,
                        member_assignment=m.assignment,
                    )
                    for m in snap.members
                ),
            )
        )
    return _answer(cls, groups=tuple(described))


async def list_groups(
    coordinator: GroupCoordinator, request: Any, *, hidden: frozenset[str] = frozenset(), **_: str
) -> ResponsePayload:
    """ListGroups v0-v4 (v4 filters by state, case-insensitively, as Kafka does),
    without the ``hidden`` groups (the role may not use them)."""
    states = {s.lower() for s in getattr(request, "states_filter", ())}
    types = {t.lower() for t in getattr(request, "types_filter", ())}
    cls = _response_type(request)
    group_cls = _nested(cls, "groups")
    listed = tuple(
        _build(
            group_cls,
            group_id=GroupId(snap.group_id),
            protocol_type=snap.protocol_type,
            group_state=snap.state.value,
            group_type=_GROUP_TYPE,
        )
        for snap in coordinator.groups()
        if snap.group_id not in hidden
        and (not states or snap.state.value.lower() in states)
        and (not types or _GROUP_TYPE in types)
    )
    return _answer(cls, error_code=ErrorCode.none, groups=listed)


GroupHandler = Callable[..., Awaitable[ResponsePayload]]
"""``handler(coordinator, request, *, client_id, client_host) -> response``."""

GROUP_HANDLERS: dict[int, tuple[int, int, GroupHandler]] = {
    11: (0, 9, join_group),
    12: (0, 4, heartbeat),
    13: (0, 5, leave_group),
    14: (0, 5, sync_group),
    15: (0, 5, describe_groups),
    16: (0, 4, list_groups),
}
"""API key -> (min version, max version, handler): JoinGroup 11, Heartbeat 12,
LeaveGroup 13, SyncGroup 14, DescribeGroups 15, ListGroups 16."""

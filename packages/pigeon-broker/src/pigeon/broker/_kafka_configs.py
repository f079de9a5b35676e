"""Kafka config requests: DescribeConfigs, AlterConfigs and IncrementalAlterConfigs.

A topic's own configs are those ``_topic_configs`` keeps (``cleanup.policy``,
``min.cleanable.dirty.ratio``): DescribeConfigs gives them with ``config_source``
DYNAMIC_TOPIC_CONFIG (1) when set, DEFAULT_CONFIG (5) otherwise, and both alter APIs
change them.  The others a topic is described with come from the namespace's policies
or the broker's configuration and are read-only here (DEFAULT_CONFIG); an alter that
names one of the Kafka topic configs without a per-topic meaning (``retention.ms``,
``segment.ms``, ...) is accepted and changes nothing, an unknown name is refused
INVALID_CONFIG, as Kafka does.  Broker configs are described and never altered (they
are the broker's ``pigeon.toml``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from kio.schema.errors import ErrorCode

from pigeon.broker._kafka_wire import ZERO, build, error_code, part, response_type
from pigeon.broker._topic_configs import (
    CLEANUP_POLICY,
    STORED_CONFIGS,
    apply_changes,
    check_config,
)
from pigeon.core.errors import InvalidArgument, PigeonError, TopicNotFound

if TYPE_CHECKING:
    from pigeon.broker._kafka import KafkaConnection, KafkaFrontDoor

__all__ = ["HANDLERS", "topic_config_entries"]

log = logging.getLogger(__name__)

#: Kafka's resource types
TOPIC: Final = 2
BROKER: Final = 4
#: Kafka's ConfigSource
DYNAMIC_TOPIC_CONFIG: Final = 1
DEFAULT_CONFIG: Final = 5
#: Kafka's ConfigType
_STRING, _INT, _LONG, _DOUBLE, _LIST, _BOOLEAN = 2, 3, 5, 6, 7, 1


class ConfigEntry(NamedTuple):
    """One described config."""

    value: str
    source: int = DEFAULT_CONFIG
    read_only: bool = True
    config_type: int = _STRING

    @property
    def is_default(self) -> bool:
        return self.source == DEFAULT_CONFIG


def topic_config_entries(
    stored: dict[str, str], policies: Any, max_message_size: int
) -> dict[str, ConfigEntry]:
    """Every config a topic is described with: its own (``stored``, else the default),
    then those the namespace ``policies`` and the broker decide."""
    retention_s = policies.retention_time_s
    retention_mb = policies.retention_size_mb
    own = {
        name: ConfigEntry(
            stored.get(name, default),
            DYNAMIC_TOPIC_CONFIG if name in stored else DEFAULT_CONFIG,
            read_only=False,
            config_type=_LIST if name == CLEANUP_POLICY else _DOUBLE,
        )
        for name, default in STORED_CONFIGS.items()
    }
    return {
        **own,
        "compression.type": ConfigEntry("producer"),
        "delete.retention.ms": ConfigEntry("0", config_type=_LONG),
        "max.compaction.lag.ms": ConfigEntry("9223372036854775807", config_type=_LONG),
        "max.message.bytes": ConfigEntry(str(max_message_size), config_type=_INT),
        "message.timestamp.type": ConfigEntry("CreateTime"),
        "min.compaction.lag.ms": ConfigEntry("0", config_type=_LONG),
        "min.insync.replicas": ConfigEntry("1", config_type=_INT),
        "retention.bytes": ConfigEntry(
            str(-1 if retention_mb < 0 else int(retention_mb * 1024 * 1024)), config_type=_LONG
        ),
        "retention.ms": ConfigEntry(
            str(-1 if retention_s < 0 else int(retention_s * 1000)), config_type=_LONG
        ),
    }


async def _topic(conn: KafkaConnection, kafka_topic: str, action: str) -> Any:
    """The partitioned topic of ``kafka_topic`` after checking the role may ``action``."""
    door = conn.door
    await conn.authorize(action, kafka_topic)
    name = door.topic_name(kafka_topic)
    if not await door.core.partitions_of(name):
        raise TopicNotFound(f"topic {kafka_topic!r} does not exist")
    return name


async def describe_configs(conn: KafkaConnection, request: Any) -> Any:
    door = conn.door
    cls = response_type(request)
    results = []
    for resource in request.resources:
        code, message, entries = ErrorCode.none, None, ()
        try:
            if resource.resource_type == TOPIC:
                name = await _topic(conn, resource.resource_name, "lookup")
                stored = await door.core.topic_configs.get(name)
                policies = door.core.policies.cached(name.namespace_name)
                configs = topic_config_entries(stored, policies, door.core.max_message_size(name))
            elif resource.resource_type == BROKER:
                configs = {
                    "message.max.bytes": ConfigEntry(
                        str(door.core.config.max_message_size), config_type=_INT
                    ),
                    "auto.create.topics.enable": ConfigEntry(
                        str(door.config.auto_create_topics).lower(), config_type=_BOOLEAN
                    ),
                    "num.partitions": ConfigEntry(
                        str(door.config.default_partitions), config_type=_INT
                    ),
                }
            else:
                raise InvalidArgument(f"resource type {resource.resource_type} is not described")
            wanted = resource.configuration_keys
            entries = tuple(
                part(
                    cls,
                    "DescribeConfigsResourceResult",
                    name=k,
                    value=e.value,
                    read_only=e.read_only,
                    is_default=e.is_default,
                    config_source=e.source,
                    is_sensitive=False,
                    synonyms=(),
                    config_type=e.config_type,
                    documentation=None,
                )
                for k, e in sorted(configs.items())
                if wanted is None or k in wanted
            )
        except PigeonError as exc:
            code, message = error_code(exc), str(exc)
        results.append(
            part(
                cls,
                "DescribeConfigsResult",
                error_code=code,
                error_message=message,
                resource_type=resource.resource_type,
                resource_name=resource.resource_name,
                configs=entries,
            )
        )
    return build(cls, throttle_time=ZERO, results=tuple(results))


async def _alter_one(
    conn: KafkaConnection,
    resource: Any,
    change: Callable[[dict[str, str]], dict[str, str]],
    validate_only: bool,
) -> tuple[ErrorCode, str | None]:
    """Change one resource's configs; its (error code, message)."""
    door: KafkaFrontDoor = conn.door
    kind = resource.resource_type
    if kind == BROKER:
        return ErrorCode.invalid_request, (
            "broker configs are not changed through Kafka: they are the broker's"
            " configuration (pigeon.toml)"
        )
    if kind != TOPIC:
        return ErrorCode.invalid_request, f"resource type {kind} has no configs to alter"
    try:
        name = await _topic(conn, resource.resource_name, "admin")
        try:
            config = await door.core.topic_configs.update(name, change, validate_only=validate_only)
        except InvalidArgument as exc:
            return ErrorCode.invalid_config, exc.message
    except PigeonError as exc:
        return error_code(exc), str(exc)
    if not validate_only:
        log.info("kafka topic configs altered topic=%s configs=%s", name, config)
    return ErrorCode.none, None


def _answer(cls: type[Any], resource: Any, outcome: tuple[ErrorCode, str | None]) -> Any:
    return part(
        cls,
        "AlterConfigsResourceResponse",
        error_code=outcome[0],
        error_message=outcome[1],
        resource_type=resource.resource_type,
        resource_name=resource.resource_name,
    )


async def alter_configs(conn: KafkaConnection, request: Any) -> Any:
    """AlterConfigs: the named configs replace all of a topic's own (those not named go
    back to their defaults), as Kafka's legacy API does."""
    cls = response_type(request)
    answers = []
    for resource in request.resources:
        given = [(c.name, c.value) for c in resource.configs]

        def replace(_current: dict[str, str], given: list[Any] = given) -> dict[str, str]:
            out = {}
            for name, value in given:
                stored = check_config(name, value)
                if stored is not None:
                    out[name] = stored
            return out

        outcome = await _alter_one(conn, resource, replace, request.validate_only)
        answers.append(_answer(cls, resource, outcome))
    return build(cls, throttle_time=ZERO, responses=tuple(answers))


async def incremental_alter_configs(conn: KafkaConnection, request: Any) -> Any:
    """IncrementalAlterConfigs: SET, DELETE (back to the default), APPEND and SUBTRACT
    (``cleanup.policy``, a list) per config."""
    cls = response_type(request)
    answers = []
    for resource in request.resources:
        changes = [(c.name, int(c.config_operation), c.value) for c in resource.configs]

        def change(current: dict[str, str], changes: list[Any] = changes) -> dict[str, str]:
            return apply_changes(current, changes)

        outcome = await _alter_one(conn, resource, change, request.validate_only)
        answers.append(_answer(cls, resource, outcome))
    return build(cls, throttle_time=ZERO, responses=tuple(answers))


HANDLERS = {32: describe_configs, 33: alter_configs, 44: incremental_alter_configs}

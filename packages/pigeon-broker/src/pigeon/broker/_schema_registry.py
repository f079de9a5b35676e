"""The per-topic schema registry, kept in the metadata store.

``/pigeon/schemas/<tenant>/<namespace>/<topic>`` (see :func:`pigeon.core.paths.schema_path`)
holds one JSON document per topic, changed by compare-and-set::

    {"next": 3, "versions": [{"version": 0, "type": "AVRO", "definition": "...",
                              "timestamp": 1700000000000}, ...]}

Versions count from 0 as Pulsar's do; a delete drops every version but keeps ``next``, so a
version number is never reused.  The namespace's policies decide what attaches:
``schema_compatibility_strategy`` (see :mod:`pigeon.broker._schema_compat`),
``is_allow_auto_update_schema`` and ``schema_validation_enforced``.  Schemas are read on
attach only, never per message.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pigeon.broker._policies import PolicyStore
from pigeon.broker._schema_compat import SchemaData, check_compatible, check_readable
from pigeon.core import TopicName
from pigeon.core.errors import (
    BadVersion,
    IncompatibleSchema,
    InvalidArgument,
    NodeExists,
    SchemaNotFound,
)
from pigeon.core.paths import schema_path

__all__ = ["NO_SCHEMA", "SchemaRegistry"]

#: the version of "no schema" on the wire (ProducerCreated.schemaVersion)
NO_SCHEMA = -1


def _versions(doc: dict[str, Any]) -> list[tuple[int, SchemaData]]:
    return [
        (int(v["version"]), SchemaData(v["type"], v.get("definition", "")))
        for v in doc.get("versions", [])
    ]


class SchemaRegistry:
    """Reads and changes topics' schemas; decides what a producer or consumer may attach."""

    def __init__(self, store: Any, policies: PolicyStore) -> None:
        self.store = store
        self.policies = policies

    async def _read(self, topic: TopicName) -> tuple[dict[str, Any], int | None]:
        stat = await self.store.get(schema_path(topic))
        if stat is None:
            return {"next": 0, "versions": []}, None
        return json.loads(stat.value), stat.version

    async def versions(self, topic: TopicName) -> list[tuple[int, SchemaData]]:
        """Every stored version, oldest first (empty: the topic has no schema)."""
        doc, _ = await self._read(topic)
        return _versions(doc)

    async def get(self, topic: TopicName, version: int | None = None) -> tuple[int, SchemaData]:
        """``(version, schema)``: the latest, or version ``version``; SchemaNotFound."""
        versions = await self.versions(topic)
        if not versions:
            raise SchemaNotFound(f"topic {topic.base.full} has no schema")
        if version is None or version < 0:
            return versions[-1]
        for v, schema in versions:
            if v == version:
                return v, schema
        raise SchemaNotFound(f"topic {topic.base.full} has no schema version {version}")

    async def _add(
        self, topic: TopicName, schema: SchemaData, *, check: bool, auto_update: bool = True
    ) -> int:
        """The version of ``schema`` on ``topic``, added (checked unless not ``check``)."""
        path = schema_path(topic)
        for _attempt in range(10):
            doc, node_version = await self._read(topic)
            versions = _versions(doc)
            for v, old in versions:
                if old.same_as(schema):
                    return v
            if versions:
                policies = await self.policies.get(topic.namespace_name)
                if not auto_update:
                    raise IncompatibleSchema(
                        f"schema is not registered on topic {topic.base.full} and "
                        "is_allow_auto_update_schema is off"
                    )
                if check:
                    check_compatible(schema, versions, policies.schema_compatibility_strategy)
            version = int(doc.get("next", 0))
            doc = {
                "next": version + 1,
                "versions": [
                    *doc.get("versions", []),
                    {
                        "version": version,
                        "type": schema.type,
                        "definition": schema.definition,
                        "timestamp": int(time.time() * 1000),
                    },
                ],
            }
            value = json.dumps(doc).encode()
            try:
                if node_version is None:
                    await self.store.create(path, value)
                else:
                    await self.store.set(path, value, version=node_version)
            except (BadVersion, NodeExists):
                continue  # changed meanwhile: decide again on what is there now
            return version
        raise InvalidArgument(f"schema of {topic.base.full} is being changed concurrently")

    async def attach_producer(self, topic: TopicName, schema: SchemaData | None) -> int:
        """The version a producer with ``schema`` writes (NO_SCHEMA: bytes), registering
        it when allowed; IncompatibleSchema otherwise."""
        if schema is None or schema.type == "BYTES":
            policies = await self.policies.get(topic.namespace_name)
            if policies.schema_validation_enforced and await self.versions(topic):
                raise IncompatibleSchema(
                    f"topic {topic.base.full} has a schema and schema_validation_enforced "
                    "refuses a producer without one"
                )
            return NO_SCHEMA
        policies = await self.policies.get(topic.namespace_name)
        return await self._add(
            topic, schema, check=True, auto_update=policies.is_allow_auto_update_schema
        )

    async def attach_consumer(self, topic: TopicName, schema: SchemaData | None) -> None:
        """A consumer with ``schema`` must read the topic's data (registered as the first
        version when the topic has none, as Pulsar does)."""
        if schema is None or schema.type == "BYTES":
            return
        versions = await self.versions(topic)
        if not versions:
            await self._add(topic, schema, check=False)
            return
        if any(old.same_as(schema) for _v, old in versions):
            return
        policies = await self.policies.get(topic.namespace_name)
        check_readable(schema, versions, policies.schema_compatibility_strategy)

    async def upload(self, topic: TopicName, schema: SchemaData) -> int:
        """Admin upload: a new version if compatible (auto update does not apply)."""
        return await self._add(topic, schema, check=True)

    async def compatibility(self, topic: TopicName, schema: SchemaData) -> tuple[bool, str, str]:
        """``(compatible, reason, strategy)`` of ``schema`` as the topic's next version."""
        policies = await self.policies.get(topic.namespace_name)
        strategy = policies.schema_compatibility_strategy
        versions = await self.versions(topic)
        if any(old.same_as(schema) for _v, old in versions):
            return True, "", strategy
        try:
            check_compatible(schema, versions, strategy)
        except IncompatibleSchema as exc:
            return False, exc.message, strategy
        return True, "", strategy

    async def delete(self, topic: TopicName) -> list[int]:
        """Drop every version (numbers are not reused); the versions deleted."""
        path = schema_path(topic)
        for _attempt in range(10):
            doc, node_version = await self._read(topic)
            if node_version is None or not doc.get("versions"):
                raise SchemaNotFound(f"topic {topic.base.full} has no schema")
            deleted = [int(v["version"]) for v in doc["versions"]]
            value = json.dumps({"next": doc.get("next", 0), "versions": []}).encode()
            try:
                await self.store.set(path, value, version=node_version)
            except BadVersion:
                continue
            return deleted
        raise InvalidArgument(f"schema of {topic.base.full} is being changed concurrently")

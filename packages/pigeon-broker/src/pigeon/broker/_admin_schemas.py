"""The admin API's schema routes, on Pulsar's paths::

    GET    /admin/v2/schemas/{tenant}/{namespace}/{topic}/schema            the latest version
    GET    /admin/v2/schemas/{tenant}/{namespace}/{topic}/schema/{version}  one version
    GET    /admin/v2/schemas/{tenant}/{namespace}/{topic}/schemas           every version
    POST   /admin/v2/schemas/{tenant}/{namespace}/{topic}/schema            upload (checked)
    DELETE /admin/v2/schemas/{tenant}/{namespace}/{topic}/schema            delete every version
    POST   /admin/v2/schemas/{tenant}/{namespace}/{topic}/compatibility     would it be accepted?

(``.../versions/{version}`` is kept as another name of ``.../schema/{version}``.)  Bodies
and answers are Pulsar's ``PostSchemaPayload``, ``GetSchemaResponse``,
``IsCompatibilityResponse``; ``{topic}`` is the local name in persistent://, and a
partition's schema is its partitioned topic's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Path

from pigeon.broker._admin_models import (
    DeletedSchema,
    NamePart,
    SchemaCompatibility,
    SchemaIn,
    SchemaOut,
    SchemaVersion,
    SchemaVersions,
    TopicPart,
)
from pigeon.broker._schema_compat import SchemaData
from pigeon.broker._service import BrokerService
from pigeon.core import TopicName
from pigeon.core.paths import schema_path

__all__ = ["schema_routes"]

Version = Annotated[int, Path(ge=0, le=2**62)]


def schema_routes(api: APIRouter, service: BrokerService) -> None:
    tags: list[Any] = ["schemas"]
    base = "/schemas/{tenant}/{namespace}/{topic}"

    def name_of(tenant: str, namespace: str, topic: str) -> TopicName:
        return TopicName.parse(f"persistent://{tenant}/{namespace}/{topic}")

    async def stamped(name: TopicName, version: int, schema: SchemaData) -> dict[str, Any]:
        stat = await service.store.get(schema_path(name))
        timestamp = 0
        if stat is not None:
            for v in json.loads(stat.value).get("versions", []):
                if v["version"] == version:
                    timestamp = int(v.get("timestamp", 0))
        return {
            "version": version,
            "type": schema.type,
            "schema": schema.definition,
            "timestamp": timestamp,
            "properties": {},
        }

    @api.get(base + "/schema", response_model=SchemaOut, tags=tags)
    async def get_schema(tenant: NamePart, namespace: NamePart, topic: TopicPart) -> Any:
        """The topic's latest schema version (404 without a schema)."""
        name = name_of(tenant, namespace, topic)
        version, schema = await service.schemas.get(name)
        return await stamped(name, version, schema)

    async def get_version(
        tenant: NamePart, namespace: NamePart, topic: TopicPart, version: Version
    ) -> Any:
        """One version of the topic's schema."""
        name = name_of(tenant, namespace, topic)
        found, schema = await service.schemas.get(name, version)
        return await stamped(name, found, schema)

    api.get(base + "/schema/{version}", response_model=SchemaOut, tags=tags)(get_version)
    api.get(
        base + "/versions/{version}",
        response_model=SchemaOut,
        tags=tags,
        include_in_schema=False,
    )(get_version)

    @api.get(base + "/schemas", response_model=SchemaVersions, tags=tags)
    async def all_versions(tenant: NamePart, namespace: NamePart, topic: TopicPart) -> Any:
        name = name_of(tenant, namespace, topic)
        return {
            "getSchemaResponses": [
                await stamped(name, v, schema) for v, schema in await service.schemas.versions(name)
            ]
        }

    @api.post(base + "/schema", response_model=SchemaVersion, tags=tags)
    async def upload(
        tenant: NamePart, namespace: NamePart, topic: TopicPart, body: SchemaIn
    ) -> Any:
        """Add a schema version, checked under the namespace's compatibility strategy
        (409 IncompatibleSchema); the same schema again answers its existing version."""
        name = name_of(tenant, namespace, topic)
        return {"version": await service.schemas.upload(name, SchemaData(body.type, body.schema_))}

    @api.delete(base + "/schema", response_model=DeletedSchema, tags=tags)
    async def delete(tenant: NamePart, namespace: NamePart, topic: TopicPart) -> Any:
        """Delete every version (numbers are not reused by later uploads)."""
        deleted = await service.schemas.delete(name_of(tenant, namespace, topic))
        return {"version": deleted[-1]}

    @api.post(base + "/compatibility", response_model=SchemaCompatibility, tags=tags)
    async def compatibility(
        tenant: NamePart, namespace: NamePart, topic: TopicPart, body: SchemaIn
    ) -> Any:
        """Would this schema be accepted as the topic's next version?"""
        name = name_of(tenant, namespace, topic)
        ok, reason, strategy = await service.schemas.compatibility(
            name, SchemaData(body.type, body.schema_)
        )
        return {
            "compatibility": ok,
            "schemaCompatibilityStrategy": strategy.upper(),
            "reason": reason,
        }

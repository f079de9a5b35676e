"""Schemas through the sync and asyncio faces, the admin REST API and the real ``pigeon
admin schemas`` command, against one standalone on a background thread."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from admin_support import AdminStandalone

from pigeon.client import Client, IncompatibleSchema
from pigeon.client import asyncio as aio
from pigeon.client._admin_client import AdminClient, AdminError
from pigeon.client.schema import AvroSchema, Integer, JsonSchema, Record, String
from pigeon.core.testing.servers import clean_env, pigeon_command


class Point(Record):
    x = Integer(required=True)
    y = Integer(required=True)


class Named(Record):
    name = String(required=True)


def test_sync_face_round_trip(admin_standalone: AdminStandalone) -> None:
    schema = JsonSchema(Point)
    with Client(admin_standalone.service_url) as client:
        with client.subscribe("sync-points", "s", schema=schema) as consumer:
            with client.create_producer("sync-points", schema=schema) as producer:
                producer.send(Point(x=1, y=2))
                producer.send_async(Point(x=3, y=4))
                producer.flush()
            got = [consumer.receive(timeout=10) for _ in range(2)]
        assert [m.value for m in got] == [Point(x=1, y=2), Point(x=3, y=4)]
        assert json.loads(got[0].data) == {"x": 1, "y": 2}
        with client.create_reader("sync-points", schema=schema) as reader:
            assert reader.read_next(timeout=10).value == Point(x=1, y=2)


def test_asyncio_face_round_trip(admin_standalone: AdminStandalone) -> None:
    schema = AvroSchema(Point)

    async def main() -> None:
        async with aio.Client(admin_standalone.service_url) as client:
            consumer = await client.subscribe("aio-points", "s", schema=schema)
            producer = await client.create_producer("aio-points", schema=schema)
            await producer.send(Point(x=5, y=6))
            msg = await consumer.receive(timeout=10)
            assert msg.value == Point(x=5, y=6) and msg.data == schema.encode(Point(x=5, y=6))
            try:
                await client.create_producer("aio-points", schema=AvroSchema(Named))
            except IncompatibleSchema as exc:
                assert "record name changed" in exc.message
            else:
                raise AssertionError("an incompatible producer was accepted")

    asyncio.run(asyncio.wait_for(main(), 30))


def test_rest_and_namespace_strategy(admin_standalone: AdminStandalone) -> None:
    admin = AdminClient(admin_standalone.url)
    admin.create_namespace("public/schemas", {})
    topic = "persistent://public/schemas/rest"
    v0 = {"type": "AVRO", "schema": AvroSchema(Named).definition()}
    assert admin.upload_schema(topic, v0) == {"version": 0}
    assert admin.upload_schema(topic, v0) == {"version": 0}  # the same schema again
    got = admin.schema(topic)
    assert (got["version"], got["type"], got["schema"]) == (0, "AVRO", v0["schema"])
    titled = Named.schema() | {"fields": [{"name": "title", "type": "string"}]}
    renamed = {"type": "AVRO", "schema": json.dumps(titled)}
    answer = admin.schema_compatibility(topic, renamed)
    assert answer["compatibility"] is False and answer["schemaCompatibilityStrategy"] == "FULL"
    assert "field 'title' has no default" in answer["reason"]
    try:
        admin.upload_schema(topic, renamed)
        raise AssertionError("an incompatible upload was accepted")
    except AdminError as exc:
        assert exc.status == 409 and exc.body["error"] == "IncompatibleSchema"
    admin.set_policies("public/schemas", {"schema_compatibility_strategy": "always_compatible"})
    assert admin.policies("public/schemas")["schema_compatibility_strategy"] == "always_compatible"
    assert admin.upload_schema(topic, renamed) == {"version": 1}
    assert [v["version"] for v in admin.schema_versions(topic)] == [0, 1]
    assert admin.schema(topic, 0)["schema"] == v0["schema"]
    admin.set_policies("public/schemas", {"is_allow_auto_update_schema": False})
    with Client(admin_standalone.service_url) as client:
        try:
            client.create_producer(topic, schema=JsonSchema(Point))
            raise AssertionError("auto update is off, yet a new schema was added")
        except IncompatibleSchema as exc:
            assert "is_allow_auto_update_schema" in exc.message
    try:
        admin.set_policies("public/schemas", {"schema_compatibility_strategy": "sideways"})
        raise AssertionError("a bad strategy was accepted")
    except AdminError as exc:
        assert exc.status in (400, 422)


def test_cli_schemas(admin_standalone: AdminStandalone, tmp_path: Path) -> None:
    """``pigeon admin schemas`` as a user types it: upload, get, compatibility, delete."""
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    schema_file = tmp_path / "named.json"
    schema_file.write_text(json.dumps({"type": "AVRO", "schema": Named.schema()}))
    bad_file = tmp_path / "bad.json"
    bad_file.write_text(json.dumps({"type": "JSON", "schema": Named.schema()}))
    cmd = shlex.join([*pigeon_command(), "admin", "--url", admin_standalone.url, "schemas"])
    script = " && ".join(
        [
            f"{cmd} upload cli-topic --filename {schema_file}",
            f"{cmd} get cli-topic --version 0 --json",
            f"{cmd} compatibility cli-topic --filename {schema_file}",
            f"{{ {cmd} compatibility cli-topic --filename {bad_file} && exit 9 || true; }}",
            f"{cmd} delete cli-topic",
            f"{{ {cmd} get cli-topic && exit 9 || true; }}",
        ]
    )
    result = subprocess.run(
        ["bash", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, (result.stdout, result.stderr)
    out = result.stdout
    assert "schema of cli-topic is version 0" in out
    assert '"type": "AVRO"' in out and "compatible under FULL" in out
    assert "not compatible under FULL: schema is not compatible with version 0" in out
    assert "schema of cli-topic deleted" in out
    assert "SchemaNotFound" in result.stderr and "Traceback" not in result.stderr


def test_rest_refuses_malformed_definitions_with_one_line(
    admin_standalone: AdminStandalone,
) -> None:
    admin = AdminClient(admin_standalone.url)
    topic = "persistent://public/default/rest-malformed"
    deep = '{"type": "array", "items": ' * 5000 + '"int"' + "}" * 5000
    for definition in (
        json.dumps({"type": "record", "name": "R", "aliases": 5, "fields": []}),
        '{"type": "record", "name": "Z", "fields": [{"name": "x", "type": ' + deep + "}]}",
    ):
        for call in (admin.upload_schema, admin.schema_compatibility):
            try:
                call(topic, {"type": "AVRO", "schema": definition})
                raise AssertionError("a malformed schema was accepted")
            except AdminError as exc:
                assert exc.status == 400 and exc.body["error"] == "InvalidSchemaData", exc.body
                assert "\n" not in exc.body["message"]

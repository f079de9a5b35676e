"""``pigeon admin schemas``: a topic's schema registry, as ``pulsar-admin schemas``.

A schema file is Pulsar's: ``{"type": "AVRO", "schema": "<Avro record schema as JSON
text>", "properties": {}}``; ``schema`` may also be the Avro schema as a JSON object.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from pigeon.client import _admin_base as cli
from pigeon.client._admin_client import AdminClient

__all__ = ["schemas_cmd"]

schemas_cmd = cli.group("schemas", "A topic's schema versions: get, upload, delete, check.")


def _read_schema_file(filename: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(filename).read_text())
    except OSError as exc:
        raise click.BadParameter(f"cannot read {filename}: {exc.strerror}") from None
    except ValueError as exc:
        raise click.BadParameter(f"{filename} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or "type" not in doc:
        raise click.BadParameter(f'{filename} must hold {{"type": ..., "schema": ...}}')
    schema = doc.get("schema", "")
    if not isinstance(schema, str):
        schema = json.dumps(schema)
    out = {"type": str(doc["type"]).upper(), "schema": schema}
    if isinstance(doc.get("properties"), dict):
        out["properties"] = doc["properties"]
    return out


def _human(result: dict[str, Any]) -> str:
    return f"version {result['version']}  type {result['type']}\n{result['schema']}"


@schemas_cmd.command("get")
@click.argument("topic")
@click.option("--version", type=int, default=None, help="This version (default: the latest).")
@click.option("--all-versions", is_flag=True, help="Every stored version.")
@cli.json_flag
def schemas_get(topic: str, version: int | None, all_versions: bool) -> None:
    """Show TOPIC's schema."""
    client = cli.settings().client()
    if all_versions:
        cli.emit(client.schema_versions(topic), lambda rs: "\n".join(_human(r) for r in rs))
    else:
        cli.emit(client.schema(topic, version), _human)


@schemas_cmd.command("upload")
@click.argument("topic")
@click.option("--filename", "-f", required=True, help="Schema file (Pulsar's JSON form).")
@cli.json_flag
def schemas_upload(topic: str, filename: str) -> None:
    """Add a version to TOPIC's schema (checked for compatibility)."""
    result = cli.settings().client().upload_schema(topic, _read_schema_file(filename))
    cli.done(f"schema of {topic} is version {result['version']}", result)


cli.change(
    schemas_cmd,
    "delete",
    "Delete every version of TOPIC's schema.",
    AdminClient.delete_schema,
    "topic",
    confirm="schema of {topic} deleted",
)


@schemas_cmd.command("compatibility")
@click.argument("topic")
@click.option("--filename", "-f", required=True, help="Schema file (Pulsar's JSON form).")
@cli.json_flag
@click.pass_context
def schemas_compatibility(ctx: click.Context, topic: str, filename: str) -> None:
    """Would the schema in FILENAME be accepted by TOPIC? (exit code 1 if not)"""
    result = cli.settings().client().schema_compatibility(topic, _read_schema_file(filename))

    def human(r: dict[str, Any]) -> str:
        strategy = r["schemaCompatibilityStrategy"]
        if r["compatibility"]:
            return f"compatible under {strategy}"
        return f"not compatible under {strategy}: {r['reason']}"

    cli.emit(result, human)
    if not result["compatibility"]:
        ctx.exit(1)

"""``pigeon admin`` commands on the namespace tree: health, tenants, namespaces, topics."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import click

from pigeon.client._admin_base import (
    _done,
    _emit,
    _fmt,
    _group,
    _json_flag,
    _kv,
    _settings,
    _table,
    admin_cmd,
)
from pigeon.client._admin_client import (
    AdminError,
)


@admin_cmd.command("health")
@_json_flag
@click.pass_context
def health_cmd(ctx: click.Context) -> None:
    """Cluster health (exit code 1 when unhealthy)."""
    client = _settings().client()
    try:
        health = client.health()
        failed = False
    except AdminError as exc:
        if exc.status != 503 or "checks" not in exc.body:
            raise
        health, failed = exc.body, True

    def human(h: dict[str, Any]) -> str:
        lines = [
            f"status   {h['status']}",
            f"cluster  {h['cluster']}",
            f"topics   {h['topics']}",
            f"clients  {h['connections']}",
        ]
        for name, check in h["checks"].items():
            detail = {k: v for k, v in check.items() if k != "ok"}
            lines.append(f"{name:<8} {'ok' if check['ok'] else 'FAILED'}  {_fmt(detail)}")
        return "\n".join(lines)

    _emit(health, human)
    if failed:
        ctx.exit(1)


# -- tenants


@_group("tenants", "Create, list and delete tenants.")
def tenants_cmd() -> None:
    pass


@tenants_cmd.command("list")
@_json_flag
def tenants_list() -> None:
    """List tenants."""
    _emit(_settings().client().tenants())


@tenants_cmd.command("get")
@click.argument("tenant")
@_json_flag
def tenants_get(tenant: str) -> None:
    """Show a tenant."""
    _emit(_settings().client().tenant(tenant))


@tenants_cmd.command("create")
@click.argument("tenant")
@click.option("--admin-role", "admin_roles", multiple=True, help="Admin role (repeatable).")
@click.option("--allowed-cluster", "allowed_clusters", multiple=True, help="Cluster (repeatable).")
@_json_flag
def tenants_create(
    tenant: str, admin_roles: tuple[str, ...], allowed_clusters: tuple[str, ...]
) -> None:
    """Create TENANT."""
    result = (
        _settings()
        .client()
        .create_tenant(tenant, admin_roles=admin_roles, allowed_clusters=allowed_clusters)
    )
    _done(f"tenant {tenant} created", result)


@tenants_cmd.command("delete")
@click.argument("tenant")
@_json_flag
def tenants_delete(tenant: str) -> None:
    """Delete a tenant that has no namespaces."""
    _settings().client().delete_tenant(tenant)
    _done(f"tenant {tenant} deleted")


# -- namespaces


def _policy_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _policy_pairs(pairs: Iterable[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not name=value", param_hint="POLICY")
        out[key.strip()] = _policy_value(value.strip())
    return out


@_group("namespaces", "Namespaces, their policies and bundles.")
def namespaces_cmd() -> None:
    pass


@namespaces_cmd.command("list")
@click.argument("tenant")
@_json_flag
def namespaces_list(tenant: str) -> None:
    """List the namespaces of TENANT."""
    _emit(_settings().client().namespaces(tenant))


@namespaces_cmd.command("create")
@click.argument("namespace")
@click.option(
    "--policy",
    "-p",
    "policies",
    multiple=True,
    metavar="NAME=VALUE",
    help="Initial policy (repeatable), e.g. -p message_ttl_s=3600.",
)
@_json_flag
def namespaces_create(namespace: str, policies: tuple[str, ...]) -> None:
    """Create NAMESPACE (tenant/namespace)."""
    result = _settings().client().create_namespace(namespace, _policy_pairs(policies))
    _done(f"namespace {namespace} created", result)


@namespaces_cmd.command("delete")
@click.argument("namespace")
@click.option("--force", is_flag=True, help="Delete its topics (and their data) too.")
@_json_flag
def namespaces_delete(namespace: str, force: bool) -> None:
    """Delete NAMESPACE (refused while it has topics, unless --force)."""
    _settings().client().delete_namespace(namespace, force=force)
    _done(f"namespace {namespace} deleted")


@namespaces_cmd.command("policies")
@click.argument("namespace")
@_json_flag
def namespaces_policies(namespace: str) -> None:
    """Show the policies of NAMESPACE."""
    _emit(_settings().client().policies(namespace))


@namespaces_cmd.command("set-policies")
@click.argument("namespace")
@click.argument("policies", nargs=-1, required=True, metavar="NAME=VALUE...")
@_json_flag
def namespaces_set_policies(namespace: str, policies: tuple[str, ...]) -> None:
    """Change policies, e.g. ``message_ttl_s=3600 backlog_quota_bytes=1000000``.

    Values are JSON (numbers, true/false, null for the broker default) or plain text.
    """
    result = _settings().client().set_policies(namespace, _policy_pairs(policies))
    _emit(result)


@namespaces_cmd.command("topics")
@click.argument("namespace", default="public/default")
@_json_flag
def namespaces_topics(namespace: str) -> None:
    """Topics of NAMESPACE (default public/default)."""
    _emit(_settings().client().topics(namespace))


@namespaces_cmd.command("bundles")
@click.argument("namespace")
@_json_flag
def namespaces_bundles(namespace: str) -> None:
    """Bundles of NAMESPACE and their owners."""
    _emit(
        _settings().client().bundles(namespace),
        lambda rows: _table(rows, ["namespace", "bundle", "owner", "loaded_topics"]),
    )


@namespaces_cmd.command("unload")
@click.argument("namespace")
@click.option("--bundle", help="0xSTART_0xEND (default: every bundle the broker owns).")
@_json_flag
def namespaces_unload(namespace: str, bundle: str | None) -> None:
    """Unload bundles: their topics close here, the broker gives the bundles up, and clients
    look the topics up again."""
    client = _settings().client()
    if bundle:
        chosen = [bundle]
    else:
        me = client.this_broker()
        chosen = [b["bundle"] for b in client.bundles(namespace) if b["owner"] == me]
    unloaded: list[str] = []
    for b in chosen:
        unloaded += client.unload_bundle(namespace, b)
    _done(
        f"unloaded {len(chosen)} bundle(s), {len(unloaded)} topic(s) of {namespace}",
        {"bundles": chosen, "unloaded": unloaded},
    )


# -- topics


def _rate(doc: dict[str, Any], key: str) -> str:
    return f"{doc.get(key, 0.0):,.1f}"


def _stats_text(s: dict[str, Any]) -> str:
    lines = [
        f"topic          {s['topic']}",
        f"partitions     {s['partitions']}",
        f"rate in        {_rate(s, 'msg_rate_in')} msg/s  {_rate(s, 'msg_throughput_in')} B/s",
        f"rate out       {_rate(s, 'msg_rate_out')} msg/s  {_rate(s, 'msg_throughput_out')} B/s",
        f"messages in    {s['msgs_in']}  ({s['bytes_in']} bytes)",
        f"messages out   {s['msgs_out']}  ({s['bytes_out']} bytes)",
        f"producers      {s['producers']}",
        f"storage        {s['storage_size']} bytes in {s['segments']} segment(s)",
        f"backlog        {s['backlog']} messages, {s['backlog_bytes']} bytes",
    ]
    subs = list(s["subscriptions"].values())
    if subs:
        lines.append("")
        lines.append(
            _table(
                subs,
                [
                    "name",
                    "type",
                    "consumers",
                    "backlog",
                    "backlog_bytes",
                    "msg_rate_out",
                    "msgs_out",
                    "mark_delete_offset",
                ],
            )
        )
    return "\n".join(lines)


@_group("topics", "Create, inspect and delete topics.")
def topics_cmd() -> None:
    pass


@topics_cmd.command("list")
@click.argument("namespace", default="public/default")
@_json_flag
def topics_list(namespace: str) -> None:
    """Topics of NAMESPACE (default public/default)."""
    _emit(_settings().client().topics(namespace))


@topics_cmd.command("create")
@click.argument("topic")
@click.option(
    "--partitions",
    "-p",
    default=0,
    show_default=True,
    type=click.IntRange(0, 4096),
    help="Create a partitioned topic with N partitions.",
)
@_json_flag
def topics_create(topic: str, partitions: int) -> None:
    """Create TOPIC (partitioned with --partitions)."""
    result = _settings().client().create_topic(topic, partitions)
    extra = f" with {partitions} partitions" if partitions else ""
    _done(f"topic {result['topic']} created{extra}", result)


@topics_cmd.command("get")
@click.argument("topic")
@_json_flag
def topics_get(topic: str) -> None:
    """Whether TOPIC exists, is partitioned, is loaded here."""
    _emit(_settings().client().topic(topic))


@topics_cmd.command("delete")
@click.argument("topic")
@click.option("--force", is_flag=True, help="Detach connected producers and consumers first.")
@_json_flag
def topics_delete(topic: str, force: bool) -> None:
    """Delete TOPIC and all its stored messages."""
    _settings().client().delete_topic(topic, force=force)
    _done(f"topic {topic} deleted")


@topics_cmd.command("stats")
@click.argument("topic")
@_json_flag
def topics_stats(topic: str) -> None:
    """Rates, counters, storage and backlog per subscription."""
    _emit(_settings().client().topic_stats(topic), _stats_text)


@topics_cmd.command("internal-stats")
@click.argument("topic")
@_json_flag
def topics_internal_stats(topic: str) -> None:
    """Segments of the managed ledger and the cursors (one topic or partition)."""

    def human(s: dict[str, Any]) -> str:
        parts = [
            _kv(s, skip=("segments", "cursors")),
            "",
            _table(s["segments"], ["id", "first_offset", "entries", "size", "state", "ensemble"]),
        ]
        if s["cursors"]:
            rows = [{"subscription": k, **v} for k, v in s["cursors"].items()]
            parts += [
                "",
                _table(
                    rows,
                    [
                        "subscription",
                        "mark_delete_offset",
                        "acked_ranges",
                        "read_position",
                        "pending_entries",
                    ],
                ),
            ]
        return "\n".join(parts)

    _emit(_settings().client().internal_stats(topic), human)


@topics_cmd.command("unload")
@click.argument("topic")
@_json_flag
def topics_unload(topic: str) -> None:
    """Close TOPIC on its broker; clients re-attach and it loads again."""
    unloaded = _settings().client().unload_topic(topic)
    _done(f"unloaded {len(unloaded)} topic(s)", {"unloaded": unloaded})


@topics_cmd.command("loaded")
@_json_flag
def topics_loaded() -> None:
    """Topics loaded on the broker, with rates and backlog."""
    _emit(
        _settings().client().loaded_topics(),
        lambda rows: _table(
            rows,
            [
                "topic",
                "producers",
                "subscription_count",
                "msg_rate_in",
                "msg_rate_out",
                "msgs_in",
                "backlog",
                "storage_size",
            ],
        ),
    )


# -- subscriptions

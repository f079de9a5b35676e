"""``pigeon admin`` commands on the namespace tree: health, tenants, namespaces, topics."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import click

from pigeon.client import _admin_base as cli
from pigeon.client import _units as units
from pigeon.client._admin_client import ACTIONS, AdminClient, AdminError, check_actions
from pigeon.core import TopicName


@cli.admin_cmd.command("health")
@cli.json_flag
@click.pass_context
def health_cmd(ctx: click.Context) -> None:
    """Cluster health (exit code 1 when unhealthy)."""
    client = cli.settings().client()
    try:
        health = client.health()
        failed = False
    except AdminError as exc:
        if exc.status != 503 or "checks" not in exc.body:
            raise
        health, failed = exc.body, True

    def human(h: dict[str, Any]) -> str:
        status = {k: h[k] for k in ("status", "cluster", "topics")}
        lines = [cli.kv({**status, "clients": h["connections"]})]
        for name, check in h["checks"].items():
            detail = {k: v for k, v in check.items() if k != "ok"}
            state = "ok" if check["ok"] else "FAILED"
            lines.append(f"{name:<8} {state:<6}  {cli.fmt(detail)}".rstrip(" -"))
        return "\n".join(lines)

    cli.emit(health, human)
    if failed:
        ctx.exit(1)


# -- tenants


tenants_cmd = cli.group("tenants", "Create, list and delete tenants.")
cli.show(tenants_cmd, "list", "List tenants.", AdminClient.tenants)
cli.show(tenants_cmd, "get", "Show a tenant.", AdminClient.tenant, "tenant")


@tenants_cmd.command("create")
@click.argument("tenant")
@click.option("--admin-role", "admin_roles", multiple=True, help="Admin role (repeatable).")
@click.option("--allowed-cluster", "allowed_clusters", multiple=True, help="Cluster (repeatable).")
@cli.json_flag
def tenants_create(
    tenant: str, admin_roles: tuple[str, ...], allowed_clusters: tuple[str, ...]
) -> None:
    """Create TENANT."""
    result = (
        cli.settings()
        .client()
        .create_tenant(tenant, admin_roles=admin_roles, allowed_clusters=allowed_clusters)
    )
    cli.done(f"tenant {tenant} created", result)


@tenants_cmd.command("update")
@click.argument("tenant")
@click.option("--admin-role", "admin_roles", multiple=True, help="Admin role (repeatable).")
@click.option("--allowed-cluster", "allowed_clusters", multiple=True, help="Cluster (repeatable).")
@cli.json_flag
def tenants_update(
    tenant: str, admin_roles: tuple[str, ...], allowed_clusters: tuple[str, ...]
) -> None:
    """Replace TENANT's admin roles and allowed clusters (what is not given is emptied)."""
    result = (
        cli.settings()
        .client()
        .update_tenant(tenant, admin_roles=admin_roles, allowed_clusters=allowed_clusters)
    )
    cli.done(f"tenant {tenant} updated", result)


cli.delete(
    tenants_cmd, "Delete a tenant that has no namespaces.", AdminClient.delete_tenant, "tenant"
)


# -- namespaces

_TOPICS_HELP = "Topics of NAMESPACE (default public/default)."


def _namespace_or_default() -> click.Argument:
    return click.Argument(["namespace"], default="public/default")


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


namespaces_cmd = cli.group("namespaces", "Namespaces, their policies and bundles.")
cli.show(namespaces_cmd, "list", "List the namespaces of TENANT.", AdminClient.namespaces, "tenant")
cli.show(
    namespaces_cmd, "policies", "Show the policies of NAMESPACE.", AdminClient.policies, "namespace"
)
cli.show(namespaces_cmd, "topics", _TOPICS_HELP, AdminClient.topics, _namespace_or_default())
cli.show(
    namespaces_cmd,
    "bundles",
    "Bundles of NAMESPACE and their owners.",
    AdminClient.bundles,
    "namespace",
    human=cli.table_of(cli.BUNDLE_COLUMNS),
)


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
@cli.json_flag
def namespaces_create(namespace: str, policies: tuple[str, ...]) -> None:
    """Create NAMESPACE (tenant/namespace)."""
    result = cli.settings().client().create_namespace(namespace, _policy_pairs(policies))
    cli.done(f"namespace {namespace} created", result)


cli.delete(
    namespaces_cmd,
    "Delete NAMESPACE (refused while it has topics, unless --force).",
    AdminClient.delete_namespace,
    "namespace",
    force="Delete its topics (and their data) too.",
)


@namespaces_cmd.command("set-policies")
@click.argument("namespace")
@click.argument("policies", nargs=-1, required=True, metavar="NAME=VALUE...")
@cli.json_flag
def namespaces_set_policies(namespace: str, policies: tuple[str, ...]) -> None:
    """Change policies, e.g. ``message_ttl_s=3600 backlog_quota_bytes=1000000``.

    Values are JSON (numbers, true/false, null for the broker default) or plain text.
    """
    result = cli.settings().client().set_policies(namespace, _policy_pairs(policies))
    cli.emit(result)


@namespaces_cmd.command("unload")
@click.argument("namespace")
@click.option("--bundle", help="0xSTART_0xEND (default: every bundle the broker owns).")
@cli.json_flag
def namespaces_unload(namespace: str, bundle: str | None) -> None:
    """Unload bundles: their topics close here, the broker gives the bundles up, and clients
    look the topics up again."""
    client = cli.settings().client()
    if bundle:
        chosen = [bundle]
    else:
        me = client.this_broker()
        chosen = [b["bundle"] for b in client.bundles(namespace) if b["owner"] == me]
    unloaded: list[str] = []
    for b in chosen:
        unloaded += client.unload_bundle(namespace, b)
    cli.done(
        f"unloaded {units.plural(len(chosen), 'bundle')},"
        f" {units.plural(len(unloaded), 'topic')} of {namespace}",
        {"bundles": chosen, "unloaded": unloaded},
    )


# -- topics

_SEGMENT_COLUMNS = ["id", "first_offset", "entries", "size", "state", "ensemble"]


def _rates(doc: dict[str, Any], way: str) -> str:
    """``msg_rate_<way>`` and ``msg_throughput_<way>`` of a stats document."""
    rate, throughput = (doc.get(f"{k}_{way}", 0.0) for k in ("msg_rate", "msg_throughput"))
    return f"{units.number(rate)} msg/s  {units.rate(throughput)}"


def partitions_text(topic: str, partitions: int) -> str:
    """What ``partitions`` (the count the admin API gives) says of ``topic``: ``3``, or
    ``not partitioned`` (0), or which partition it is (0 too)."""
    if partitions:
        return str(partitions)
    name = TopicName.parse(topic)
    if name.partition_index >= 0:
        return f"none (partition {name.partition_index} of {name.base.full})"
    return "not partitioned"


def _topic_text(doc: dict[str, Any]) -> str:
    """``topics get``: its fields, ``partitions`` in words."""
    if "partitions" in doc and "topic" in doc:
        doc = {**doc, "partitions": partitions_text(doc["topic"], doc["partitions"])}
    return cli.kv(doc)


def _stats_text(s: dict[str, Any]) -> str:
    lines = [
        cli.kv(
            {
                "topic": s["topic"],
                "partitions": partitions_text(s["topic"], s["partitions"]),
                "rate in": _rates(s, "in"),
                "rate out": _rates(s, "out"),
                "messages in": f"{units.plural(s['msgs_in'], 'message')}"
                f"  ({units.size(s['bytes_in'])})",
                "messages out": f"{units.plural(s['msgs_out'], 'message')}"
                f"  ({units.size(s['bytes_out'])})",
                "producers": s["producers"],
                "storage": f"{units.size(s['storage_size'])}"
                f" in {units.plural(s['segments'], 'segment')}",
                "backlog": f"{units.plural(s['backlog'], 'message')},"
                f" {units.size(s['backlog_bytes'])}",
            },
            width=13,
        )
    ]
    subs = list(s["subscriptions"].values())
    if subs:
        lines.append("")
        lines.append(
            cli.table(
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


topics_cmd = cli.group("topics", "Create, inspect and delete topics.")
cli.show(topics_cmd, "list", _TOPICS_HELP, AdminClient.topics, _namespace_or_default())
cli.show(
    topics_cmd,
    "get",
    "Whether TOPIC exists, is partitioned, is loaded here.",
    AdminClient.topic,
    "topic",
    human=_topic_text,
)
cli.show(
    topics_cmd,
    "stats",
    "Rates, counters, storage and backlog per subscription.",
    AdminClient.topic_stats,
    "topic",
    human=_stats_text,
)
cli.show(
    topics_cmd,
    "loaded",
    "Topics loaded on the broker, with rates and backlog.",
    AdminClient.loaded_topics,
    human=cli.table_of(
        [
            "topic",
            "producers",
            "subscription_count",
            "msg_rate_in",
            "msg_rate_out",
            "msgs_in",
            "backlog",
            "storage_size",
        ]
    ),
)


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
@cli.json_flag
def topics_create(topic: str, partitions: int) -> None:
    """Create TOPIC (partitioned with --partitions)."""
    result = cli.settings().client().create_topic(topic, partitions)
    extra = f" with {partitions} partitions" if partitions else ""
    cli.done(f"topic {result['topic']} created{extra}", result)


cli.delete(
    topics_cmd,
    "Delete TOPIC and all its stored messages.",
    AdminClient.delete_topic,
    "topic",
    force="Detach connected producers and consumers first.",
)


def _size(text: str) -> int:
    """``10M``, ``1G``, ``4096`` -> bytes (pulsar-admin's size arguments)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B")
    try:
        value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size (4096, 10M, 1G)") from None
    if value < 0:
        raise click.BadParameter(f"{text!r}: a size is >= 0")
    return value


@topics_cmd.command("offload")
@click.argument("topic")
@click.option(
    "--size-threshold",
    "-s",
    default="0",
    show_default=True,
    help="Bytes to keep only on bookies (10M, 1G); the oldest closed segments beyond go.",
)
@cli.json_flag
def topics_offload(topic: str, size_threshold: str) -> None:
    """Offload TOPIC's oldest closed segments to the broker's offloader (tiered storage)."""
    result = cli.settings().client().offload(topic, _size(size_threshold))
    cli.done(f"offload of {topic}: {result['status']}", result)


@topics_cmd.command("offload-status")
@click.argument("topic")
@cli.json_flag
def topics_offload_status(topic: str) -> None:
    """How TOPIC's last offload went and where its segments live."""
    result = cli.settings().client().offload_status(topic)
    cli.emit(result, _offload_status_text)


def _offload_status_text(status: dict[str, Any]) -> str:
    """The status as ``key  value`` lines, then one line per damaged segment (not
    offloaded: an entry of it is on no replica intact)."""
    lines = [cli.kv(status, skip=["damaged_segments"])]
    for d in status.get("damaged_segments") or []:
        lines.append(
            f"damaged segment {d['segment']} (entry {d['entry']}): {d['error']}"
            f" [attempts {d['attempts']}, retried in {units.duration(d['retry_in_s'])}]"
        )
    return "\n".join(lines)


cli.change(
    topics_cmd,
    "compact",
    "Compact TOPIC: keep the latest message of every key (read with read_compacted).",
    AdminClient.compact,
    "topic",
    confirm="compaction of {topic}: {status}",
)
cli.show(
    topics_cmd,
    "compaction-status",
    "How TOPIC's last compaction went, its compacted ledger and horizon.",
    AdminClient.compaction_status,
    "topic",
    human=cli.kv,
)


def _byte_threshold(
    name: str, policy: str, option: tuple[str, str], option_help: str, help_text: str, *, off: int
) -> None:
    """Add ``namespaces NAME NAMESPACE --OPTION SIZE``: it sets the namespace's ``policy``
    to SIZE in bytes (10M, 1G; ``off`` as is: the threshold is off)."""

    @namespaces_cmd.command(name, help=help_text)
    @click.argument("namespace")
    @click.option(*option, "size", required=True, help=option_help)
    @cli.json_flag
    def set_threshold(namespace: str, size: str) -> None:
        value = off if size.strip() == str(off) else _size(size)
        result = cli.settings().client().set_policies(namespace, {policy: value})
        what = name.removeprefix("set-").replace("-", " ")
        cli.done(f"{what} of {namespace} is {value} bytes", result)


_byte_threshold(
    "set-compaction-threshold",
    "compaction_threshold",
    ("--threshold", "-t"),
    "Bytes since the last compaction (10M, 1G); 0: off.",
    "Compact a topic once more than THRESHOLD bytes were stored since its last compaction.",
    off=0,
)
_byte_threshold(
    "set-offload-threshold",
    "offload_threshold_bytes",
    ("--size", "-s"),
    "Bytes on bookies before offloading (10M, 1G); -1: off.",
    "Offload a topic's oldest closed segments once more than SIZE is only on bookies.",
    off=-1,
)


@namespaces_cmd.command("set-offload-deletion-lag")
@click.argument("namespace")
@click.option(
    "--lag", "-l", required=True, type=float, help="Seconds before bookie copies are deleted."
)
@cli.json_flag
def namespaces_offload_deletion_lag(namespace: str, lag: float) -> None:
    """Delete the bookie copies of offloaded segments LAG seconds after their offload."""
    if lag < 0:
        raise click.BadParameter("the lag is >= 0 seconds", param_hint="--lag")
    result = cli.settings().client().set_policies(namespace, {"offload_deletion_lag_s": lag})
    cli.done(f"offload deletion lag of {namespace} is {lag:g} s", result)


@topics_cmd.command("internal-stats")
@click.argument("topic")
@cli.json_flag
def topics_internal_stats(topic: str) -> None:
    """Segments of the managed ledger and the cursors (one topic or partition)."""

    def human(s: dict[str, Any]) -> str:
        parts = [
            cli.kv(s, skip=("segments", "cursors")),
            "",
            cli.table(
                s["segments"], ["id", "first_offset", "entries", "size", "state", "ensemble"]
            ),
        ]
        if s["cursors"]:
            rows = [{"subscription": k, **v} for k, v in s["cursors"].items()]
            parts += [
                "",
                cli.table(
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

    cli.emit(cli.settings().client().internal_stats(topic), human)


@topics_cmd.command("unload")
@click.argument("topic")
@cli.json_flag
def topics_unload(topic: str) -> None:
    """Close TOPIC on its broker; clients re-attach and it loads again."""
    unloaded = cli.settings().client().unload_topic(topic)
    cli.done(f"unloaded {units.plural(len(unloaded), 'topic')}", {"unloaded": unloaded})


# -- permissions (namespaces and topics)


def _actions(_ctx: click.Context, _param: click.Parameter, value: str) -> list[str]:
    try:
        return check_actions(value.split(","))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _permissions_text(grants: dict[str, list[str]]) -> str:
    rows = [{"role": r, "actions": ",".join(a)} for r, a in sorted(grants.items())]
    return cli.table(rows, ["role", "actions"]) if rows else "no permissions"


_ROLE = click.option("--role", required=True, help="The role (a token's subject).")
_ACTIONS = click.option(
    "--actions",
    required=True,
    callback=_actions,
    metavar="A,B",
    help=f"Comma-separated: {', '.join(ACTIONS)}.",
)


def _permission_commands(
    group: click.Group,
    target: str,
    show: Callable[[AdminClient, str], dict[str, list[str]]],
    grant: Callable[[AdminClient, str, str, list[str]], None],
    revoke: Callable[[AdminClient, str, str], None],
    helps: tuple[str, str, str],
) -> None:
    """Add ``group permissions TARGET``, ``group grant-permission TARGET --role R
    --actions A,B`` and ``group revoke-permission TARGET --role R`` (``helps``: theirs)."""
    show_help, grant_help, revoke_help = helps
    cli.show(group, "permissions", show_help, show, target, human=_permissions_text)

    @group.command("grant-permission", help=grant_help)
    @click.argument("name", metavar=target.upper())
    @_ROLE
    @_ACTIONS
    @cli.json_flag
    def grant_command(name: str, role: str, actions: list[str]) -> None:
        grant(cli.settings().client(), name, role, actions)
        cli.done(
            f"granted {','.join(actions)} on {name} to {role}",
            {target: name, "role": role, "actions": actions},
        )

    @group.command("revoke-permission", help=revoke_help)
    @click.argument("name", metavar=target.upper())
    @_ROLE
    @cli.json_flag
    def revoke_command(name: str, role: str) -> None:
        revoke(cli.settings().client(), name, role)
        cli.done(f"revoked the permissions of {role} on {name}")


_permission_commands(
    namespaces_cmd,
    "namespace",
    AdminClient.permissions,
    AdminClient.grant_permission,
    AdminClient.revoke_permission,
    (
        "Roles and their actions on NAMESPACE.",
        "Give ROLE these actions on every topic of NAMESPACE (replacing what it had).",
        "Take ROLE's permissions on NAMESPACE away.",
    ),
)
_permission_commands(
    topics_cmd,
    "topic",
    AdminClient.topic_permissions,
    AdminClient.grant_topic_permission,
    AdminClient.revoke_topic_permission,
    (
        "Roles and their actions on TOPIC (its own grants and its namespace's).",
        "Give ROLE these actions on TOPIC (and its partitions).",
        "Take ROLE's own permissions on TOPIC away (its namespace's grants stay).",
    ),
)


@namespaces_cmd.command("set-subscription-auth-mode")
@click.argument("namespace")
@click.argument("mode", type=click.Choice(["none", "prefix"], case_sensitive=False))
@cli.json_flag
def namespaces_subscription_auth_mode(namespace: str, mode: str) -> None:
    """prefix: a role may only use subscriptions whose names start with the role's name."""
    cli.settings().client().set_subscription_auth_mode(namespace, mode)
    cli.done(f"subscription auth mode of {namespace} is {mode.lower()}")


# -- subscriptions

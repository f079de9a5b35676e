"""``pigeon admin``: the broker's admin REST API from the command line.

    pigeon admin health
    pigeon admin topics stats events --json
    pigeon admin subscriptions reset events sub-1 --time 10m

Every command prints a table or plain text, or the API's JSON with ``--json`` (before or
after the subcommand).  ``--url`` (default ``http://127.0.0.1:8080``, environment
``PIGEON_ADMIN_URL``) names the broker's HTTP port.  Exit codes: 0 success; 1 the API
refused (not found, conflict, bad value, unavailable — its JSON error is printed on
stderr) or the broker could not be reached; 2 a usage error.

:class:`AdminClient` is the small HTTP client underneath (standard library only); it
raises :class:`AdminError` carrying the HTTP status and the API's JSON error.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from pigeon.core import TopicName
from pigeon.core.errors import InvalidTopicName

__all__ = ["DEFAULT_URL", "AdminClient", "AdminError", "InvalidNamespace", "admin_cmd", "main"]

DEFAULT_URL = "http://127.0.0.1:8080"
API = "/admin/v2"
F = TypeVar("F", bound=Callable[..., Any])


class AdminError(Exception):
    """The admin API answered with an error status (or could not be reached: status 0)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.body = body
        super().__init__(f"{status} {body.get('error', 'Error')}: {body.get('message', '')}")


def _q(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def topic_path(topic: str) -> str:
    """``/admin/v2/topics/<domain>/<tenant>/<namespace>/<topic>`` for any topic spelling."""
    t = TopicName.parse(topic)
    return f"{API}/topics/{t.domain}/{_q(t.tenant)}/{_q(t.namespace)}/{_q(t.local)}"


class InvalidNamespace(ValueError):
    """A namespace argument that is not ``tenant/namespace``."""


def namespace_path(namespace: str) -> str:
    tenant, sep, ns = namespace.partition("/")
    if not sep or not tenant or not ns or "/" in ns:
        raise InvalidNamespace(f"namespace must look like tenant/namespace, got {namespace!r}")
    return f"{API}/namespaces/{_q(tenant)}/{_q(ns)}"


class AdminClient:
    """Blocking client of one broker's admin API."""

    def __init__(self, url: str = DEFAULT_URL, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
    ) -> Any:
        """Call the API; the decoded JSON (text for non-JSON answers, None for 204)."""
        url = self.url + path
        query = {k: _param(v) for k, v in (params or {}).items() if v is not None}
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return _decode(resp.status, resp.headers.get("Content-Type", ""), resp.read())
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                err = json.loads(raw)
            except ValueError:
                err = {"error": exc.reason or "HTTPError", "message": raw.decode(errors="replace")}
            if not isinstance(err, dict):
                err = {"error": "HTTPError", "message": str(err)}
            raise AdminError(exc.code, err) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AdminError(
                0, {"error": "ConnectionError", "message": f"cannot reach {self.url}: {reason}"}
            ) from None

    # -- cluster, tenants, namespaces ------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self.request("GET", f"{API}/cluster/health")  # type: ignore[no-any-return]

    def tenants(self) -> list[str]:
        return self.request("GET", f"{API}/tenants")  # type: ignore[no-any-return]

    def tenant(self, tenant: str) -> dict[str, Any]:
        return self.request("GET", f"{API}/tenants/{_q(tenant)}")  # type: ignore[no-any-return]

    def create_tenant(
        self, tenant: str, *, admin_roles: Sequence[str] = (), allowed_clusters: Sequence[str] = ()
    ) -> dict[str, Any]:
        body = {"admin_roles": list(admin_roles), "allowed_clusters": list(allowed_clusters)}
        return self.request("PUT", f"{API}/tenants/{_q(tenant)}", body=body)  # type: ignore[no-any-return]

    def delete_tenant(self, tenant: str) -> None:
        self.request("DELETE", f"{API}/tenants/{_q(tenant)}")

    def namespaces(self, tenant: str) -> list[str]:
        return self.request("GET", f"{API}/namespaces/{_q(tenant)}")  # type: ignore[no-any-return]

    def create_namespace(
        self, namespace: str, policies: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self.request("PUT", namespace_path(namespace), body=policies or {})  # type: ignore[no-any-return]

    def delete_namespace(self, namespace: str, *, force: bool = False) -> None:
        self.request("DELETE", namespace_path(namespace), params={"force": force})

    def policies(self, namespace: str) -> dict[str, Any]:
        return self.request("GET", namespace_path(namespace) + "/policies")  # type: ignore[no-any-return]

    def set_policies(self, namespace: str, changes: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", namespace_path(namespace) + "/policies", body=changes)  # type: ignore[no-any-return]

    def topics(self, namespace: str) -> list[str]:
        return self.request("GET", namespace_path(namespace) + "/topics")  # type: ignore[no-any-return]

    def bundles(self, namespace: str) -> list[dict[str, Any]]:
        return self.request("GET", namespace_path(namespace) + "/bundles")  # type: ignore[no-any-return]

    def unload_bundle(self, namespace: str, bundle: str) -> list[str]:
        path = namespace_path(namespace) + f"/bundles/{_q(bundle)}/unload"
        return self.request("POST", path)["unloaded"]  # type: ignore[no-any-return]

    # -- topics ----------------------------------------------------------------------

    def create_topic(self, topic: str, partitions: int = 0) -> dict[str, Any]:
        return self.request("PUT", topic_path(topic), params={"partitions": partitions})  # type: ignore[no-any-return]

    def topic(self, topic: str) -> dict[str, Any]:
        return self.request("GET", topic_path(topic))  # type: ignore[no-any-return]

    def delete_topic(self, topic: str, *, force: bool = False) -> None:
        self.request("DELETE", topic_path(topic), params={"force": force})

    def topic_stats(self, topic: str) -> dict[str, Any]:
        return self.request("GET", topic_path(topic) + "/stats")  # type: ignore[no-any-return]

    def internal_stats(self, topic: str) -> dict[str, Any]:
        return self.request("GET", topic_path(topic) + "/internal-stats")  # type: ignore[no-any-return]

    def unload_topic(self, topic: str) -> list[str]:
        return self.request("POST", topic_path(topic) + "/unload")["unloaded"]  # type: ignore[no-any-return]

    def loaded_topics(self) -> list[dict[str, Any]]:
        return self.request("GET", f"{API}/broker-stats/topics")  # type: ignore[no-any-return]

    # -- subscriptions ---------------------------------------------------------------

    def _sub(self, topic: str, subscription: str) -> str:
        return topic_path(topic) + f"/subscriptions/{_q(subscription)}"

    def subscriptions(self, topic: str) -> list[str]:
        return self.request("GET", topic_path(topic) + "/subscriptions")  # type: ignore[no-any-return]

    def create_subscription(
        self, topic: str, subscription: str, position: str = "latest"
    ) -> dict[str, Any]:
        path = self._sub(topic, subscription)
        return self.request("PUT", path, params={"position": position})  # type: ignore[no-any-return]

    def subscription(self, topic: str, subscription: str) -> dict[str, Any]:
        return self.request("GET", self._sub(topic, subscription))  # type: ignore[no-any-return]

    def delete_subscription(self, topic: str, subscription: str, *, force: bool = False) -> None:
        self.request("DELETE", self._sub(topic, subscription), params={"force": force})

    def reset_cursor(
        self,
        topic: str,
        subscription: str,
        *,
        offset: int | None = None,
        message_id: str | None = None,
        timestamp: int | None = None,
    ) -> list[dict[str, Any]]:
        body = {
            k: v
            for k, v in (("offset", offset), ("message_id", message_id), ("timestamp", timestamp))
            if v is not None
        }
        return self.request("POST", self._sub(topic, subscription) + "/reset-cursor", body=body)  # type: ignore[no-any-return]

    def skip(self, topic: str, subscription: str, count: int) -> dict[str, Any]:
        path = self._sub(topic, subscription) + "/skip"
        return self.request("POST", path, body={"count": count})  # type: ignore[no-any-return]

    def clear_backlog(self, topic: str, subscription: str) -> dict[str, Any]:
        return self.request("POST", self._sub(topic, subscription) + "/clear-backlog")  # type: ignore[no-any-return]

    def peek(self, topic: str, subscription: str, count: int = 1) -> list[dict[str, Any]]:
        path = self._sub(topic, subscription) + "/peek"
        return self.request("GET", path, params={"count": count})  # type: ignore[no-any-return]

    # -- brokers, bookies, metrics ---------------------------------------------------

    def brokers(self) -> list[dict[str, Any]]:
        return self.request("GET", f"{API}/brokers")  # type: ignore[no-any-return]

    def broker_load(self, broker: str) -> dict[str, Any]:
        return self.request("GET", f"{API}/brokers/{_q(broker)}/load")  # type: ignore[no-any-return]

    def broker_bundles(self, broker: str) -> list[dict[str, Any]]:
        return self.request("GET", f"{API}/brokers/{_q(broker)}/bundles")  # type: ignore[no-any-return]

    def throughput(self) -> list[dict[str, Any]]:
        return self.request("GET", f"{API}/broker-stats/throughput")  # type: ignore[no-any-return]

    def bookies(self) -> list[dict[str, Any]]:
        return self.request("GET", f"{API}/bookies")  # type: ignore[no-any-return]

    def bookie(self, address: str) -> dict[str, Any]:
        return self.request("GET", f"{API}/bookies/{_q(address)}")  # type: ignore[no-any-return]

    def metrics(self) -> str:
        return str(self.request("GET", "/metrics"))

    def this_broker(self) -> str:
        """The id (host:port) of the broker serving this URL."""
        return str(self.brokers()[0]["broker"])


def _param(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _decode(status: int, content_type: str, raw: bytes) -> Any:
    if status == 204 or not raw:
        return None
    if content_type.startswith("application/json"):
        return json.loads(raw)
    return raw.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------- output


@dataclass
class _Settings:
    url: str
    json: bool
    timeout: float

    def client(self) -> AdminClient:
        return AdminClient(self.url, timeout=self.timeout)


def _settings() -> _Settings:
    ctx = click.get_current_context()
    settings = ctx.find_object(_Settings)
    assert settings is not None
    return settings


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        settings = ctx.find_object(_Settings)
        if settings is not None:
            settings.json = True


def _json_flag(f: F) -> F:
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        expose_value=False,
        callback=_set_json,
        help="Print the API's JSON.",
    )(f)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1e15 else repr(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _table(rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[c.upper() for c in columns]]
    cells += [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _kv(doc: dict[str, Any], skip: Iterable[str] = ()) -> str:
    keys = [k for k in doc if k not in set(skip)]
    width = max((len(k) for k in keys), default=0)
    return "\n".join(f"{k.ljust(width)}  {_fmt(doc[k])}" for k in keys)


def _emit(result: Any, human: Callable[[Any], str] | None = None) -> None:
    if _settings().json:
        click.echo(json.dumps(result, indent=2, sort_keys=False))
    elif human is not None:
        text = human(result)
        if text:
            click.echo(text)
    elif isinstance(result, list) and all(isinstance(x, str) for x in result):
        for x in result:
            click.echo(x)
    elif isinstance(result, dict):
        click.echo(_kv(result))
    elif result is not None:
        click.echo(result)


def _done(message: str, result: Any = None) -> None:
    """Confirm a change: the JSON result with --json, else a one-line message."""
    if _settings().json:
        click.echo(json.dumps(result if result is not None else {"ok": True}, indent=2))
    else:
        click.echo(message)


class _AdminGroup(click.Group):
    """Turns AdminError into exit code 1 with the JSON error on stderr."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except AdminError as exc:
            click.echo(json.dumps({"status": exc.status, **exc.body}), err=True)
            ctx.exit(1)
        except (InvalidTopicName, InvalidNamespace) as exc:
            raise click.UsageError(str(exc), ctx) from None


def _group(name: str, help_text: str) -> Callable[[F], click.Group]:
    def wrap(f: F) -> click.Group:
        return click.group(name, cls=_AdminGroup, help=help_text)(f)

    return wrap


# ---------------------------------------------------------------------- commands


@click.group("admin", cls=_AdminGroup)
@click.option(
    "--url",
    default=DEFAULT_URL,
    show_default=True,
    envvar="PIGEON_ADMIN_URL",
    help="The broker's HTTP (admin) address.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON instead of tables.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds per HTTP request.")
@click.pass_context
def admin_cmd(ctx: click.Context, url: str, as_json: bool, timeout: float) -> None:
    """Inspect and change a PigeonMQ cluster through a broker's admin API."""
    ctx.obj = _Settings(url, as_json, timeout)


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


@_group("subscriptions", "Subscriptions: create, reset, skip, peek.")
def subscriptions_cmd() -> None:
    pass


@subscriptions_cmd.command("list")
@click.argument("topic")
@_json_flag
def subscriptions_list(topic: str) -> None:
    """List the subscriptions of TOPIC."""
    _emit(_settings().client().subscriptions(topic))


@subscriptions_cmd.command("create")
@click.argument("topic")
@click.argument("subscription")
@click.option(
    "--position",
    default="latest",
    show_default=True,
    help="earliest, latest, an offset, or a message id segment:entry[:index].",
)
@_json_flag
def subscriptions_create(topic: str, subscription: str, position: str) -> None:
    """Create a durable subscription at a position."""
    result = _settings().client().create_subscription(topic, subscription, position)
    _done(
        f"subscription {subscription} created on {result['topic']} (backlog {result['backlog']})",
        result,
    )


@subscriptions_cmd.command("get")
@click.argument("topic")
@click.argument("subscription")
@_json_flag
def subscriptions_get(topic: str, subscription: str) -> None:
    """Backlog, consumers and rates of one subscription."""
    _emit(_settings().client().subscription(topic, subscription))


@subscriptions_cmd.command("delete")
@click.argument("topic")
@click.argument("subscription")
@click.option("--force", is_flag=True, help="Detach connected consumers first.")
@_json_flag
def subscriptions_delete(topic: str, subscription: str, force: bool) -> None:
    """Delete SUBSCRIPTION (refused while consumers are attached, unless --force)."""
    _settings().client().delete_subscription(topic, subscription, force=force)
    _done(f"subscription {subscription} deleted")


_RELATIVE = re.compile(r"^-?(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


def parse_time(text: str, *, now_ms: int | None = None) -> int:
    """Milliseconds since the epoch from ``1700000000000`` (ms), an ISO 8601 time
    (``2024-05-01T12:00:00``, local time unless it has an offset) or a duration ago
    (``10m``, ``2h``, ``1d``, ``90s``)."""
    text = text.strip()
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if text.isdigit():
        return int(text)
    m = _RELATIVE.match(text)
    if m:
        return now_ms - int(float(m.group(1)) * _UNIT_MS[m.group(2)])
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: use ms since the epoch, an ISO 8601 time, or a duration ago like 10m",
            param_hint="--time",
        ) from None
    if when.tzinfo is None:
        when = when.astimezone()
    return int(when.timestamp() * 1000)


@subscriptions_cmd.command("reset")
@click.argument("topic")
@click.argument("subscription")
@click.option("--offset", type=click.IntRange(min=0), help="Partition offset of the next message.")
@click.option("--message-id", help="segment:entry[:index] (as peek shows).")
@click.option(
    "--time", "when", help="Publish time: ms since the epoch, ISO 8601, or 10m/2h/1d ago."
)
@_json_flag
def subscriptions_reset(
    topic: str, subscription: str, offset: int | None, message_id: str | None, when: str | None
) -> None:
    """Move the cursor of SUBSCRIPTION; connected consumers re-attach there."""
    if sum(x is not None for x in (offset, message_id, when)) != 1:
        raise click.UsageError("give exactly one of --offset, --message-id, --time")
    timestamp = parse_time(when) if when is not None else None
    result = (
        _settings()
        .client()
        .reset_cursor(
            topic, subscription, offset=offset, message_id=message_id, timestamp=timestamp
        )
    )
    _emit(
        result,
        lambda rows: _table(rows, ["topic", "subscription", "mark_delete_offset", "backlog"]),
    )


@subscriptions_cmd.command("skip")
@click.argument("topic")
@click.argument("subscription")
@click.argument("count", required=False, type=click.IntRange(min=0))
@click.option("--all", "skip_all", is_flag=True, help="Skip the whole backlog.")
@_json_flag
def subscriptions_skip(topic: str, subscription: str, count: int | None, skip_all: bool) -> None:
    """Acknowledge the next COUNT messages (or --all) without delivering them."""
    if (count is None) == (not skip_all):
        raise click.UsageError("give COUNT or --all")
    client = _settings().client()
    result = (
        client.clear_backlog(topic, subscription)
        if skip_all
        else client.skip(topic, subscription, count or 0)
    )
    _done(f"skipped {result['skipped']} message(s)", result)


@subscriptions_cmd.command("peek")
@click.argument("topic")
@click.argument("subscription")
@click.option("--count", "-n", default=1, show_default=True, type=click.IntRange(1, 1000))
@_json_flag
def subscriptions_peek(topic: str, subscription: str, count: int) -> None:
    """Show the next unacknowledged messages without consuming them."""

    def human(msgs: list[dict[str, Any]]) -> str:
        out = []
        for m in msgs:
            head = f"{m['message_id']}  offset={m['offset']}"
            if m["key"] is not None:
                head += f"  key={m['key']}"
            if m["properties"]:
                head += f"  properties={_fmt(m['properties'])}"
            value = m["value"] if m["value_encoding"] == "utf-8" else f"base64:{m['value']}"
            out.append(f"{head}\n  {value}")
        return "\n".join(out) if out else "(no unacknowledged messages)"

    _emit(_settings().client().peek(topic, subscription, count), human)


# -- brokers, bookies, metrics


@_group("brokers", "Brokers, their load and bundles.")
def brokers_cmd() -> None:
    pass


@brokers_cmd.command("list")
@_json_flag
def brokers_list() -> None:
    """List the brokers."""
    _emit(
        _settings().client().brokers(),
        lambda rows: _table(rows, ["broker", "service_url", "http_url", "cluster"]),
    )


@brokers_cmd.command("load")
@click.argument("broker", required=False)
@_json_flag
def brokers_load(broker: str | None) -> None:
    """Load of BROKER (host:port; default: the one answering)."""
    client = _settings().client()
    _emit(client.broker_load(broker or client.this_broker()))


@brokers_cmd.command("bundles")
@click.argument("broker", required=False)
@_json_flag
def brokers_bundles(broker: str | None) -> None:
    """Bundles owned by BROKER (default: the one answering)."""
    client = _settings().client()
    _emit(
        client.broker_bundles(broker or client.this_broker()),
        lambda rows: _table(rows, ["namespace", "bundle", "owner", "loaded_topics"]),
    )


@brokers_cmd.command("throughput")
@_json_flag
def brokers_throughput() -> None:
    """Broker-wide rates, one sample per second (last 5 minutes)."""
    _emit(
        _settings().client().throughput(),
        lambda rows: _table(
            rows[-20:],
            ["time", "msg_rate_in", "msg_rate_out", "msg_throughput_in", "msg_throughput_out"],
        ),
    )


@_group("bookies", "Bookies: state and disk.")
def bookies_cmd() -> None:
    pass


@bookies_cmd.command("list")
@_json_flag
def bookies_list() -> None:
    """List the bookies: state, disk, rates."""
    _emit(
        _settings().client().bookies(),
        lambda rows: _table(
            rows,
            [
                "address",
                "read_only",
                "free_disk_bytes",
                "disk_used_bytes",
                "write_bytes_per_s",
                "read_bytes_per_s",
                "segments",
            ],
        ),
    )


@bookies_cmd.command("get")
@click.argument("address")
@_json_flag
def bookies_get(address: str) -> None:
    """Show one bookie."""
    _emit(_settings().client().bookie(address))


@admin_cmd.command("metrics")
@click.option("--grep", "pattern", help="Only lines containing this text (HELP/TYPE omitted).")
def metrics_cmd(pattern: str | None) -> None:
    """Print the broker's Prometheus metrics."""
    text = _settings().client().metrics()
    if pattern:
        text = "\n".join(
            line for line in text.splitlines() if pattern in line and not line.startswith("#")
        )
    click.echo(text.rstrip("\n"))


for _cmd in (tenants_cmd, namespaces_cmd, topics_cmd, subscriptions_cmd, brokers_cmd, bookies_cmd):
    admin_cmd.add_command(_cmd)


def main() -> None:
    """Run ``pigeon admin`` on its own (``python -m``-style entry for scripts)."""
    admin_cmd(prog_name="pigeon admin")

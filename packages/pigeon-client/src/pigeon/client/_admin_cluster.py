"""``pigeon admin`` commands on subscriptions and the cluster: subscriptions, brokers,
bookies, metrics."""

from __future__ import annotations

import datetime as dt
import re
import time
from typing import Any

import click

from pigeon.client._admin_base import (
    _done,
    _emit,
    _fmt,
    _group,
    _json_flag,
    _settings,
    _table,
    admin_cmd,
)


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

"""``pigeon admin`` commands on subscriptions and the cluster: subscriptions, brokers,
bookies, metrics."""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from typing import Any

import click

from pigeon.client import _admin_base as cli
from pigeon.client import _units as units
from pigeon.client._admin_client import AdminClient

subscriptions_cmd = cli.group("subscriptions", "Subscriptions: create, reset, skip, peek.")
cli.show(
    subscriptions_cmd,
    "list",
    "List the subscriptions of TOPIC.",
    AdminClient.subscriptions,
    "topic",
)
cli.show(
    subscriptions_cmd,
    "get",
    "Backlog, consumers and rates of one subscription.",
    AdminClient.subscription,
    "topic",
    "subscription",
)


@subscriptions_cmd.command("create")
@click.argument("topic")
@click.argument("subscription")
@click.option(
    "--position",
    default="latest",
    show_default=True,
    help="earliest, latest, an offset, or a message id segment:entry[:index].",
)
@cli.json_flag
def subscriptions_create(topic: str, subscription: str, position: str) -> None:
    """Create a durable subscription at a position."""
    result = cli.settings().client().create_subscription(topic, subscription, position)
    cli.done(
        f"subscription {subscription} created on {result['topic']} (backlog {result['backlog']})",
        result,
    )


cli.delete(
    subscriptions_cmd,
    "Delete SUBSCRIPTION (refused while consumers are attached, unless --force).",
    AdminClient.delete_subscription,
    "topic",
    "subscription",
    force="Detach connected consumers first.",
)


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
@cli.json_flag
def subscriptions_reset(
    topic: str, subscription: str, offset: int | None, message_id: str | None, when: str | None
) -> None:
    """Move the cursor of SUBSCRIPTION; connected consumers re-attach there."""
    if sum(x is not None for x in (offset, message_id, when)) != 1:
        raise click.UsageError("give exactly one of --offset, --message-id, --time")
    timestamp = parse_time(when) if when is not None else None
    result = (
        cli.settings()
        .client()
        .reset_cursor(
            topic, subscription, offset=offset, message_id=message_id, timestamp=timestamp
        )
    )
    cli.emit(
        result,
        lambda rows: cli.table(rows, ["topic", "subscription", "mark_delete_offset", "backlog"]),
    )


@subscriptions_cmd.command("skip")
@click.argument("topic")
@click.argument("subscription")
@click.argument("count", required=False, type=click.IntRange(min=0))
@click.option("--all", "skip_all", is_flag=True, help="Skip the whole backlog.")
@cli.json_flag
def subscriptions_skip(topic: str, subscription: str, count: int | None, skip_all: bool) -> None:
    """Acknowledge the next COUNT messages (or --all) without delivering them."""
    if (count is None) == (not skip_all):
        raise click.UsageError("give COUNT or --all")
    client = cli.settings().client()
    result = (
        client.clear_backlog(topic, subscription)
        if skip_all
        else client.skip(topic, subscription, count or 0)
    )
    cli.done(f"skipped {units.plural(result['skipped'], 'message')}", result)


@subscriptions_cmd.command("peek")
@click.argument("topic")
@click.argument("subscription")
@click.option("--count", "-n", default=1, show_default=True, type=click.IntRange(1, 1000))
@cli.json_flag
def subscriptions_peek(topic: str, subscription: str, count: int) -> None:
    """Show the next unacknowledged messages without consuming them."""

    def human(msgs: list[dict[str, Any]]) -> str:
        out = []
        for m in msgs:
            head = f"{m['message_id']}  offset={m['offset']}"
            if m["key"] is not None:
                head += f"  key={m['key']}"
            if m["properties"]:
                head += f"  properties={json.dumps(m['properties'], separators=(',', ':'))}"
            value = m["value"] if m["value_encoding"] == "utf-8" else f"base64:{m['value']}"
            out.append(f"{head}\n  {value}")
        return "\n".join(out) if out else "(no unacknowledged messages)"

    cli.emit(cli.settings().client().peek(topic, subscription, count), human)


# -- brokers, bookies, metrics


brokers_cmd = cli.group("brokers", "Brokers, their load and bundles.")
cli.show(
    brokers_cmd,
    "list",
    "List the brokers.",
    AdminClient.brokers,
    human=cli.table_of(["broker", "service_url", "http_url", "cluster"]),
)
cli.show(
    brokers_cmd,
    "throughput",
    "Broker-wide rates, one sample per second (last 5 minutes).",
    AdminClient.throughput,
    human=lambda rows: cli.table(
        rows[-20:],
        ["time", "msg_rate_in", "msg_rate_out", "msg_throughput_in", "msg_throughput_out"],
    ),
)


@brokers_cmd.command("load")
@click.argument("broker", required=False)
@cli.json_flag
def brokers_load(broker: str | None) -> None:
    """Load of BROKER (host:port; default: the one answering)."""
    client = cli.settings().client()
    cli.emit(client.broker_load(broker or client.this_broker()))


@brokers_cmd.command("bundles")
@click.argument("broker", required=False)
@cli.json_flag
def brokers_bundles(broker: str | None) -> None:
    """Bundles owned by BROKER (default: the one answering)."""
    client = cli.settings().client()
    cli.emit(
        client.broker_bundles(broker or client.this_broker()),
        cli.table_of(cli.BUNDLE_COLUMNS),
    )


bookies_cmd = cli.group("bookies", "Bookies: state and disk.")
cli.show(
    bookies_cmd,
    "list",
    "List the bookies: state, disk, rates.",
    AdminClient.bookies,
    human=cli.table_of(
        [
            "address",
            "read_only",
            "free_disk_bytes",
            "disk_used_bytes",
            "write_bytes_per_s",
            "read_bytes_per_s",
            "segments",
        ]
    ),
)
cli.show(bookies_cmd, "get", "Show one bookie.", AdminClient.bookie, "address")


@cli.admin_cmd.command("metrics")
@click.option("--grep", "pattern", help="Only lines containing this text (HELP/TYPE omitted).")
def metrics_cmd(pattern: str | None) -> None:
    """Print the broker's Prometheus metrics."""
    text = cli.settings().client().metrics()
    if pattern:
        text = "\n".join(
            line for line in text.splitlines() if pattern in line and not line.startswith("#")
        )
    click.echo(text.rstrip("\n"))

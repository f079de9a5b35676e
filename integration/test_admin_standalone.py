"""``pigeon admin`` and the broker's HTTP port against a real ``pigeon standalone`` process."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
from _admin import admin_json, pigeon

from pigeon.core.testing.servers import HOST, Standalone, free_ports

pytestmark = pytest.mark.integration

TOPIC = "persistent://public/default/ops-events"


def start_with_http(factory: Callable[..., Standalone]) -> tuple[Standalone, str]:
    (http_port,) = free_ports(1)
    server = factory(extra_args=("--http-port", str(http_port))).start()
    url = f"http://{HOST}:{http_port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(url + "/admin/v2/cluster/health", timeout=2) as resp:
                if resp.status == 200:
                    return server, url
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() < deadline, "admin API not up; log:\n" + server.log_tail()
        time.sleep(0.1)


def test_operator_workflow_against_a_real_standalone(
    standalone_factory: Callable[..., Standalone],
) -> None:
    server, url = start_with_http(standalone_factory)

    health = pigeon("admin", "health", env={"PIGEON_ADMIN_URL": url})
    assert health.returncode == 0, health.stderr
    assert "status   ok" in health.stdout

    produced = pigeon("produce", TOPIC, "a", "b", "c", "--service-url", server.url)
    assert produced.returncode == 0, produced.stderr
    one = pigeon("produce", TOPIC + "-one", "x", "--service-url", server.url)
    assert one.stderr.strip().endswith(f"1 message produced to {TOPIC}-one"), one.stderr
    stats = admin_json(url, "topics", "stats", TOPIC)
    assert stats["msgs_in"] == 3 and stats["storage_size"] > 0

    made = admin_json(url, "subscriptions", "create", TOPIC, "ops", "--position", "earliest")
    assert made["backlog"] == 3
    peeked = admin_json(url, "subscriptions", "peek", TOPIC, "ops", "-n", "3")
    assert [m["value"] for m in peeked] == ["a", "b", "c"]
    assert admin_json(url, "subscriptions", "skip", TOPIC, "ops", "2")["skipped"] == 2
    reset = admin_json(url, "subscriptions", "reset", TOPIC, "ops", "--time", "1h")
    assert reset[0]["backlog"] == 3

    changed = pigeon(
        "admin", "--url", url, "namespaces", "set-policies", "public/default", "message_ttl_s=86400"
    )
    assert "message_ttl_s" in changed.stdout and "86,400.00" not in changed.stdout
    assert [
        line.split(None, 1)[1]
        for line in changed.stdout.splitlines()
        if line.startswith("message_ttl_s ")
    ] == ["1 d"], changed.stdout
    changed_doc = admin_json(
        url, "namespaces", "set-policies", "public/default", "message_ttl_s=3600"
    )
    assert changed_doc["message_ttl_s"] == 3600

    consumed = pigeon(
        "consume", TOPIC, "-s", "ops", "-n", "3", "--timeout", "10", "--service-url", server.url
    )
    assert consumed.returncode == 0, consumed.stderr
    assert consumed.stdout.split() == ["a", "b", "c"]
    assert admin_json(url, "subscriptions", "get", TOPIC, "ops")["backlog"] == 0

    metrics = pigeon("admin", "--url", url, "metrics", "--grep", "pigeon_topic_messages_in_total")
    assert metrics.returncode == 0
    assert f'{{topic="{TOPIC}"}} 3.0' in metrics.stdout
    # the standalone's bookie reports on the same endpoint
    storage = pigeon(
        "admin", "--url", url, "metrics", "--grep", "pigeon_bookie_entries_written_total"
    )
    assert storage.returncode == 0
    written = [
        line
        for line in storage.stdout.splitlines()
        if line.startswith("pigeon_bookie_entries_written_total")
    ]
    assert written and float(written[0].rsplit(" ", 1)[1]) >= 1

    missing = pigeon("admin", "--url", url, "topics", "stats", "no-such-topic")
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: TopicNotFound: "), missing.stderr
    assert missing.stderr.count("\n") == 1, missing.stderr
    usage = pigeon("admin", "--url", url, "subscriptions", "reset", TOPIC, "ops")
    assert usage.returncode == 2

    with urllib.request.urlopen(url + "/dashboard", timeout=5) as resp:
        assert b"PigeonMQ dashboard" in resp.read()

    assert server.terminate() == 0  # the HTTP server stops with the broker

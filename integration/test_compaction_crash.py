"""Topic compaction against a real ``pigeon standalone``: ``pigeon admin topics compact``
and ``compaction-status`` through the real command, then a kill -9 while a compaction
runs under concurrent produce.  After the restart the compacted view holds, for every
key, a value at least as new as the one acknowledged before the compaction started."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from _admin import admin_json, admin_url

from pigeon.client import Client
from pigeon.core.testing.servers import Standalone

pytestmark = pytest.mark.integration

TOPIC = "persistent://public/default/compacted-crash"
KEYS = 50


def rest(url: str, what: str) -> Any:
    path = TOPIC.replace("persistent://", "/admin/v2/topics/persistent/")
    with urllib.request.urlopen(f"{url}{path}/{what}", timeout=10) as resp:
        return json.loads(resp.read())


def wait_status(url: str, want: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = rest(url, "compaction")
        if status["status"] == want:
            return status
        assert status["status"] != "ERROR", status
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


def latest_view(server: Standalone) -> dict[str, int]:
    with Client(server.url) as client, client.create_table_view(TOPIC) as view:
        return {k: int(v) for k, v in view.items()}


def test_compaction_survives_kill9_under_concurrent_produce(
    standalone_factory: Callable[..., Standalone],
) -> None:
    server = standalone_factory().start()
    url = admin_url(server)
    acked: dict[str, int] = {}  # key -> highest acknowledged sequence
    lock = threading.Lock()
    stop = threading.Event()

    def produce_forever() -> None:
        seq = 0
        with (
            Client(server.url, operation_timeout=2) as client,
            client.create_producer(TOPIC, send_timeout=1) as producer,
        ):
            while not stop.is_set():
                key = f"k{seq % KEYS}"
                try:
                    producer.send(str(seq).encode(), key=key)
                except Exception:  # the broker was killed: stop producing
                    return
                with lock:
                    acked[key] = seq
                seq += 1

    with Client(server.url) as client, client.create_producer(TOPIC) as producer:
        for seq in range(-5_000, 0):  # a backlog that takes a moment to compact
            producer.send_async(str(seq).encode(), key=f"k{seq % KEYS}")
            acked[f"k{seq % KEYS}"] = seq
        producer.flush()
    writer = threading.Thread(target=produce_forever, daemon=True)
    writer.start()
    time.sleep(0.3)
    with lock:
        before = dict(acked)
    started = admin_json(url, "topics", "compact", TOPIC)
    assert started["status"] in ("RUNNING", "SUCCESS")
    server.kill9()  # most likely mid-compaction
    stop.set()
    writer.join(30)

    server.restart()
    admin_json(url, "topics", "compact", TOPIC)
    status = wait_status(url, "SUCCESS")
    assert status["compacted_ledger"] is not None and status["horizon"] > 0
    assert admin_json(url, "topics", "compaction-status", TOPIC) == status
    stats = rest(url, "internal-stats")
    assert stats["compaction_horizon"] == status["horizon"]
    assert stats["compacted_ledger"]["id"] == status["compacted_ledger"]
    assert "__compaction" in stats["cursors"]
    view = latest_view(server)
    assert set(view) == {f"k{i}" for i in range(KEYS)}
    stale = {k: (view[k], before[k]) for k in before if view[k] < before[k]}
    assert not stale, stale

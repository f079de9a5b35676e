"""Pure range reads (``pigeon.client._range``, what the Spark source is built on), against
a real ``pigeon standalone`` — no Spark needed."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from pigeon.client import Client
from pigeon.client._engine import ReceivedEntry
from pigeon.client._range import (
    offsets_for_timestamp,
    partition_offsets,
    partition_topics,
    read_range,
)
from pigeon.core._entry import unpack_entry_header
from pigeon.core.testing.servers import Standalone

pytestmark = pytest.mark.integration

P0 = "persistent://public/default/r-partition-0"
P1 = "persistent://public/default/r-partition-1"


def offsets_of(entries: list[ReceivedEntry]) -> list[tuple[int, int]]:
    """(first offset, message count) of each stored entry."""
    headers = [unpack_entry_header(e.data) for e in entries]
    return [(h.first_offset, h.num_messages) for h in headers]


def drain(client: Client, topic: str, n: int) -> None:
    """Consume and acknowledge ``n`` messages on a durable subscription: with retention 0,
    the broker may then delete the closed segments holding them."""
    with client.subscribe(topic, "drain", initial_position="earliest") as consumer:
        for _ in range(n):
            msg = consumer.receive(timeout=10)
        consumer.acknowledge_cumulative(msg)


def test_range_reads_are_exact_and_repeatable(standalone: Standalone) -> None:
    with Client(standalone.url, operation_timeout=10) as client:
        client.create_topic("r", 2)
        with client.create_producer(
            "r", batching_max_messages=10, routing_mode="single_partition"
        ) as producer:
            for i in range(95):
                producer.send_async(b"%d" % i)
            producer.flush()
            cut = int(time.time() * 1000)
            time.sleep(0.02)
            for i in range(95, 100):
                producer.send_async(b"%d" % i)
        assert partition_topics(client, "r") == [P0, P1]
        offsets = partition_offsets(client, "r")
        busy = P0 if offsets[P0][1] == 100 else P1
        assert sorted(offsets.values()) == [(0, 0), (0, 100)]
        assert offsets_for_timestamp(client, "r", cut)[busy] == 95

        reads = []
        for _ in range(2):
            with read_range(client, busy, 13, 57) as reader:
                reads.append(offsets_of(list(reader)))
        # whole entries covering [13, 57), in order, each once; the same twice
        assert reads[0] == reads[1] == [(10, 10), (20, 10), (30, 10), (40, 10), (50, 10)]
        with read_range(client, busy, 99, 100) as reader:
            assert offsets_of(list(reader)) == [(95, 5)]
        with read_range(client, busy, 40, 40) as reader:
            assert list(reader) == []
        # nothing is left behind on the broker: the reader subscriptions are gone
        local = busy.split("/")[-1]
        url = (
            f"http://127.0.0.1:{standalone.http_port}"
            f"/admin/v2/topics/persistent/public/default/{local}/subscriptions"
        )
        with urllib.request.urlopen(url, timeout=10) as response:
            assert json.load(response) == []


def test_missing_offsets_are_reported(
    standalone_factory: Callable[..., Standalone], tmp_path: Path
) -> None:
    config = tmp_path / "pigeon.toml"
    config.write_text("[broker]\nsegment_max_entries = 2\nmaintenance_interval_s = 0.2\n")
    server = standalone_factory(extra_args=("--config", str(config))).start()
    with Client(server.url, operation_timeout=10) as client:
        with client.create_producer("gone") as producer:
            for i in range(7):
                producer.send(b"%d" % i)  # an entry each; segments of two entries
        drain(client, "gone", 7)
        name = "persistent://public/default/gone"
        deadline = time.monotonic() + 30
        while partition_offsets(client, "gone")[name] != (6, 7):
            assert time.monotonic() < deadline, partition_offsets(client, "gone")
            time.sleep(0.1)
        missing: list[tuple[str, int, int]] = []
        with read_range(
            client, name, 2, 7, on_missing=lambda *args: missing.append(args)
        ) as reader:
            assert offsets_of(list(reader)) == [(6, 1)]
        assert missing == [(name, 2, 6)]
        with pytest.raises(Exception, match=r"offsets \[0, 6\) of .* no longer available"):
            read_range(client, name, 0, 7)

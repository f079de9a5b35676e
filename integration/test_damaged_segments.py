"""Damaged segment files under real processes.

A stopped server's segment data file is damaged the way an operator or a failing disk
damages it (its tail truncated, bits flipped), then the server starts again:

* ``pigeon standalone`` (one copy): the damage is named in the log at start, the topic
  opens, every intact message is delivered to a fresh subscription exactly once, the
  damaged ones are skipped (corrupt_entry_policy ``skip``, the default) and counted in
  the admin API; producers attach and write on.
* a cluster of 3 bookies with ``write_quorum = 2``: a bookie whose copy is damaged is
  passed over, the entry is read from the other replica and the damaged copy repaired;
  nothing is lost.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _cluster import Cluster

from pigeon.bookie.testing import RECORD_HEADER_SIZE, record_starts
from pigeon.client import Client, Timeout
from pigeon.core.testing.servers import HOST, Standalone

pytestmark = pytest.mark.integration

TOPIC = "persistent://public/default/damaged"
PER_ENTRY = 100
ENTRIES = 20
OP_TIMEOUT = 20.0


def produce(url: str, n: int, *, per_entry: int = PER_ENTRY, topic: str = TOPIC) -> None:
    with Client(url, operation_timeout=OP_TIMEOUT) as client:
        producer = client.create_producer(
            topic, batching_max_messages=per_entry, batching_max_delay_ms=60_000
        )
        futures = [producer.send_async(b"m-%06d" % i) for i in range(n)]
        producer.flush()
        for f in futures:
            f.result(OP_TIMEOUT)
        producer.close()


def read_fresh(url: str, name: str, *, topic: str = TOPIC) -> list[bytes]:
    """What a new subscription from the earliest message receives (acknowledged)."""
    out: list[bytes] = []
    with (
        Client(url, operation_timeout=OP_TIMEOUT) as client,
        client.subscribe(topic, name, initial_position="earliest") as consumer,
    ):
        for _ in range(10_000):
            try:
                msgs = consumer.batch_receive(1000, timeout=3)
            except Timeout:
                break
            out.extend(m.value for m in msgs)
            for m in msgs:
                consumer.acknowledge(m)
    return out


def read_with_reader(url: str, n: int, *, topic: str = TOPIC) -> list[bytes]:
    """Up to ``n`` messages from the earliest, read by a reader (which consumes nothing:
    retention keeps the data for the next read)."""
    out: list[bytes] = []
    with (
        Client(url, operation_timeout=OP_TIMEOUT) as client,
        client.create_reader(topic, "earliest") as reader,
    ):
        while len(out) < n:
            try:
                out.append(reader.read_next(timeout=5).value)
            except Timeout:
                break
    return out


def segment_files(bookie_dir: Path) -> list[Path]:
    return sorted((bookie_dir / "segments").glob("*.log"), key=lambda p: p.stat().st_size)


def admin_get(http_port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://{HOST}:{http_port}/admin/v2{path}", timeout=10) as r:
        return json.load(r)


def test_standalone_restarted_on_damaged_segments(
    standalone_factory: Any,
) -> None:
    server: Standalone = standalone_factory().start()
    produce(server.url, ENTRIES * PER_ENTRY)
    assert server.terminate() == 0  # a clean stop: the segment is closed in metadata
    (path,) = segment_files(server.data_dir / "bookie")[-1:]
    starts = record_starts(path)
    assert sorted(starts) == list(range(ENTRIES))
    data = bytearray(path.read_bytes())
    data[starts[5] + RECORD_HEADER_SIZE + 333] ^= 0x08  # bit rot in entry 5
    path.write_bytes(data[: starts[17] + RECORD_HEADER_SIZE + 50])  # 17 torn, 18-19 gone

    server.restart()
    got = read_fresh(server.url, "fresh")
    lost = {5, 17, 18, 19}
    expected = [b"m-%06d" % i for i in range(ENTRIES * PER_ENTRY) if i // PER_ENTRY not in lost]
    assert got == expected  # every intact message, once, in order

    log = server.log_text()
    assert "torn tail truncated segment=" in log
    assert "damaged entries found at start segment=" in log and "entries=5" in log
    assert "ledger tail damaged" in log and "entries=17..19 (3)" in log
    assert "entries=5..5 (1) are on no replica intact" in log
    stats = admin_get(server.http_port, "/topics/persistent/public/default/damaged/stats")
    assert stats["corrupt_entries"] == len(lost)
    sub = stats["subscriptions"]["fresh"]
    assert (sub["lost_messages"], sub["backlog"], sub["read_error"]) == (
        len(lost) * PER_ENTRY,
        0,
        None,
    )
    metrics = urllib.request.urlopen(f"http://{HOST}:{server.http_port}/metrics", timeout=10)
    text = metrics.read().decode()
    assert f'pigeon_corrupt_entries_total{{topic="{TOPIC}"}} 4.0' in text
    # producers attach and write on; the subscription gets the new messages
    produce(server.url, 10, per_entry=1)
    assert read_fresh(server.url, "fresh") == [b"m-%06d" % i for i in range(10)]


@pytest.mark.parametrize(
    "replication", [pytest.param("quorum", id="quorum"), pytest.param("leader-follower", id="lf")]
)
def test_a_damaged_replica_is_read_around_and_repaired(tmp_path: Path, replication: str) -> None:
    config = tmp_path / "broker.toml"
    config.write_text("[broker]\nensemble_size = 3\nwrite_quorum = 2\nack_quorum = 2\n")
    cluster = Cluster(tmp_path, f"embedded://{tmp_path / 'metadata'}", replication)
    try:
        for _ in range(3):
            cluster.add_bookie()
        broker = cluster.add_broker("--config", str(config))
        n = 2000
        produce(cluster.service_url, n, per_entry=20)
        broker.stop()  # the topic's segment is closed: reads may repair it
        damaged = cluster.bookies[0]
        damaged.stop()
        flipped = 0
        for path in segment_files(tmp_path / "bookie-0"):
            data = bytearray(path.read_bytes())
            # every entry this bookie holds but the last (a damaged last record is
            # a torn tail: truncated at start, then refilled by reads just the same)
            for pos in sorted(record_starts(path).values())[:-1]:
                data[pos + RECORD_HEADER_SIZE + 7] ^= 0x20
                flipped += 1
            path.write_bytes(data)
        assert flipped > 10
        damaged.start()
        broker.start()
        expected = [b"m-%06d" % i for i in range(n)]
        assert read_with_reader(cluster.service_url, n) == expected
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            bookie_log = damaged.log_path.read_text(errors="replace")
            if "damaged entry repaired from a good copy" in bookie_log:
                break
            time.sleep(0.1)
        assert "damaged entries found at start" in bookie_log
        assert "damaged entry repaired from a good copy" in bookie_log
        assert "entry read from another replica" in broker.log_path.read_text(errors="replace")
        # a repaired copy is good from now on: a second read repairs other entries only
        repaired = {
            line.split("entry=")[1].split()[0]
            for line in bookie_log.splitlines()
            if "damaged entry repaired from a good copy" in line
        }
        assert read_with_reader(cluster.service_url, n) == expected
        again = [
            line.split("entry=")[1].split()[0]
            for line in damaged.log_path.read_text(errors="replace").splitlines()
            if "damaged entry repaired from a good copy" in line
        ]
        assert len(again) == len(set(again)) and repaired <= set(again)
    finally:
        cluster.kill_all()

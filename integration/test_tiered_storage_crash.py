"""Tiered storage survives kill -9 of the broker mid-offload: a real ``pigeon
standalone`` process offloading to a real S3-compatible server (moto's server mode) on
loopback.

The crash is placed deterministically: the S3 server is paused (SIGSTOP) before an
offload starts, so the broker is certainly inside an upload when it is killed (-9).  The
segments offloaded before (bookie copies already deleted) and those being offloaded must
all read back exactly after the restart, and the offload then completes.

Then retention removes the offloaded segments while the store is paused again: the
broker is killed after it dropped them from the ledger's metadata and before their
objects were deleted.  The restarted owner deletes them (the intent to delete was saved
with the removal): no orphan is left in the bucket.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _produce import Sent, assert_content, produce, receive_n

from pigeon.client import Client
from pigeon.client._admin_client import AdminClient, AdminError
from pigeon.core.testing._process import send_signal
from pigeon.core.testing.servers import MotoS3Server, Standalone

pytestmark = pytest.mark.integration

BUCKET = "tier"
TOPIC = "persistent://public/default/tiered"


@pytest.fixture
def moto(tmp_path: Any) -> Iterator[MotoS3Server]:
    server = MotoS3Server(tmp_path / "moto")
    server.start()
    server.create_bucket(BUCKET)
    try:
        yield server
    finally:
        if server.proc is not None:
            send_signal(server.proc, signal.SIGCONT)
        server.stop(kill=True)


def sent(n: int, start: int = 0) -> list[Sent]:
    return [
        Sent(f"m-{i}".encode() * (1 + i % 50), f"k{i % 7}", {"i": str(i)})
        for i in range(start, start + n)
    ]


def read_everything(url: str, n: int) -> list[Any]:
    out: list[Any] = []
    with Client(url) as client, client.create_reader(TOPIC, "earliest") as reader:
        deadline = time.monotonic() + 60
        while len(out) < n and time.monotonic() < deadline:
            out.append(reader.read_next(timeout=30))
    return out


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def admin_of(server: Standalone) -> AdminClient:
    """The admin client of ``server``, once its admin API answers."""
    admin = AdminClient(f"http://127.0.0.1:{server.http_port}")

    def answers() -> bool:
        try:
            admin.policies("public/default")
        except (AdminError, OSError):
            return False
        return True

    wait_for(answers, "the admin API")
    return admin


def segments(admin: AdminClient) -> list[dict[str, Any]]:
    return admin.internal_stats(TOPIC)["segments"]  # type: ignore[no-any-return]


def test_kill_9_mid_offload_loses_nothing(
    standalone_factory: Callable[..., Standalone], moto: MotoS3Server, monkeypatch: Any
) -> None:
    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)  # the standalone inherits the credentials
    server = standalone_factory(
        config={
            "broker": {
                "segment_max_entries": 2,
                "maintenance_interval_s": 0.5,
                "managed_ledger_offload_driver": "s3",
                "s3_managed_ledger_offload_bucket": BUCKET,
                "s3_managed_ledger_offload_region": "us-east-1",
                "s3_managed_ledger_offload_service_endpoint": moto.endpoint,
            }
        }
    ).start()
    admin = admin_of(server)
    admin.set_policies(
        "public/default",
        {"offload_deletion_lag_s": 0, "retention_time_s": -1, "retention_size_mb": -1},
    )
    first = sent(40)
    produce(server.url, TOPIC, first, batching_max_messages=1)
    # 1. the oldest segments offloaded, their bookie copies released (lag 0)
    admin.offload(TOPIC, size_threshold=segments(admin)[-1]["size"] * 10)
    wait_for(lambda: admin.offload_status(TOPIC)["status"] == "SUCCESS", "first offload")
    wait_for(lambda: [s for s in segments(admin) if s["bookies_deleted"]], "bookie copies released")
    done_before = [s["id"] for s in segments(admin) if s["offload"]]
    assert done_before
    second = sent(40, start=40)
    produce(server.url, TOPIC, second, batching_max_messages=1)
    # 2. the store stalls; an offload of everything starts and hangs inside an upload
    assert moto.proc is not None
    send_signal(moto.proc, signal.SIGSTOP)
    admin.offload(TOPIC, size_threshold=0)
    assert admin.offload_status(TOPIC)["status"] == "RUNNING"
    server.kill9()
    send_signal(moto.proc, signal.SIGCONT)
    # 3. after the restart every message reads back exactly, the offloaded ones from S3
    server.restart()
    admin = admin_of(server)
    assert [s["id"] for s in segments(admin) if s["offload"]] == done_before
    assert_content(read_everything(server.url, 80), first + second)
    # 4. the interrupted offload is simply done again
    admin.offload(TOPIC, size_threshold=0)
    status = wait_for(
        lambda: (s := admin.offload_status(TOPIC))["status"] != "RUNNING" and s, "offload"
    )
    assert status["status"] == "SUCCESS", status
    wait_for(
        lambda: all(s["bookies_deleted"] for s in segments(admin)[:-1]), "bookie copies released"
    )
    assert_content(read_everything(server.url, 80), first + second)
    keys = moto.objects(BUCKET)
    assert len(keys) == 2 * len([s for s in segments(admin) if s["offload"]])
    # 5. everything consumed; retention removes the offloaded segments while the store
    #    stalls: killed after the removal was saved, before the objects were deleted
    with (
        Client(server.url) as client,
        client.subscribe(TOPIC, "drain", initial_position="earliest") as consumer,
    ):
        for m in receive_n(consumer, 80):
            consumer.acknowledge(m)
    send_signal(moto.proc, signal.SIGSTOP)
    admin.set_policies("public/default", {"retention_time_s": 0, "retention_size_mb": 0})
    wait_for(lambda: len(segments(admin)) == 1, "retention of the consumed segments")
    server.kill9()
    send_signal(moto.proc, signal.SIGCONT)
    # a delete the broker sent before the kill may still be served once moto resumes,
    # but the others were never sent: orphans but for...
    assert len(moto.objects(BUCKET)) >= len(keys) - 1
    # 6. ...the restarted owner, which deletes what the removal recorded
    server.restart()
    admin = admin_of(server)
    assert len(segments(admin)) == 1  # loads the topic: its maintenance runs
    wait_for(lambda: moto.objects(BUCKET) == [], "the objects of the removed segments deleted")

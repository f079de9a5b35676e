"""Tiered storage through ``pigeon admin`` against a standalone whose broker offloads to
a real S3-compatible server (moto's server mode, started on loopback): the namespace
policies, ``topics offload`` / ``offload-status``, reads after the bookie copies are
gone, and a failed upload (the S3 server stopped) retried once it is back."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from admin_support import AdminStandalone
from click.testing import CliRunner

from pigeon.client import Client
from pigeon.client._admin_cli import admin_cmd
from pigeon.core.testing.servers import MotoS3Server

NS = "public/default"
BUCKET = "pigeon-tier"


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3Server]:
    server = MotoS3Server(tmp_path_factory.mktemp("moto"))
    server.start()
    server.create_bucket(BUCKET)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiered(
    tmp_path_factory: pytest.TempPathFactory, moto: MotoS3Server
) -> Iterator[AdminStandalone]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in moto.env().items():
            mp.setenv(key, value)
        server = AdminStandalone(
            tmp_path_factory.mktemp("tiered") / "data",
            segment_max_entries=2,
            maintenance_interval_s=3600,  # offloads run when the test asks
            managed_ledger_offload_driver="s3",
            s3_managed_ledger_offload_bucket=BUCKET,
            s3_managed_ledger_offload_region="us-east-1",
            s3_managed_ledger_offload_service_endpoint=moto.endpoint,
        ).start()
        try:
            yield server
        finally:
            server.stop()


def admin(server: AdminStandalone, *args: str, code: int = 0) -> Any:
    result = CliRunner().invoke(admin_cmd, ["--url", server.url, "--json", *args])
    assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
    return json.loads(result.stdout) if code == 0 else result.stderr


def wait_status(server: AdminStandalone, topic: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        status = admin(server, "topics", "offload-status", topic)
        if status["status"] != "RUNNING":
            return status  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


def produce(server: AdminStandalone, topic: str, values: list[bytes]) -> None:
    with (
        Client(server.service_url) as client,
        client.create_producer(topic, batching_max_messages=1) as producer,
    ):
        for v in values:
            producer.send(v)


def read_all(server: AdminStandalone, topic: str) -> list[bytes]:
    out = []
    with Client(server.service_url) as client, client.create_reader(topic, "earliest") as r:
        while r.has_message_available():
            out.append(r.read_next(timeout=10).value)
    return out


def release_bookie_copies(server: AdminStandalone) -> None:
    server.call(lambda: server.service.maintain_once())  # type: ignore[union-attr]


VALUES = [bytes([i]) * (1000 + i) for i in range(10)]


def test_offload_through_admin_to_s3(tiered: AdminStandalone, moto: MotoS3Server) -> None:
    admin(tiered, "namespaces", "set-offload-deletion-lag", NS, "--lag", "0")
    policies = admin(tiered, "namespaces", "set-offload-threshold", NS, "--size", "-1")
    assert policies["offload_threshold_bytes"] == -1 and policies["offload_deletion_lag_s"] == 0
    produce(tiered, "s3-topic", VALUES)
    assert admin(tiered, "topics", "offload-status", "s3-topic")["status"] == "NOT_RUN"
    admin(tiered, "topics", "offload", "s3-topic", "--size-threshold", "0")
    status = wait_status(tiered, "s3-topic")
    assert status["status"] == "SUCCESS", status
    assert status["offloaded_segments"] >= 4
    keys = moto.objects(BUCKET)
    assert len([k for k in keys if k.startswith("persistent/public/default/s3-topic/")]) == (
        2 * status["offloaded_segments"]
    )
    release_bookie_copies(tiered)
    stats = admin(tiered, "topics", "internal-stats", "s3-topic")
    offloaded = [s for s in stats["segments"] if s["offload"]]
    assert offloaded and all(s["bookies_deleted"] for s in offloaded)
    assert all(s["offload"]["driver"] == "s3" for s in offloaded)
    # a new broker-side cache would serve nothing: the reader reads through S3
    tiered.call(_drop_cache, tiered, "s3-topic")
    assert read_all(tiered, "s3-topic") == VALUES


async def _drop_cache(server: AdminStandalone, topic: str) -> None:
    assert server.service is not None
    led = server.service.topics[f"persistent://public/default/{topic}"].ledger
    led.cache = type(led.cache)(led.cache.max_bytes)


def test_failed_upload_is_retried_and_keeps_the_bookie_copy(
    tiered: AdminStandalone, moto: MotoS3Server
) -> None:
    produce(tiered, "s3-retry", VALUES)
    moto.stop()  # the store is down
    try:
        admin(tiered, "topics", "offload", "s3-retry")
        status = wait_status(tiered, "s3-retry")
        assert status["status"] == "ERROR" and status["last_error"], status
        assert status["offloaded_segments"] == 0
        release_bookie_copies(tiered)
        assert read_all(tiered, "s3-retry") == VALUES  # from the bookies
    finally:
        moto.start()  # moto keeps state in memory: a fresh, empty server
        moto.create_bucket(BUCKET)
    admin(tiered, "topics", "offload", "s3-retry")
    status = wait_status(tiered, "s3-retry")
    assert status["status"] == "SUCCESS", status
    release_bookie_copies(tiered)
    tiered.call(_drop_cache, tiered, "s3-retry")
    assert read_all(tiered, "s3-retry") == VALUES


def test_offload_needs_a_persistent_topic(tiered: AdminStandalone) -> None:
    err = admin(tiered, "topics", "offload", "never-created", code=1)
    assert "does not exist" in err
    err = admin(tiered, "namespaces", "set-offload-threshold", NS, "--size", "lots", code=2)
    assert "not a size" in err


def test_offload_status_names_damaged_segments() -> None:
    from pigeon.client._admin_topics import _offload_status_text

    text = _offload_status_text(
        {
            "status": "ERROR",
            "last_error": "segment 7 not offloaded: ...",
            "offloaded_segments": 4,
            "first_unoffloaded_message_id": "7:0",
            "damaged_segments": [
                {
                    "segment": 7,
                    "entry": 1,
                    "error": "entry 1 is on no replica intact",
                    "attempts": 2,
                    "retry_in_s": 120.0,
                }
            ],
        }
    )
    assert "damaged_segments" not in text
    assert text.splitlines()[-1] == (
        "damaged segment 7 (entry 1): entry 1 is on no replica intact"
        " [attempts 2, retried in 2 min]"
    )

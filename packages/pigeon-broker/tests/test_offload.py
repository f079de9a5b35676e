"""The built-in offloaders against the contract suite: ``filesystem`` on a temp
directory, ``s3`` on a moto server started on loopback (``servers.moto_s3``); and the
offload sweeper over the real S3 listing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from standalone_support import NS, PREFIX, produce, read_all

from pigeon.broker import BrokerConfig, FileSystemOffloader, S3Offloader
from pigeon.broker._offload import filesystem_root, make_s3
from pigeon.broker._offload_sweeper import OffloadSweeper
from pigeon.client.trio import Client
from pigeon.core import PluginManager
from pigeon.core.errors import ConfigError, OffloadError
from pigeon.core.testing import OffloaderContract, in_process_standalone
from pigeon.core.testing._offloader_suite import batches, segment_entries
from pigeon.core.testing.servers import MotoS3Server, moto_s3_server


class TestFileSystemOffloader(OffloaderContract):
    @pytest.fixture
    def offloader(self, tmp_path: Path) -> FileSystemOffloader:
        return FileSystemOffloader(tmp_path / "offload")


def test_drivers_are_registered() -> None:
    pm = PluginManager()
    assert {"filesystem", "s3"} <= set(pm.offloaders)


def test_driver_settings_are_checked(tmp_path: Path) -> None:
    pm = PluginManager()
    assert BrokerConfig().offloader(pm.offloaders) is None
    with pytest.raises(ConfigError, match="managed_ledger_offload_driver"):
        BrokerConfig(managed_ledger_offload_driver="tape").offloader(pm.offloaders)
    with pytest.raises(ConfigError, match="offload_directory"):
        BrokerConfig(managed_ledger_offload_driver="filesystem").offloader(pm.offloaders)
    with pytest.raises(ConfigError, match="file_system_uri"):
        filesystem_root(BrokerConfig(file_system_uri="hdfs://nn:8020", offload_directory="x"))
    with pytest.raises(ConfigError, match="s3_managed_ledger_offload_bucket"):
        BrokerConfig(managed_ledger_offload_driver="s3").offloader(pm.offloaders)
    with pytest.raises(ConfigError, match="service_endpoint"):
        BrokerConfig(
            managed_ledger_offload_driver="s3",
            s3_managed_ledger_offload_bucket="b",
            s3_managed_ledger_offload_service_endpoint="ftp://x",
        ).offloader(pm.offloaders)
    root = filesystem_root(
        BrokerConfig(file_system_uri=f"file://{tmp_path}", offload_directory="tiered")
    )
    assert root == tmp_path / "tiered"

    # the sweeper's keys: a bad value is one clear line, not a sweeper that misbehaves
    for key, value in (
        ("managed_ledger_offload_orphan_grace_s", -1.0),
        ("managed_ledger_offload_sweep_interval_s", float("nan")),
        ("managed_ledger_offload_sweep_max_objects", 0),
    ):
        with pytest.raises(ConfigError, match=key) as info:
            BrokerConfig(**{key: value}).validate()
        assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3Server]:
    with moto_s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


class TestS3Offloader(OffloaderContract):
    @pytest.fixture
    def offloader(
        self, moto: MotoS3Server, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
    ) -> S3Offloader:
        for key, value in moto.env().items():
            monkeypatch.setenv(key, value)
        bucket = "b-" + request.node.name.replace("_", "-").lower()[:50]
        moto.create_bucket(bucket)
        return make_s3(
            BrokerConfig(
                managed_ledger_offload_driver="s3",
                s3_managed_ledger_offload_bucket=bucket,
                s3_managed_ledger_offload_region="us-east-1",
                s3_managed_ledger_offload_service_endpoint=moto.endpoint,
            )
        )

    async def test_objects_are_data_then_index(
        self, offloader: S3Offloader, moto: MotoS3Server
    ) -> None:
        location = await offloader.offload("persistent/t/ns/x/9", 9, batches(segment_entries(5)))
        assert location["bucket"] == offloader.bucket
        assert sorted(moto.objects(offloader.bucket)) == [
            "persistent/t/ns/x/9/data",
            "persistent/t/ns/x/9/index",
        ]


async def test_s3_store_down_is_a_retriable_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = MotoS3Server(tmp_path / "moto")
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    offloader = S3Offloader("down", region="us-east-1", endpoint=server.endpoint)  # not started
    with pytest.raises(OffloadError) as info:
        await offloader.offload("t/1", 1, batches(segment_entries(5)))
    assert info.value.retriable
    assert "\n" not in str(info.value)


async def test_the_sweeper_walks_an_s3_bucket(
    tmp_path: Path, moto: MotoS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the sweeper over the real S3 listing (ListObjectsV2, a page at a time from a
    # start-after key): an orphan goes, the segments a ledger records stay readable
    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)
    moto.create_bucket("swept")
    async with in_process_standalone(
        tmp_path / "pigeon",
        segment_max_entries=2,
        maintenance_interval_s=3600,
        managed_ledger_offload_driver="s3",
        s3_managed_ledger_offload_bucket="swept",
        s3_managed_ledger_offload_region="us-east-1",
        s3_managed_ledger_offload_service_endpoint=moto.endpoint,
    ) as cluster:
        service = cluster.service
        await service.policies.set(NS, {"offload_threshold_bytes": 0, "retention_time_s": -1})
        values = [f"s3-{i}".encode() * 30 for i in range(6)]
        async with Client(cluster.url) as client:
            await produce(client, "kept", values)
            led = service.topics[PREFIX + "kept"].ledger
            with trio.fail_after(30):
                await led.wait_rolled()  # the last produce's full segment closed
                await led.offload(0)
            recorded = sorted(moto.objects("swept"))
            assert len(recorded) == 2 * (len(led.segments) - 1)
            await service.offloader.offload(
                "persistent/public/default/gone/3", 3, batches(segment_entries(3))
            )
            sweeper = OffloadSweeper(service, grace_s=0, max_objects=3)
            deleted: list[str] = []
            with trio.fail_after(30):
                for _ in range(20):
                    deleted += await sweeper.sweep_once()
                    if not sweeper.after:
                        break
            assert sorted(deleted) == [
                "persistent/public/default/gone/3/data",
                "persistent/public/default/gone/3/index",
            ]
            assert sorted(moto.objects("swept")) == recorded
            led.cache = type(led.cache)(led.cache.max_bytes)
            with trio.fail_after(30):
                assert [m.value for m in await read_all(client, "kept")] == values

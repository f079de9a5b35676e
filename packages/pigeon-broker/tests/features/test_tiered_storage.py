"""Tiered storage end to end (broker + bookie + client in one trio run): closed segments
offloaded to the ``filesystem`` offloader, read back transparently after the bookie
copies are gone, deleted by retention, and a failed upload retried without losing the
bookie copy.  Real time (the offloader works in threads), bounded by ``fail_after``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from standalone_support import NS, PREFIX, produce, read_all, receive_n

from pigeon.broker import FileSystemOffloader
from pigeon.client.trio import Client
from pigeon.core.errors import OffloadError
from pigeon.core.offload import decode_index
from pigeon.core.testing import InProcessStandalone, in_process_standalone

VALUES = [f"offloaded-{i:02d}".encode() * 20 for i in range(12)]


@pytest.fixture
async def tiered(tmp_path: Path) -> AsyncIterator[InProcessStandalone]:
    async with in_process_standalone(
        tmp_path / "pigeon",
        segment_max_entries=2,
        maintenance_interval_s=3600,  # maintenance runs when the test says
        managed_ledger_offload_driver="filesystem",
        offload_directory=str(tmp_path / "tier"),
    ) as cluster:
        yield cluster


def ledger(cluster: InProcessStandalone, topic: str):
    return cluster.service.topics[PREFIX + topic].ledger


async def offload_now(cluster: InProcessStandalone, topic: str) -> None:
    """One maintenance pass and the offload it starts, finished."""
    led = ledger(cluster, topic)
    before = led.offload_status
    await cluster.service.maintain_once()
    with trio.fail_after(30):
        while led.offloading or led.offload_status is before:  # noqa: ASYNC110
            await trio.sleep(0.02)


def objects(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


async def test_offloaded_segments_read_back_exactly(tiered: InProcessStandalone, tmp_path: Path):
    cluster = tiered
    await cluster.service.policies.set(
        NS,
        {"offload_threshold_bytes": 0, "offload_deletion_lag_s": 3600, "retention_time_s": -1},
    )
    async with Client(cluster.url) as client:
        ids = await produce(client, "tiered", VALUES)
        led = ledger(cluster, "tiered")
        await offload_now(cluster, "tiered")
        assert led.offload_status["status"] == "SUCCESS", led.offload_status
        closed = [s for s in led.segments[:-1]]
        assert len(closed) >= 5
        assert all(s.offload is not None and not s.bookies_deleted for s in closed)
        assert led.segments[-1].offload is None  # never the segment being written
        files = objects(tmp_path / "tier")
        assert len(files) == 2 * len(closed)  # data + index per segment
        # past the lag: the bookie copies go; reads come from the tier, byte for byte
        await cluster.service.policies.set(NS, {"offload_deletion_lag_s": 0})
        await cluster.service.maintain_once()
        assert all(s.bookies_deleted for s in closed)
        led.cache = type(led.cache)(led.cache.max_bytes)  # nothing served from memory
        with trio.fail_after(30):
            assert [m.value for m in await read_all(client, "tiered")] == VALUES
            consumer = await client.subscribe("tiered", "s", initial_position="earliest")
            got = await receive_n(consumer, len(VALUES))
            assert [m.value for m in got] == VALUES
            await consumer.seek(ids[3])  # into an offloaded segment
            again = await receive_n(consumer, len(VALUES) - 3)
            assert [m.value for m in again] == VALUES[3:]
            # retention deletes offloaded objects too
            for m in again:
                await consumer.acknowledge(m)
            await cluster.service.policies.set(NS, {"retention_time_s": 0, "retention_size_mb": 0})
        with trio.fail_after(30):
            while len(led.segments) > 1:
                await trio.sleep(0.05)
                await cluster.service.maintain_once()
        assert objects(tmp_path / "tier") == []
        await consumer.close()


async def test_failed_upload_keeps_the_bookie_copy_and_is_retried(
    tiered: InProcessStandalone, tmp_path: Path
):
    cluster = tiered
    (tmp_path / "tier").write_bytes(b"not a directory")  # the store fails
    await cluster.service.policies.set(
        NS, {"offload_threshold_bytes": 0, "offload_deletion_lag_s": 0, "retention_time_s": -1}
    )
    async with Client(cluster.url) as client:
        await produce(client, "retried", VALUES)
        led = ledger(cluster, "retried")
        await offload_now(cluster, "retried")
        assert led.offload_status["status"] == "ERROR"
        assert "tier" in led.offload_status["last_error"]
        assert all(s.offload is None and not s.bookies_deleted for s in led.segments)
        with trio.fail_after(30):
            assert [m.value for m in await read_all(client, "retried")] == VALUES
        (tmp_path / "tier").unlink()  # the store is back
        await offload_now(cluster, "retried")
        await cluster.service.maintain_once()  # lag 0: bookie copies released
        assert led.offload_status["status"] == "SUCCESS", led.offload_status
        assert all(s.bookies_deleted for s in led.segments[:-1])
        led.cache = type(led.cache)(led.cache.max_bytes)
        with trio.fail_after(30):
            assert [m.value for m in await read_all(client, "retried")] == VALUES


async def test_one_damaged_offloaded_entry_costs_that_entry_alone(tmp_path: Path):
    # the bookie copies are gone: the damage run must come from the offloaded copy, not
    # from bookies that no longer hold the segment (they know no entry of it)
    async with in_process_standalone(
        tmp_path / "pigeon",
        segment_max_entries=6,
        maintenance_interval_s=3600,
        managed_ledger_offload_driver="filesystem",
        offload_directory=str(tmp_path / "tier"),
    ) as cluster:
        await cluster.service.policies.set(
            NS, {"offload_threshold_bytes": 0, "offload_deletion_lag_s": 0, "retention_time_s": -1}
        )
        async with Client(cluster.url) as client:
            await produce(client, "rot", VALUES)
            led = ledger(cluster, "rot")
            await offload_now(cluster, "rot")
            await cluster.service.maintain_once()  # lag 0: bookie copies released
            first = led.segments[0]
            assert first.bookies_deleted and first.entries == 6
            # entry 2 of the first segment rots in the object store
            key = tmp_path / "tier" / first.offload["key"]
            index = decode_index((key / "index").read_bytes())
            data = bytearray((key / "data").read_bytes())
            data[index.offsets[2] + 5] ^= 0xFF
            (key / "data").write_bytes(bytes(data))
            led.cache = type(led.cache)(led.cache.max_bytes)
            led.offloader._ranges.clear()
            with trio.fail_after(30):
                run = await led.skip_damaged((first.id, 2))
                assert (run.first_entry, run.last_entry, run.next) == (2, 2, (first.id, 3))
                consumer = await client.subscribe("rot", "s", initial_position="earliest")
                got = await receive_n(consumer, len(VALUES) - 1)
            assert [m.value for m in got] == VALUES[:2] + VALUES[3:]
            await consumer.close()


async def test_offloaded_segments_in_another_store_are_not_skipped(
    tiered: InProcessStandalone, tmp_path: Path
):
    # the broker restarted with another offload directory (or driver, or bucket): the
    # offloaded segments are not there, which is no damage to skip but a retriable error
    # until the store the metadata names is back
    cluster = tiered
    await cluster.service.policies.set(
        NS, {"offload_threshold_bytes": 0, "offload_deletion_lag_s": 0, "retention_time_s": -1}
    )
    async with Client(cluster.url) as client:
        await produce(client, "moved", VALUES)
        led = ledger(cluster, "moved")
        await offload_now(cluster, "moved")
        await cluster.service.maintain_once()  # lag 0: bookie copies released
        first = led.segments[0]
        assert first.bookies_deleted
        right = led.offloader
        led.offloader = FileSystemOffloader(tmp_path / "elsewhere")
        led.cache = type(led.cache)(led.cache.max_bytes)
        with trio.fail_after(30):
            with pytest.raises(OffloadError, match=str(tmp_path / "tier")) as info:
                await led.read((first.id, 0))
            assert info.value.retriable and "\n" not in str(info.value)
            with pytest.raises(OffloadError):  # retriable: nothing skipped, nothing acked
                await client.subscribe("moved", "s", initial_position="earliest")
            led.offloader = right  # the right store is back
            consumer = await client.subscribe("moved", "s", initial_position="earliest")
            got = await receive_n(consumer, len(VALUES))
        assert [m.value for m in got] == VALUES
        await consumer.close()

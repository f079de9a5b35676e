"""Tiered storage end to end (broker + bookie + client in one trio run): closed segments
offloaded to the ``filesystem`` offloader, read back transparently after the bookie
copies are gone, deleted by retention, a failed upload retried without losing the
bookie copy, a damaged segment skipped (and retried) without holding back the ones after
it, and no object left behind by an upload that a topic deletion or retention overtook.
Real time (the offloader works in threads), bounded by ``fail_after``; where a test
needs a backoff to pass, the ledger's clock is moved ahead."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from standalone_support import NS, PREFIX, produce, read_all, receive_n

from pigeon.bookie.testing import flip_payload_byte, segment_file
from pigeon.broker import FileSystemOffloader
from pigeon.broker._admin_ops import topic_stats
from pigeon.broker._admin_topics import offload_status, offload_topic
from pigeon.broker._lifecycle import delete_topic, unload_topic
from pigeon.broker._metrics import BrokerMonitor
from pigeon.broker._offload_sweeper import OffloadSweeper
from pigeon.client.trio import Client
from pigeon.core import TopicName
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


async def settled(cluster: InProcessStandalone, topic: str):
    """The topic's ledger once the roll its last produce began is over (the full
    segment closed, the next one open): its closed segments are all there are."""
    led = ledger(cluster, topic)
    with trio.fail_after(30):
        await led.wait_rolled()
    return led


async def offload_now(cluster: InProcessStandalone, topic: str) -> None:
    """One maintenance pass and the offload it starts, finished."""
    led = await settled(cluster, topic)
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
        led = await settled(cluster, "tiered")
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


class AheadClock:
    """The ledger's wall clock, moved ahead by the test (the backoff of a damaged
    segment passes without waiting, and without expiring the metadata session)."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.ahead_ms = 0

    def now_ms(self) -> int:
        return int(self.clock.now_ms()) + self.ahead_ms


async def test_a_damaged_segment_is_skipped_and_retried_without_holding_back_the_rest(
    tiered: InProcessStandalone, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    cluster = tiered
    caplog.set_level(logging.INFO, logger="pigeon.broker._ledger")
    await cluster.service.policies.set(
        NS, {"offload_threshold_bytes": 0, "offload_deletion_lag_s": 0, "retention_time_s": -1}
    )
    async with Client(cluster.url) as client:
        await produce(client, "rotten", VALUES)
        led = await settled(cluster, "rotten")
        led.clock = clock = AheadClock(led.clock)
        closed = led.segments[:-1]
        assert len(closed) >= 5
        # entry 1 of the second segment rots on its bookie (the only replica)
        bad = closed[1]
        bookie = tmp_path / "pigeon" / "bookie"
        flip_payload_byte(segment_file(bookie, bad.id), 1, bad.id)
        led.cache = type(led.cache)(led.cache.max_bytes)  # nothing served from memory
        name = TopicName.parse(PREFIX + "rotten")

        await offload_now(cluster, "rotten")
        await cluster.service.maintain_once()  # lag 0: bookie copies of the others released
        # every other closed segment is offloaded, before and after the damaged one
        assert [s.id for s in closed if s.offload is None] == [bad.id]
        assert all(s.bookies_deleted for s in closed if s is not bad)
        assert not bad.bookies_deleted  # the damaged one keeps its bookie copies
        status = await offload_status(cluster.service, name)
        assert status["status"] == "ERROR"
        assert f"segment {bad.id} not offloaded" in status["last_error"]
        (damaged,) = status["damaged_segments"]
        assert damaged["segment"] == bad.id and damaged["entry"] == 1
        assert "no replica intact" in damaged["error"] and damaged["attempts"] == 1
        assert 0 < damaged["retry_in_s"] <= 60
        assert status["offloaded_segments"] == len(closed) - 1
        assert status["first_unoffloaded_message_id"] == f"{bad.id}:0"

        # before its backoff is over, maintenance does not try it again
        await cluster.service.maintain_once()
        assert not led.offloading
        assert (await offload_status(cluster.service, name))["damaged_segments"][0]["attempts"] == 1
        # after it, it is retried: still damaged, a longer backoff, no second WARNING
        clock.ahead_ms += 61_000
        await offload_now(cluster, "rotten")
        (damaged,) = (await offload_status(cluster.service, name))["damaged_segments"]
        assert damaged["attempts"] == 2 and 60 < damaged["retry_in_s"] <= 120
        warnings = [
            r
            for r in caplog.records
            if r.levelno >= logging.WARNING and "not offloaded" in r.message
        ]
        assert len(warnings) == 1 and f"segment={bad.id}" in warnings[0].getMessage()

        # repaired (the bit flipped back): a manual offload retries it at once
        led.clock = clock.clock
        flip_payload_byte(segment_file(bookie, bad.id), 1, bad.id)
        await offload_topic(cluster.service, name, 0)
        with trio.fail_after(30):
            while led.offloading or led.offload_status["status"] == "RUNNING":  # noqa: ASYNC110
                await trio.sleep(0.02)
        status = await offload_status(cluster.service, name)
        assert status["status"] == "SUCCESS", status
        assert status["damaged_segments"] == []
        assert bad.offload is not None
        await cluster.service.maintain_once()
        assert all(s.bookies_deleted for s in closed)
        led.cache = type(led.cache)(led.cache.max_bytes)
        with trio.fail_after(30):
            assert [m.value for m in await read_all(client, "rotten")] == VALUES


@pytest.mark.parametrize("policy", ["skip", "fail"])
async def test_a_damaged_segment_between_offloaded_ones_is_read_as_the_policy_says(
    tiered: InProcessStandalone, tmp_path: Path, policy: str
):
    # the damaged segment stays on its bookies between segments read from the tier: a
    # consumer walks tier -> bookies -> tier without noticing, and the damaged entry is
    # treated as on a topic never offloaded (skip: its message lost; fail: delivery
    # stops there until the operator says otherwise)
    cluster = tiered
    await cluster.service.policies.set(
        NS,
        {
            "offload_threshold_bytes": 0,
            "offload_deletion_lag_s": 0,
            "retention_time_s": -1,
            "corrupt_entry_policy": policy,
        },
    )
    name = TopicName.parse(PREFIX + "mixed")
    async with Client(cluster.url) as client:
        await produce(client, "mixed", VALUES)
        led = await settled(cluster, "mixed")
        closed = led.segments[:-1]
        bad = closed[2]  # entries 0, 1: messages 4 and 5
        flip_payload_byte(segment_file(tmp_path / "pigeon" / "bookie", bad.id), 0, bad.id)
        led.cache = type(led.cache)(led.cache.max_bytes)
        await offload_now(cluster, "mixed")
        await cluster.service.maintain_once()  # lag 0: the others' bookie copies go
        assert [s.id for s in closed if not s.bookies_deleted] == [bad.id]
        assert all(s.bookies_deleted for s in closed[:2] + closed[3:])
        # never offloaded partially: nothing of it in the store
        bad_key = f"{led.topic.path}/{bad.id}/"
        assert [p for p in objects(tmp_path / "tier") if p.startswith(bad_key)] == []
        consumer = await client.subscribe("mixed", "s", initial_position="earliest")
        with trio.fail_after(30):
            if policy == "skip":
                got = await receive_n(consumer, len(VALUES) - 1)
                assert [m.value for m in got] == VALUES[:4] + VALUES[5:]
            else:
                got = await receive_n(consumer, 4)
                assert [m.value for m in got] == VALUES[:4]
                for m in got:
                    await consumer.acknowledge(m)
                for _ in range(600):  # delivery stops at the damage: read_error says why
                    sub = (await topic_stats(cluster.service, None, name))["subscriptions"]["s"]
                    if sub["read_error"]:
                        break
                    await trio.sleep(0.05)
                assert f"segment {bad.id} entry 0" in sub["read_error"]
                # the operator lets it skip: the rest comes, from the bookies and the tier
                await cluster.service.policies.set(NS, {"corrupt_entry_policy": "skip"})
                rest = await receive_n(consumer, len(VALUES) - 5)
                assert [m.value for m in rest] == VALUES[5:]
        await consumer.close()


class GatedOffloader(FileSystemOffloader):
    """A ``filesystem`` offloader whose first upload, its data object written, waits for
    the test before it writes the index (the upload is under way while the test
    deletes or trims, and completes after)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.started = trio.Event()
        self.release = trio.Event()
        self.uploads = 0

    async def _write_object(self, path: str, chunks: Any) -> None:
        if path.endswith("/index") and not self.started.is_set():
            self.started.set()
            await self.release.wait()
        await super()._write_object(path, chunks)

    async def offload(self, key: str, segment_id: int, entries: Any) -> dict[str, Any]:
        location = await super().offload(key, segment_id, entries)
        self.uploads += 1
        return location


async def gated_upload(cluster: InProcessStandalone, topic: str, root: Path) -> GatedOffloader:
    """``VALUES`` in ``topic``, and its first segment's upload started and held."""
    await cluster.service.policies.set(
        NS, {"offload_threshold_bytes": 0, "offload_deletion_lag_s": 3600, "retention_time_s": -1}
    )
    async with Client(cluster.url) as client:
        await produce(client, topic, VALUES)
    led = ledger(cluster, topic)
    led.offloader = gate = GatedOffloader(root)
    await cluster.service.maintain_once()  # starts the offload in the background
    with trio.fail_after(30):
        await gate.started.wait()
    return gate


async def test_an_upload_overtaken_by_the_topic_deletion_leaves_no_object(
    tiered: InProcessStandalone, tmp_path: Path
):
    cluster = tiered
    gate = await gated_upload(cluster, "doomed", tmp_path / "tier")
    led = ledger(cluster, "doomed")
    await delete_topic(cluster.service, TopicName.parse(PREFIX + "doomed"), force=True)
    gate.release.set()  # the upload writes its objects after the topic is gone
    with trio.fail_after(30):
        while led.offloading:  # noqa: ASYNC110
            await trio.sleep(0.02)
    assert gate.uploads == 1
    assert objects(tmp_path / "tier") == []  # deleted: nothing refers to them


async def test_an_upload_overtaken_by_retention_leaves_no_object(
    tiered: InProcessStandalone, tmp_path: Path
):
    cluster = tiered
    async with Client(cluster.url) as client:
        consumer = await client.subscribe("trimmed", "s", initial_position="earliest")
        gate = await gated_upload(cluster, "trimmed", tmp_path / "tier")
        for m in await receive_n(consumer, len(VALUES)):
            await consumer.acknowledge(m)
        led = ledger(cluster, "trimmed")
        first = led.segments[0]
        await cluster.service.policies.set(NS, {"retention_time_s": 0, "retention_size_mb": 0})
        with trio.fail_after(30):
            while led.index_of_segment(first.id) is not None:
                await trio.sleep(0.05)
                await cluster.service.maintain_once()
        gate.release.set()  # the upload of a trimmed segment completes
        with trio.fail_after(30):
            while led.offloading:  # noqa: ASYNC110
                await trio.sleep(0.02)
        assert gate.uploads == 1
        assert objects(tmp_path / "tier") == []
        await consumer.close()


async def test_an_upload_whose_segment_is_still_referenced_keeps_its_object(
    tiered: InProcessStandalone, tmp_path: Path
):
    # another broker took the ledger over during the upload, and recorded the same
    # segment offloaded under the same key: this upload's save is refused, and the
    # objects (the other owner's now) must stay
    cluster = tiered
    gate = await gated_upload(cluster, "taken", tmp_path / "tier")
    led = ledger(cluster, "taken")
    first = led.segments[0]
    store = cluster.service.store
    stat = await store.get(led.path)
    doc = json.loads(stat.value)
    doc["segments"][0]["offload"] = {
        "driver": "filesystem",
        "key": f"{led.topic.path}/{first.id}",
        "root": str(tmp_path / "tier"),
    }
    doc["segments"].append({**doc["segments"][-1], "id": first.id + 1000})  # not ours
    await store.set(led.path, json.dumps(doc).encode())
    gate.release.set()
    with trio.fail_after(30):
        while led.offloading:  # noqa: ASYNC110
            await trio.sleep(0.02)
    assert led.offload_status["status"] == "ERROR"  # ownership lost
    key = tmp_path / "tier" / f"{led.topic.path}/{first.id}"
    assert sorted(p.name for p in key.iterdir()) == ["data", "index"]


class DeletesFail(FileSystemOffloader):
    """A ``filesystem`` offloader whose deletes fail (the store is down for them)."""

    async def _delete_objects(self, paths: Any) -> None:
        raise OffloadError("the store refuses deletes")


async def test_objects_of_removed_segments_are_deleted_by_the_next_owner(
    tiered: InProcessStandalone, tmp_path: Path
):
    # retention drops segments from the metadata, then cannot delete their objects (a
    # crash there is the same): the intent saved with the removal makes the next owner
    # delete them, instead of leaving orphans nothing refers to
    cluster = tiered
    service = cluster.service
    name = TopicName.parse(PREFIX + "removed")
    await service.policies.set(
        NS,
        {
            "offload_threshold_bytes": 0,
            "offload_deletion_lag_s": 0,
            "retention_time_s": -1,
            "retention_size_mb": -1,
        },
    )
    async with Client(cluster.url) as client:
        consumer = await client.subscribe("removed", "s", initial_position="earliest")
        await produce(client, "removed", VALUES)
        for m in await receive_n(consumer, len(VALUES)):
            await consumer.acknowledge(m)
        await consumer.close()
    led = ledger(cluster, "removed")
    await offload_now(cluster, "removed")
    closed = len(led.segments) - 1
    assert len(objects(tmp_path / "tier")) == 2 * closed
    working, service.offloader = service.offloader, DeletesFail(tmp_path / "tier")
    await service.policies.set(NS, {"retention_time_s": 0, "retention_size_mb": 0})
    with trio.fail_after(30):
        while len(led.segments) > 1:
            await trio.sleep(0.05)
            await service.maintain_once()
    assert len(objects(tmp_path / "tier")) == 2 * closed  # not deleted...
    stored = json.loads((await service.store.get(led.path)).value)
    assert len(stored["offload_deleting"]) == closed  # ...but the intent is recorded
    assert len(led.internal_stats()["offload_deleting"]) == closed  # and shown
    # the store is back.  The topic moves to another owner (a restart is the same),
    # which deletes them; a topic never loaded again is left to the sweeper
    service.offloader = working
    await unload_topic(service, name)
    await service.get_topic(name)
    await service.maintain_once()
    assert objects(tmp_path / "tier") == []
    stored = json.loads((await service.store.get(ledger(cluster, "removed").path)).value)
    assert "offload_deleting" not in stored


def plant(root: Path, key: str) -> None:
    """Objects left under ``key`` (as a crash would leave them)."""
    (root / key).mkdir(parents=True)
    (root / key / "data").write_bytes(b"d" * 10)
    (root / key / "index").write_bytes(b"i" * 10)


async def test_the_sweeper_deletes_orphans_and_never_an_object_in_use(
    tiered: InProcessStandalone, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    cluster = tiered
    caplog.set_level(logging.INFO, logger="pigeon.broker._offload_sweeper")
    root = tmp_path / "tier"
    # an upload in flight: its data object written, its index not yet, nothing recorded
    gate = await gated_upload(cluster, "busy", root)
    led = ledger(cluster, "busy")
    in_flight = f"{led.topic.path}/{led.segments[0].id}"
    assert objects(root) == [f"{in_flight}/data"]
    # orphans: a segment of a topic deleted since, a segment this topic no longer has
    plant(root, "persistent/public/default/gone/5")
    plant(root, f"{led.topic.path}/99999")
    # not ours: another cluster's namespace, and a file that is not a segment's object
    plant(root, "persistent/public/elsewhere/t/5")
    (root / "persistent/public/default/gone/notes.txt").write_text("the operator's")
    # a removed segment whose objects its owner has still to delete (offload_deleting)
    removed = f"{led.topic.path}/77777"
    plant(root, removed)
    store = cluster.service.store
    stat = await store.get(led.path)
    doc = json.loads(stat.value)
    doc["offload_deleting"] = [{"driver": "filesystem", "key": removed}]
    await store.set(led.path, json.dumps(doc).encode(), version=stat.version)
    orphans = [
        f"{k}/{n}"
        for k in ("persistent/public/default/gone/5", f"{led.topic.path}/99999", removed)
        for n in ("data", "index")
    ]
    # within the grace period nothing goes
    assert await OffloadSweeper(cluster.service, grace_s=3600).sweep_once() == []
    # past it (grace 0: every object is old enough), a walk of small pages (bounded
    # work per pass) deletes the orphans and keeps the upload's object
    sweeper = OffloadSweeper(cluster.service, grace_s=0, max_objects=3)
    cluster.service.offload_sweeper = sweeper  # as if elected (its counters at /metrics)
    deleted: list[str] = []
    for _ in range(10):
        listed = sweeper.statistics().objects_listed
        deleted += await sweeper.sweep_once()
        assert sweeper.statistics().objects_listed - listed <= 3
        if not sweeper.after:
            break
    assert sorted(deleted) == sorted(orphans)
    assert objects(root) == sorted(
        [
            f"{in_flight}/data",
            "persistent/public/default/gone/notes.txt",
            "persistent/public/elsewhere/t/5/data",
            "persistent/public/elsewhere/t/5/index",
        ]
    )
    logged = [r.getMessage() for r in caplog.records if "orphaned offloaded object" in r.message]
    assert len(logged) == len(orphans) and all("deleted" in m for m in logged)
    metrics = BrokerMonitor(cluster.service).render().decode()
    assert f"pigeon_broker_offload_orphans_deleted_total {len(orphans)}.0" in metrics
    # the upload completes and is recorded; its segment reads back from the tier
    gate.release.set()
    with trio.fail_after(30):
        while led.offloading:  # noqa: ASYNC110
            await trio.sleep(0.02)
    assert led.segments[0].offload is not None
    assert await sweeper.sweep_once() == []  # recorded: still never swept
    await cluster.service.policies.set(NS, {"offload_deletion_lag_s": 0})
    await cluster.service.maintain_once()
    assert led.segments[0].bookies_deleted
    led.cache = type(led.cache)(led.cache.max_bytes)
    async with Client(cluster.url) as client:
        with trio.fail_after(30):
            assert [m.value for m in await read_all(client, "busy")] == VALUES

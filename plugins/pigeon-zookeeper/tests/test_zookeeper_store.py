"""pigeon-zookeeper against a real ZooKeeper: the contract suite, plus what only it does."""

from __future__ import annotations

import uuid
from functools import partial
from pathlib import Path

import pytest
import trio
from pigeon_zookeeper import ZooKeeperMetadataStore
from pigeon_zookeeper._plan import Layout, NodeInfo, Snapshot, decode_entry, encode_entry, plan

from pigeon.core import PluginManager
from pigeon.core.errors import (
    BadVersion,
    ConfigError,
    CorruptFrame,
    InvalidArgument,
    MetadataError,
    NotEmpty,
    SessionExpired,
)
from pigeon.core.metadata import Create, EventType, NeedRead, Op, Stat, WatchEvent
from pigeon.core.testing import (
    MetadataServerContract,
    MetadataStoreFactory,
    kill_ephemeral_owner,
    store_factory,
)
from pigeon.core.testing import running_store as running
from pigeon.core.testing.servers import ZooKeeperServer, zookeeper_server

WAIT = 20.0
SESSION_TIMEOUT = 4.0


def new_store(server: ZooKeeperServer, chroot: str = "/contract") -> ZooKeeperMetadataStore:
    return ZooKeeperMetadataStore(server.address, chroot, session_timeout=SESSION_TIMEOUT)


@pytest.fixture
def metadata_store_factory_zk(zookeeper: ZooKeeperServer) -> MetadataStoreFactory:
    return store_factory(partial(new_store, zookeeper))


class TestZooKeeperContract(MetadataServerContract):
    server_fixture = "zookeeper"
    store_class = ZooKeeperMetadataStore
    session_timeout = SESSION_TIMEOUT


# --- plugin registration and URLs -------------------------------------------------------


def test_registered_through_entry_point() -> None:
    """(The contract checks that ``zk://`` URLs reach ZooKeeperMetadataStore.from_url.)"""
    assert "zookeeper" in PluginManager().plugin_names()  # the installed "pigeon" entry points


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("zk://127.0.0.1:2181/pigeon", {"hosts": "127.0.0.1:2181", "chroot": "/pigeon"}),
        ("zk://a:1,b:2/x/y", {"hosts": "a:1,b:2", "chroot": "/x/y"}),
        ("zk://zk1", {"hosts": "zk1:2181", "chroot": "/pigeon"}),
        ("zk://zk1:2181/", {"hosts": "zk1:2181", "chroot": "/pigeon"}),
        (
            "zk://h:1/c?session_timeout=2.5&connect_timeout=3&request_timeout=4",
            {"session_timeout": 2.5, "connect_timeout": 3, "request_timeout": 4},
        ),
    ],
)
def test_from_url(url: str, expected: dict[str, object]) -> None:
    store = ZooKeeperMetadataStore.from_url(url)
    assert {name: getattr(store, name) for name in expected} == expected


@pytest.mark.parametrize(
    "url",
    [
        "etcd://h:1/x",
        "zk:///x",
        "zk://h:port/x",
        "zk://h:1/x?nope=1",
        "zk://h:1/x?session_timeout=soon",
        "zk://h:1/x?session_timeout=-1",
        "zk://h:1/a//b",
    ],
)
def test_from_url_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        ZooKeeperMetadataStore.from_url(url)


async def test_unreachable_server_fails_run() -> None:
    store = ZooKeeperMetadataStore("127.0.0.1:1", "/x", connect_timeout=0.5)
    with trio.fail_after(WAIT), pytest.raises(MetadataError, match="cannot connect"):
        await store.run()


# --- change log -----------------------------------------------------------------------------


async def test_watchers_follow_the_log_across_buckets_and_trimming(
    zookeeper: ZooKeeperServer,
) -> None:
    chroot = f"/buckets-{uuid.uuid4().hex[:8]}"
    writer, reader = new_store(zookeeper, chroot), new_store(zookeeper, chroot)
    writer.log_bucket_size = reader.log_bucket_size = 4
    writer.log_retention = 0.0
    async with running(writer), running(reader), reader.watch("/n") as events:
        await writer.create("/n", b"0")
        for i in range(1, 15):
            await writer.set("/n", str(i).encode())
        with trio.fail_after(WAIT):
            assert await anext(events) == WatchEvent(EventType.CREATED, "/n", b"0", 0)
            for i in range(1, 15):
                assert await anext(events) == WatchEvent(
                    EventType.CHANGED, "/n", str(i).encode(), i
                )
        assert await writer.trim_log() >= 2  # all but the current and the previous bucket
        await writer.set("/n", b"after trim")
        with trio.fail_after(WAIT):
            assert (await anext(events)).value == b"after trim"
        position = reader.statistics().log_position
        assert position is not None and position[0] >= 3


async def test_expired_session_nodes_logged_by_reaper(
    metadata_store_factory_zk: MetadataStoreFactory,
) -> None:
    base = f"/pigeon-tests/{uuid.uuid4().hex[:8]}"
    async with metadata_store_factory_zk() as observer, metadata_store_factory_zk() as owner:
        assert isinstance(owner, ZooKeeperMetadataStore)
        old_session = owner.session_id
        names = [
            await owner.create(f"{base}/e-", b"", ephemeral=True, sequential=True) for _ in range(3)
        ]
        async with observer.watch(base, prefix=True) as events:
            await owner.expire_session()
            with trio.fail_after(WAIT):
                deleted = {(await anext(events)).path for _ in range(3)}
        assert deleted == set(names)
        assert await observer.children(base) == []
        await owner.new_session()
        assert owner.session_id not in (None, old_session)
        assert isinstance(observer, ZooKeeperMetadataStore)
        assert observer.session_alive


async def test_crashed_owner_nodes_reported_after_session_timeout(
    zookeeper: ZooKeeperServer, metadata_store_factory_zk: MetadataStoreFactory
) -> None:
    """A process killed with -9: ZooKeeper expires its session, a reaper logs the
    deletion of its ephemeral node, watchers see it."""
    base = f"/pigeon-tests/{uuid.uuid4().hex[:8]}"
    async with (
        metadata_store_factory_zk() as observer,
        observer.watch(base, prefix=True) as events,
    ):
        await kill_ephemeral_owner(zookeeper.url("/contract", session_timeout=1), f"{base}/a")
        with trio.fail_after(WAIT):
            seen = [await anext(events) for _ in range(3)]
        assert [(e.type, e.path) for e in seen] == [
            (EventType.CREATED, base),
            (EventType.CREATED, f"{base}/a"),
            (EventType.DELETED, f"{base}/a"),
        ]
        assert await observer.children(base) == []


# --- server restarts ----------------------------------------------------------------------------


async def test_call_during_outage_waits_for_the_server(tmp_path: Path) -> None:
    with zookeeper_server(tmp_path / "zk") as server:
        store = ZooKeeperMetadataStore(server.address, "/outage", session_timeout=8.0)
        async with running(store):
            await store.create("/o", b"0")
            await trio.to_thread.run_sync(lambda: server.stop(kill=True))
            async with trio.open_nursery() as nursery:
                result: list[int] = []

                async def write() -> None:
                    result.append(await store.set("/o", b"1"))

                nursery.start_soon(write)
                await trio.sleep(0.5)
                assert not result  # blocked: no server
                await trio.to_thread.run_sync(server.start)
            assert result == [1]
            assert await store.get("/o") == Stat(b"1", 1, False)


# --- the planner and the log format (no server) ------------------------------------------------


def test_log_entry_round_trip() -> None:
    events = [
        WatchEvent(EventType.CREATED, "/a", b"", 0),
        WatchEvent(EventType.CHANGED, "/a/ü", bytes(range(256)), 7),
        WatchEvent(EventType.DELETED, "/a", None, -1),
    ]
    data = encode_entry(events)
    assert decode_entry(data) == events
    with pytest.raises(CorruptFrame):
        decode_entry(data[:-1])
    with pytest.raises(CorruptFrame):
        decode_entry(b"XXXX" + data[4:])


def test_plan_create_with_parents_and_sequential() -> None:
    layout = Layout("/c")
    snap = Snapshot()
    with pytest.raises(NeedRead) as need:
        plan(layout, [Create("/a/b/q-", b"v", sequential=True)], snap, None)
    assert need.value.nodes == {"/a/b", "/a"}
    snap.nodes.update({"/a/b": NodeInfo(False), "/a": NodeInfo(True)})
    with pytest.raises(NeedRead) as need:
        plan(layout, [Create("/a/b/q-", b"v", sequential=True)], snap, None)
    assert need.value.counters == {"/a/b"}
    snap.counters["/a/b"] = None
    result = plan(layout, [Create("/a/b/q-", b"v", sequential=True)], snap, None)
    assert result.results == ["/a/b/q-0000000000"]
    assert [(op.kind, op.path) for op in result.ops] == [
        ("create", "/c/tree/a/b"),
        ("create", "/c/seq/%2Fa%2Fb"),
        ("create", "/c/tree/a/b/q-0000000000"),
    ]
    assert [(e.type, e.path) for e in result.events] == [
        (EventType.CREATED, "/a/b"),
        (EventType.CREATED, "/a/b/q-0000000000"),
    ]
    snap.counters["/a/b"] = 41  # the counter znode's version: the last number given
    result = plan(layout, [Create("/a/b/q-", b"v", sequential=True)], snap, None)
    assert result.results == ["/a/b/q-0000000042"]


def test_plan_errors_first_failing_op_wins() -> None:
    layout = Layout("/c")
    snap = Snapshot(
        nodes={"/x": NodeInfo(True, 3, 0, 1), "/e": NodeInfo(True, 0, 1234, 0)},
        counters={"/x": None, "/e": None},
    )
    with pytest.raises(BadVersion):
        plan(layout, [Op.set("/x", b"", 2), Op.delete("/x")], snap, "00000000000004d2")
    with pytest.raises(NotEmpty):
        plan(layout, [Op.set("/x", b"", 3), Op.delete("/x")], snap, "00000000000004d2")
    with pytest.raises(InvalidArgument):
        plan(layout, [Op.create("/e/child")], snap, "00000000000004d2")
    with pytest.raises(SessionExpired):
        plan(layout, [Create("/y", b"", ephemeral=True)], snap, None)

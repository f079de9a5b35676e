"""pigeon-etcd against a real etcd: the contract suite, plus what only it does."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import trio
from pigeon_etcd import EtcdMetadataStore
from pigeon_etcd._plan import Keys, decode_value, encode_value

from pigeon.core import PluginManager
from pigeon.core.errors import ConfigError, CorruptFrame, InvalidArgument, MetadataError
from pigeon.core.metadata import EventType, Op, Stat, WatchEvent
from pigeon.core.testing import MetadataServerContract, kill_ephemeral_owner
from pigeon.core.testing import running_store as running
from pigeon.core.testing.servers import EtcdServer, etcd_server

WAIT = 20.0
SESSION_TIMEOUT = 3.0


class TestEtcdContract(MetadataServerContract):
    server_fixture = "etcd"
    store_class = EtcdMetadataStore
    session_timeout = SESSION_TIMEOUT


# --- plugin registration and URLs -------------------------------------------------------


def test_registered_through_entry_point() -> None:
    """(The contract checks that ``etcd://`` URLs reach EtcdMetadataStore.from_url.)"""
    assert "etcd" in PluginManager().plugin_names()  # the installed "pigeon" entry points


def test_plugin_import_does_not_load_grpc() -> None:
    code = (
        "import sys, os; from pigeon.core import PluginManager; PluginManager(); "
        "import pigeon_etcd; "
        "print(sorted(m for m in ('etcd3', 'grpc', 'google.protobuf') if m in sys.modules),"
        " os.environ.get('PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[] None"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("etcd://127.0.0.1:2379/pigeon", {"target": "127.0.0.1:2379", "prefix": "/pigeon"}),
        (
            "etcd://10.0.0.1:1,10.0.0.2:2/x/y",
            {"target": "ipv4:10.0.0.1:1,10.0.0.2:2", "prefix": "/x/y"},
        ),
        ("etcd://etcd1", {"target": "etcd1:2379", "prefix": "/pigeon"}),
        ("etcd://etcd1:2379/", {"target": "etcd1:2379", "prefix": "/pigeon"}),
        (
            "etcd://h:1/p?session_timeout=2.5&request_timeout=4",
            {"session_timeout": 2.5, "request_timeout": 4},
        ),
    ],
)
def test_from_url(url: str, expected: dict[str, object]) -> None:
    store = EtcdMetadataStore.from_url(url)
    assert {name: getattr(store, name) for name in expected} == expected


@pytest.mark.parametrize(
    "url",
    [
        "zk://h:1/x",
        "etcd:///x",
        "etcd://h:port/x",
        "etcd://h:1/x?nope=1",
        "etcd://h:1/x?session_timeout=soon",
        "etcd://h:1/x?request_timeout=0",
        "etcd://h:1/a//b",
    ],
)
def test_from_url_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        EtcdMetadataStore.from_url(url)


async def test_unreachable_server_fails_run() -> None:
    store = EtcdMetadataStore("127.0.0.1:1", "/x", request_timeout=0.5)
    with trio.fail_after(WAIT), pytest.raises(MetadataError, match="did not answer"):
        await store.run()


# --- etcd specifics ---------------------------------------------------------------------------


async def test_root_always_exists_and_can_be_set(etcd: EtcdServer) -> None:
    prefix = f"/root-{uuid.uuid4().hex[:8]}"
    async with running(EtcdMetadataStore(etcd.address, prefix)) as store:
        assert await store.get("/") == Stat(b"", 0, False)
        async with store.watch("/") as events:
            assert await store.set("/", b"top", version=0) == 1
            with trio.fail_after(WAIT):
                assert await anext(events) == WatchEvent(EventType.CHANGED, "/", b"top", 1)
        assert await store.get("/") == Stat(b"top", 1, False)
        with pytest.raises(InvalidArgument):
            await store.delete("/")


async def test_multi_touching_one_node_twice(etcd: EtcdServer) -> None:
    prefix = f"/twice-{uuid.uuid4().hex[:8]}"
    async with running(EtcdMetadataStore(etcd.address, prefix)) as store:
        results = await store.multi([Op.create("/n", b"a"), Op.set("/n", b"b", version=0)])
        assert results == ["/n", 1]
        assert await store.get("/n") == Stat(b"b", 1, False)


async def test_crashed_owner_loses_its_nodes_after_the_ttl(etcd: EtcdServer) -> None:
    """A process killed with -9 sends no more keepalives: etcd expires its lease."""
    prefix = f"/crash-{uuid.uuid4().hex[:8]}"
    async with (
        running(EtcdMetadataStore(etcd.address, prefix)) as observer,
        observer.watch("/svc", prefix=True) as events,
    ):
        await kill_ephemeral_owner(etcd.url(prefix, session_timeout=2), "/svc/a")
        with trio.fail_after(WAIT):
            seen = [await anext(events) for _ in range(3)]
        assert [(e.type, e.path) for e in seen] == [
            (EventType.CREATED, "/svc"),
            (EventType.CREATED, "/svc/a"),
            (EventType.DELETED, "/svc/a"),
        ]
        assert seen[2].version == 0  # from etcd's prev_kv
        assert await observer.children("/svc") == []


# --- server restarts ----------------------------------------------------------------------------


async def test_watch_resumes_without_loss_after_restart(tmp_path: Path) -> None:
    with etcd_server(tmp_path / "etcd") as server:
        prefix = "/resume"
        async with (
            running(EtcdMetadataStore(server.address, prefix)) as writer,
            running(EtcdMetadataStore(server.address, prefix)) as reader,
            reader.watch("/w") as events,
        ):
            await writer.create("/w", b"0")
            with trio.fail_after(WAIT):
                assert (await anext(events)).version == 0
            await trio.to_thread.run_sync(lambda: server.restart(kill=True))
            for i in range(1, 6):  # written before the reader's stream is back
                await writer.set("/w", str(i).encode())
            with trio.fail_after(WAIT):
                for i in range(1, 6):
                    assert await anext(events) == WatchEvent(
                        EventType.CHANGED, "/w", str(i).encode(), i
                    )


# --- key layout (no server) ---------------------------------------------------------------------


def test_subtree_is_one_key_range() -> None:
    keys = Keys(b"/p")
    start, end = keys.subtree("/a")
    inside = [keys.node(p) for p in ("/a", "/a/b", "/a/b/c", "/a/\u00ff")]
    outside = [keys.node(p) for p in ("/ab", "/a-1", "/b", "/", "/0")]
    assert all(start <= k < end for k in inside)
    assert not any(start <= k < end for k in outside)
    assert keys.path_of(keys.node("/a/b c")) == "/a/b c"


def test_children_range_holds_direct_children_only() -> None:
    keys = Keys(b"/p")
    start, end = keys.children("/a")
    assert all(start <= keys.child(p) < end for p in ("/a/b", "/a/z", "/a/\x01"))
    assert not any(start <= keys.child(p) < end for p in ("/a/b/c", "/ab/c", "/a", "/b/a"))
    sub_start, sub_end = keys.child_subtree("/a")
    assert all(sub_start <= keys.child(p) < sub_end for p in ("/a/b", "/a/b/c"))
    assert not any(sub_start <= keys.child(p) < sub_end for p in ("/a", "/ab/c"))


def test_value_header_round_trip() -> None:
    raw = encode_value(b"\x00data", 7, 1.5, 2.5)
    assert decode_value(raw) == (b"\x00data", 7, 1.5, 2.5)
    with pytest.raises(CorruptFrame):
        decode_value(b"raw value written by someone else")

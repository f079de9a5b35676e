"""The contract suite every :class:`~pigeon.core.metadata.MetadataStore` backend runs.

Subclass :class:`MetadataStoreContract` in a test module (its name must start with
``Test``) and provide one fixture::

    class TestMyStore(MetadataStoreContract):
        @pytest.fixture
        def new_metadata_store(self, ...) -> Callable[[], MetadataStore]:
            # each call builds a store that is *not running yet*; stores built by one
            # callable share the same data, each with its own session.
            ...

A backend on a real server of :mod:`pigeon.core.testing.servers` (ZooKeeper, etcd)
subclasses :class:`MetadataServerContract` instead: it names the fixture of the running
server the tests share and its store class, and the suite builds ``new_metadata_store``,
``metadata_store_url`` and ``restartable_server`` from them.

The suite runs them (``metadata_store_factory``: ``async with factory() as store:``
yields a running store and closes it on exit; ``metadata_store``: one running store).
``expire_session`` (``await expire_session(store)`` makes the store's session expire as a
lost keepalive would) calls the store's own ``expire_session()``, which the embedded,
ZooKeeper and etcd stores have; override any of these fixtures if needed.
Every test works below its own unique root path, so the suite can run against a shared,
long-lived server.  Waits are bounded by :data:`WAIT` seconds, generous for real servers;
nothing depends on wall-clock speed except the few checks that something does *not*
happen, which wait :data:`QUIET` seconds.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import trio

from pigeon.core import PluginManager
from pigeon.core.errors import (
    BadVersion,
    InvalidArgument,
    MetadataError,
    NodeExists,
    NoSuchNode,
    NotEmpty,
)
from pigeon.core.metadata import MetadataStore, Op, Stat
from pigeon.core.testing._metadata_helpers import (
    WAIT,
    ExpireSession,
    MetadataStoreFactory,
    ServerRestart,
    create_set_delete,
    running_store,
    store_factory,
)
from pigeon.core.testing._metadata_servers import _running
from pigeon.core.testing._metadata_sessions import SessionContract

__all__ = ["MetadataServerContract", "MetadataStoreContract"]


class MetadataStoreContract(SessionContract):
    """pytest-trio tests every metadata store backend must pass."""

    @pytest.fixture
    def metadata_store_factory(
        self, new_metadata_store: Callable[[], MetadataStore]
    ) -> MetadataStoreFactory:
        return store_factory(new_metadata_store)

    @pytest.fixture
    def metadata_store_url(self) -> str:
        """The metadata URL of a store on the backend's data (``zk://...``); the tests
        that need one are skipped for a backend without URLs (an in-memory test one)."""
        pytest.skip("this backend has no metadata URL")

    @pytest.fixture
    def restartable_server(self) -> ServerRestart:
        """``(new_store, restart)`` on a server of the test's own: ``restart()`` kills it
        (-9) and starts it again on the same data; the tests that need it are skipped for
        a backend without a server (embedded)."""
        pytest.skip("this backend has no server to restart")

    @pytest.fixture
    def expire_session(self) -> ExpireSession:
        async def expire(store: MetadataStore) -> None:
            method = getattr(store, "expire_session", None)
            assert method is not None, (
                f"{type(store).__name__} has no expire_session(): override the fixture"
            )
            await method()

        return expire

    @pytest.fixture
    async def metadata_store(
        self, metadata_store_factory: MetadataStoreFactory
    ) -> AsyncIterator[MetadataStore]:
        async with metadata_store_factory() as store:
            yield store

    @pytest.fixture
    async def root(self, metadata_store: MetadataStore) -> AsyncIterator[str]:
        """A fresh path for one test; removed afterwards."""
        path = f"/pigeon-contract/{uuid.uuid4().hex[:12]}"
        yield path
        with trio.move_on_after(WAIT):
            try:
                await metadata_store.delete(path, recursive=True)
            except NoSuchNode:
                pass

    # --- building and running ---------------------------------------------------------

    async def test_the_url_builds_the_store_through_the_plugin_registry(
        self, new_metadata_store: Callable[[], MetadataStore], metadata_store_url: str, root: str
    ) -> None:
        kind = type(new_metadata_store())
        registry = PluginManager().metadata_stores  # with the installed "pigeon" entry points
        build = registry.get(metadata_store_url.partition(":")[0])
        assert callable(build) and build == getattr(kind, "from_url", None)
        store = build(metadata_store_url)
        assert isinstance(store, kind)
        async with running_store(store):
            await store.create(f"{root}/hello", b"world")
            assert await store.get(f"{root}/hello") == Stat(b"world", 0, False)
            await store.delete(f"{root}/hello")

    async def test_a_store_that_is_not_running_refuses_calls(
        self, new_metadata_store: Callable[[], MetadataStore]
    ) -> None:
        store = new_metadata_store()
        with pytest.raises(MetadataError, match="not running"):
            await store.get("/x")
        with pytest.raises(MetadataError, match="not running"):
            await store.create("/x", b"")
        with pytest.raises(MetadataError, match="not running"):
            await store.set("/x", b"")
        with pytest.raises(MetadataError, match="not running"):
            await store.multi([Op.check("/")])
        with pytest.raises(MetadataError, match="not running"):
            async with store.watch("/x"):
                pass

    # --- basic reads and writes -------------------------------------------------------

    async def test_create_and_get(self, metadata_store: MetadataStore, root: str) -> None:
        path = f"{root}/node"
        assert await metadata_store.create(path, b"hello") == path
        stat = await metadata_store.get(path)
        assert stat == Stat(b"hello", 0, False)
        assert isinstance(stat.value, bytes)
        assert await metadata_store.exists(path)

    async def test_get_missing(self, metadata_store: MetadataStore, root: str) -> None:
        assert await metadata_store.get(f"{root}/nothing") is None
        assert not await metadata_store.exists(f"{root}/nothing")

    async def test_create_default_value_is_empty(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        await metadata_store.create(f"{root}/empty")
        assert await metadata_store.get(f"{root}/empty") == Stat(b"", 0, False)

    async def test_create_existing_raises_node_exists(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        await metadata_store.create(f"{root}/x", b"1")
        with pytest.raises(NodeExists):
            await metadata_store.create(f"{root}/x", b"2")
        assert await metadata_store.get(f"{root}/x") == Stat(b"1", 0, False)

    async def test_binary_values_round_trip(self, metadata_store: MetadataStore, root: str) -> None:
        value = bytes(range(256)) * 256  # 64 KiB, every byte value, NULs included
        await metadata_store.create(f"{root}/bin", value)
        stat = await metadata_store.get(f"{root}/bin")
        assert stat is not None and stat.value == value
        await metadata_store.set(f"{root}/bin", b"\x00")
        stat = await metadata_store.get(f"{root}/bin")
        assert stat is not None and stat.value == b"\x00"

    async def test_implicit_parents(self, metadata_store: MetadataStore, root: str) -> None:
        await metadata_store.create(f"{root}/a/b/c", b"leaf")
        assert await metadata_store.get(f"{root}/a") == Stat(b"", 0, False)
        assert await metadata_store.get(f"{root}/a/b") == Stat(b"", 0, False)
        assert await metadata_store.get(f"{root}/a/b/c") == Stat(b"leaf", 0, False)
        # an implicit parent is a normal node: creating it explicitly now fails
        with pytest.raises(NodeExists):
            await metadata_store.create(f"{root}/a/b")

    @pytest.mark.parametrize(
        "bad", ["", "relative", "/trailing/", "/double//slash", "/dot/./x", "/up/../x", "/n\x00"]
    )
    async def test_invalid_paths(self, metadata_store: MetadataStore, bad: str) -> None:
        with pytest.raises(InvalidArgument):
            await metadata_store.get(bad)
        with pytest.raises(InvalidArgument):
            await metadata_store.create(bad, b"")
        with pytest.raises(InvalidArgument):
            await metadata_store.set(bad, b"")
        with pytest.raises(InvalidArgument):
            await metadata_store.delete(bad)

    # --- versions and compare-and-set ------------------------------------------------

    async def test_set_increments_version(self, metadata_store: MetadataStore, root: str) -> None:
        path = f"{root}/v"
        await metadata_store.create(path, b"0")
        assert await metadata_store.set(path, b"1") == 1
        assert await metadata_store.set(path, b"2") == 2
        assert await metadata_store.get(path) == Stat(b"2", 2, False)

    async def test_set_with_version_is_compare_and_set(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        path = f"{root}/cas"
        await metadata_store.create(path, b"a")
        assert await metadata_store.set(path, b"b", version=0) == 1
        with pytest.raises(BadVersion):
            await metadata_store.set(path, b"lost", version=0)
        with pytest.raises(BadVersion):
            await metadata_store.set(path, b"lost", version=7)
        assert await metadata_store.get(path) == Stat(b"b", 1, False)
        assert await metadata_store.set(path, b"c", version=1) == 2

    async def test_set_missing_raises_no_such_node(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        with pytest.raises(NoSuchNode):
            await metadata_store.set(f"{root}/missing", b"x")
        with pytest.raises(NoSuchNode):
            await metadata_store.set(f"{root}/missing", b"x", version=0)
        assert await metadata_store.get(f"{root}/missing") is None

    async def test_recreate_restarts_version(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        path = f"{root}/again"
        await create_set_delete(metadata_store, path)
        await metadata_store.create(path, b"3")
        assert await metadata_store.get(path) == Stat(b"3", 0, False)

    # --- delete ----------------------------------------------------------------------

    async def test_delete(self, metadata_store: MetadataStore, root: str) -> None:
        path = f"{root}/gone"
        await metadata_store.create(path, b"x")
        await metadata_store.delete(path)
        assert await metadata_store.get(path) is None
        with pytest.raises(NoSuchNode):
            await metadata_store.delete(path)

    async def test_delete_with_version(self, metadata_store: MetadataStore, root: str) -> None:
        path = f"{root}/dv"
        await metadata_store.create(path, b"x")
        await metadata_store.set(path, b"y")
        with pytest.raises(BadVersion):
            await metadata_store.delete(path, version=0)
        assert await metadata_store.exists(path)
        await metadata_store.delete(path, version=1)
        assert not await metadata_store.exists(path)

    async def test_delete_with_children_raises_not_empty(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        await metadata_store.create(f"{root}/p/c", b"")
        with pytest.raises(NotEmpty):
            await metadata_store.delete(f"{root}/p")
        assert await metadata_store.exists(f"{root}/p/c")

    async def test_delete_recursive(self, metadata_store: MetadataStore, root: str) -> None:
        for leaf in ("t/a/x", "t/a/y", "t/b", "tt"):
            await metadata_store.create(f"{root}/{leaf}", b"")
        await metadata_store.delete(f"{root}/t", recursive=True)
        for path in ("t", "t/a", "t/a/x", "t/a/y", "t/b"):
            assert await metadata_store.get(f"{root}/{path}") is None
        assert await metadata_store.exists(f"{root}/tt")  # a sibling with the same prefix

    # --- children ----------------------------------------------------------------------

    async def test_children_sorted_names(self, metadata_store: MetadataStore, root: str) -> None:
        for name in ("b", "c", "a", "a-1", "B"):
            await metadata_store.create(f"{root}/dir/{name}", b"")
        await metadata_store.create(f"{root}/dir/a/grandchild", b"")
        await metadata_store.create(f"{root}/dirx", b"")
        assert await metadata_store.children(f"{root}/dir") == ["B", "a", "a-1", "b", "c"]
        assert await metadata_store.children(f"{root}/dir/a") == ["grandchild"]
        assert await metadata_store.children(f"{root}/dir/c") == []

    async def test_children_of_missing_is_empty(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        assert await metadata_store.children(f"{root}/nowhere") == []

    # --- sequential nodes --------------------------------------------------------------

    async def test_sequential_nodes_are_ordered(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        made = [
            await metadata_store.create(f"{root}/q/item-", bytes([i]), sequential=True)
            for i in range(5)
        ]
        prefix = f"{root}/q/item-"
        for path in made:
            assert path.startswith(prefix)
            suffix = path[len(prefix) :]
            assert len(suffix) == 10 and suffix.isdigit()
        assert made == sorted(made) and len(set(made)) == 5
        await metadata_store.delete(made[-1])
        later = await metadata_store.create(prefix, b"", sequential=True)
        assert later > made[-1]  # the counter never goes back while the parent exists
        assert await metadata_store.children(f"{root}/q") == sorted(
            p.rsplit("/", 1)[1] for p in [*made[:-1], later]
        )
        assert await metadata_store.get(made[2]) == Stat(bytes([2]), 0, False)

    async def test_sequential_with_bare_parent(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        first = await metadata_store.create(f"{root}/seq/", b"", sequential=True)
        second = await metadata_store.create(f"{root}/seq/", b"", sequential=True)
        assert first.startswith(f"{root}/seq/") and len(first) == len(f"{root}/seq/") + 10
        assert first < second

    async def test_sequential_unique_across_sessions(
        self, metadata_store_factory: MetadataStoreFactory, root: str
    ) -> None:
        made: list[str] = []
        async with metadata_store_factory() as a, metadata_store_factory() as b:

            async def creator(store: MetadataStore) -> None:
                for _ in range(10):
                    made.append(await store.create(f"{root}/u/n-", b"", sequential=True))

            with trio.fail_after(WAIT):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(creator, a)
                    nursery.start_soon(creator, b)
            assert len(set(made)) == 20
            assert sorted(await a.children(f"{root}/u")) == sorted(
                p.rsplit("/", 1)[1] for p in made
            )

    # --- multi -----------------------------------------------------------------------

    async def test_multi_applies_all(self, metadata_store: MetadataStore, root: str) -> None:
        await metadata_store.create(f"{root}/m/existing", b"old")
        await metadata_store.create(f"{root}/m/doomed", b"")
        results = await metadata_store.multi(
            [
                Op.create(f"{root}/m/new/deep", b"n"),
                Op.set(f"{root}/m/existing", b"new", version=0),
                Op.delete(f"{root}/m/doomed"),
                Op.check(f"{root}/m/existing", 1),
                Op.set(f"{root}/m/new/deep", b"n2", version=0),
            ]
        )
        assert results == [f"{root}/m/new/deep", 1, None, None, 1]
        assert await metadata_store.get(f"{root}/m/new/deep") == Stat(b"n2", 1, False)
        assert await metadata_store.get(f"{root}/m/existing") == Stat(b"new", 1, False)
        assert await metadata_store.get(f"{root}/m/doomed") is None

    async def test_multi_empty(self, metadata_store: MetadataStore) -> None:
        assert await metadata_store.multi([]) == []

    async def test_multi_failing_check_rolls_back(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        await metadata_store.create(f"{root}/m/a", b"a")
        await metadata_store.create(f"{root}/m/b", b"b")
        with pytest.raises(BadVersion):
            await metadata_store.multi(
                [
                    Op.create(f"{root}/m/c", b"c"),
                    Op.set(f"{root}/m/a", b"changed"),
                    Op.delete(f"{root}/m/b"),
                    Op.check(f"{root}/m/a", 42),
                ]
            )
        assert await metadata_store.get(f"{root}/m/c") is None
        assert await metadata_store.get(f"{root}/m/a") == Stat(b"a", 0, False)
        assert await metadata_store.get(f"{root}/m/b") == Stat(b"b", 0, False)

    @pytest.mark.parametrize(
        ("failing", "error"),
        [
            ("create-existing", NodeExists),
            ("set-missing", NoSuchNode),
            ("set-bad-version", BadVersion),
            ("delete-missing", NoSuchNode),
            ("delete-not-empty", NotEmpty),
            ("check-missing", NoSuchNode),
        ],
    )
    async def test_multi_raises_first_error_and_rolls_back(
        self,
        metadata_store: MetadataStore,
        root: str,
        failing: str,
        error: type[Exception],
    ) -> None:
        await metadata_store.create(f"{root}/m/a", b"a")
        await metadata_store.create(f"{root}/m/full/child", b"")
        bad = {
            "create-existing": Op.create(f"{root}/m/a", b""),
            "set-missing": Op.set(f"{root}/m/none", b""),
            "set-bad-version": Op.set(f"{root}/m/a", b"", version=3),
            "delete-missing": Op.delete(f"{root}/m/none"),
            "delete-not-empty": Op.delete(f"{root}/m/full"),
            "check-missing": Op.check(f"{root}/m/none"),
        }[failing]
        with pytest.raises(error):
            await metadata_store.multi(
                [Op.create(f"{root}/m/fresh/x", b""), Op.set(f"{root}/m/a", b"z"), bad]
            )
        assert await metadata_store.get(f"{root}/m/fresh") is None  # implicit parent too
        assert await metadata_store.get(f"{root}/m/a") == Stat(b"a", 0, False)


class MetadataServerContract(MetadataStoreContract):
    """The contract suite against a real server (a :class:`~pigeon.core.testing.servers.
    ZooKeeperServer`, an :class:`~pigeon.core.testing.servers.EtcdServer`)::

        class TestMyStore(MetadataServerContract):
            server_fixture = "zookeeper"  # the fixture of the running server, shared
            store_class = MyStore  # MyStore(address, path, session_timeout=...)
            session_timeout = 4.0

    The stores of the suite live below ``/contract``; the restart tests start a server
    of the same kind of their own, its stores below ``/restart``."""

    #: the name of the fixture that gives the running server the tests share
    server_fixture: ClassVar[str]
    #: the backend's store, called ``store_class(address, path, session_timeout=...)``
    #: (``path``: the chroot, the key prefix); it must not be running yet
    store_class: ClassVar[Any]
    #: the session timeout of the stores on the shared server, in seconds
    session_timeout: ClassVar[float] = 4.0
    #: the session timeout of the stores on a server the restart tests kill
    restart_session_timeout: ClassVar[float] = 8.0

    @pytest.fixture
    def metadata_server(self, request: pytest.FixtureRequest) -> Any:
        return request.getfixturevalue(self.server_fixture)

    @pytest.fixture
    def new_metadata_store(self, metadata_server: Any) -> Callable[[], MetadataStore]:
        return functools.partial(
            self.store_class,
            metadata_server.address,
            "/contract",
            session_timeout=self.session_timeout,
        )

    @pytest.fixture
    def metadata_store_url(self, metadata_server: Any) -> str:
        return str(metadata_server.url("/contract", session_timeout=self.session_timeout))

    @pytest.fixture
    def restartable_server(self, metadata_server: Any, tmp_path: Path) -> Iterator[ServerRestart]:
        with _running(type(metadata_server)(tmp_path / metadata_server.name)) as server:
            yield server.restartable(
                lambda address: self.store_class(
                    address, "/restart", session_timeout=self.restart_session_timeout
                )
            )

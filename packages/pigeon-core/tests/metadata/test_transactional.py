"""TransactionalMetadataStore: the contract suite on an in-memory transactional backend
(memory_backend.py), and what the shared front end itself does: checks before any read,
re-planning when another writer comes between, giving up."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import pytest
import trio
from memory_backend import MemoryServer, MemoryStore

from pigeon.core.errors import InvalidArgument, MetadataError, NoSuchNode, SessionExpired
from pigeon.core.metadata import MetadataStore, Op, Stat
from pigeon.core.testing import MetadataStoreContract, running_store


def running(server: MemoryServer) -> AbstractAsyncContextManager[MemoryStore]:
    return running_store(MemoryStore(server))


class TestMemoryContract(MetadataStoreContract):
    @pytest.fixture
    def new_metadata_store(self) -> Callable[[], MetadataStore]:
        server = MemoryServer()
        return lambda: MemoryStore(server)


async def test_arguments_are_checked_before_anything_is_read() -> None:
    async with running(MemoryServer()) as store:
        with pytest.raises(InvalidArgument):
            await store.create("relative")
        with pytest.raises(InvalidArgument):
            await store.create("/a/", sequential=False)
        with pytest.raises(InvalidArgument):
            await store.set("/a", "text")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            await store.multi([Op.create("/a"), ("create", "/b")])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="root"):
            await store.delete("/", recursive=True)
        assert await store.multi([]) == []
        await store.expire_session()
        with pytest.raises(SessionExpired):
            await store.create("/e", ephemeral=True)
        with pytest.raises(SessionExpired):
            await store.multi([Op.create("/p"), Op.create("/e", ephemeral=True)])
        assert store.reads == 0
        assert await store.get("/p") is None


async def test_a_write_another_writer_came_between_is_read_and_planned_again() -> None:
    server = MemoryServer()
    async with running(server) as store:
        await store.create("/n", b"0")
        raced: list[int] = []

        def other_writer() -> None:  # once, between the plan's reads and its commit
            if not raced:
                raced.append(1)
                server.nodes["/n"].version += 1

        server.before_commit = other_writer
        assert await store.set("/n", b"mine") == 2
        assert await store.get("/n") == Stat(b"mine", 2, False)
        assert raced
        # the counter of a parent, also read by the plan
        server.before_commit = None
        created = await store.multi([Op.create("/p"), Op.check("/p", 0)])
        assert created == ["/p", None]


async def test_sequential_creates_racing_from_two_stores_get_distinct_numbers() -> None:
    server = MemoryServer()
    names: list[str] = []

    async def create(store: MemoryStore) -> None:
        names.append(await store.create("/q/item-", sequential=True))

    async with running(server) as a, running(server) as b, trio.open_nursery() as nursery:
        for store in (a, b) * 10:
            nursery.start_soon(create, store)
    assert sorted(names) == [f"/q/item-{i:010d}" for i in range(20)]
    assert a.reads + b.reads > 20  # they did come between each other


async def test_a_write_gives_up_when_its_reads_keep_changing() -> None:
    server = MemoryServer()
    async with running(server) as store:
        await store.create("/n")
        store.max_attempts = 3
        store.reads = 0

        def always() -> None:
            server.nodes["/n"].version += 1

        server.before_commit = always
        with pytest.raises(MetadataError, match="gave up after 3 attempts"):
            await store.set("/n", b"x")
        assert store.reads == 3


async def test_errors_of_the_plan_or_the_commit_are_not_retried() -> None:
    server = MemoryServer()
    async with running(server) as store:
        with pytest.raises(NoSuchNode):
            await store.delete("/missing", recursive=True)
        assert store.reads == 1
        server.before_commit = lambda: server.end_session(next(iter(server.sessions)))
        with pytest.raises(SessionExpired):
            await store.create("/e", ephemeral=True)
        assert store.reads == 2

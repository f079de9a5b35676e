"""The contract tests of watches, ephemeral nodes, sessions, leader election and locks
(part of :class:`~pigeon.core.testing.MetadataStoreContract`, which supplies the
fixtures)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

import pytest
import trio

from pigeon.core.errors import InvalidArgument, SessionExpired
from pigeon.core.metadata import LeaderElection, Lock, MetadataStore, Stat, WatchEvent, lead_forever
from pigeon.core.testing._metadata_helpers import (
    QUIET,
    WAIT,
    C,
    D,
    ExpireSession,
    MetadataStoreFactory,
    ServerRestart,
    U,
    create_set_delete,
    next_event,
    running_store,
    wait_event,
)

__all__ = ["SessionContract"]


#: two running stores on the same data, each with its own session
StorePair = tuple[MetadataStore, MetadataStore]


class SessionContract:
    """Watches, ephemeral nodes, sessions, elections and locks of every backend."""

    @pytest.fixture
    async def two_stores(
        self, metadata_store_factory: MetadataStoreFactory
    ) -> AsyncIterator[StorePair]:
        """Two running stores of ``metadata_store_factory`` (closed after the test)."""
        async with metadata_store_factory() as first, metadata_store_factory() as second:
            yield first, second

    # --- watches -----------------------------------------------------------------------

    async def test_watch_path(self, metadata_store: MetadataStore, root: str) -> None:
        path = f"{root}/w"
        async with metadata_store.watch(path) as events:
            await create_set_delete(metadata_store, path)
            assert await next_event(events) == WatchEvent(C, path, b"1", 0)
            assert await next_event(events) == WatchEvent(U, path, b"2", 1)
            deleted = await next_event(events)
            assert (deleted.type, deleted.path, deleted.value) == (D, path, None)

    async def test_watch_only_reports_changes_after_it_started(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        path = f"{root}/late"
        await metadata_store.create(path, b"before")
        await metadata_store.set(path, b"before2")
        async with metadata_store.watch(path) as events:
            await metadata_store.set(path, b"after")
            assert await next_event(events) == WatchEvent(U, path, b"after", 2)

    async def test_watch_path_ignores_others(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        path = f"{root}/only"
        await metadata_store.create(path, b"")
        async with metadata_store.watch(path) as events:
            await metadata_store.create(f"{root}/only/child", b"")  # a child: not reported
            await metadata_store.create(f"{root}/onlyx", b"")  # a sibling with the prefix
            await metadata_store.create(f"{root}/other", b"")
            await metadata_store.set(path, b"mine")
            assert await next_event(events) == WatchEvent(U, path, b"mine", 1)

    async def test_watch_keeps_order(self, metadata_store: MetadataStore, root: str) -> None:
        path = f"{root}/ordered"
        await metadata_store.create(path, b"")
        async with metadata_store.watch(path) as events:
            for i in range(1, 51):
                await metadata_store.set(path, str(i).encode())
            for i in range(1, 51):
                assert await next_event(events) == WatchEvent(U, path, str(i).encode(), i)

    async def test_watch_prefix(self, metadata_store: MetadataStore, root: str) -> None:
        base = f"{root}/tree"
        await metadata_store.create(base, b"")
        async with metadata_store.watch(base, prefix=True) as events:
            await metadata_store.create(f"{root}/treehouse", b"")  # not below `base`
            await metadata_store.create(f"{base}/a", b"a")
            await metadata_store.create(f"{base}/b/c", b"c")  # `b` created implicitly
            await metadata_store.set(f"{base}/a", b"a2")
            await metadata_store.set(base, b"self")
            await metadata_store.delete(f"{base}/a")
            expected = [
                WatchEvent(C, f"{base}/a", b"a", 0),
                WatchEvent(C, f"{base}/b", b"", 0),
                WatchEvent(C, f"{base}/b/c", b"c", 0),
                WatchEvent(U, f"{base}/a", b"a2", 1),
                WatchEvent(U, base, b"self", 1),
            ]
            for want in expected:
                assert await next_event(events) == want
            last = await next_event(events)
            assert (last.type, last.path, last.value) == (D, f"{base}/a", None)

    async def test_watch_prefix_recursive_delete_reports_children_first(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        base = f"{root}/rd"
        for leaf in ("x/1", "x/2", "y"):
            await metadata_store.create(f"{base}/{leaf}", b"")
        async with metadata_store.watch(base, prefix=True) as events:
            await metadata_store.delete(base, recursive=True)
            seen = await wait_event(events, D, base)
        assert all(e.type is D for e in seen)
        paths = [e.path for e in seen]
        assert sorted(paths) == sorted(
            [base, f"{base}/x", f"{base}/x/1", f"{base}/x/2", f"{base}/y"]
        )
        for path in paths:  # every node is reported before its parent
            parent = path.rsplit("/", 1)[0]
            if parent in paths:
                assert paths.index(path) < paths.index(parent)

    async def test_watch_sees_other_sessions(self, root: str, two_stores: StorePair) -> None:
        path = f"{root}/shared"
        a, b = two_stores
        await a.create(root)
        async with b.watch(root, prefix=True) as events:
            await create_set_delete(a, path)
            assert await next_event(events) == WatchEvent(C, path, b"1", 0)
            assert await next_event(events) == WatchEvent(U, path, b"2", 1)
            assert (await next_event(events)).type is D
        assert await b.get(path) is None

    async def test_two_watchers_both_get_everything(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        path = f"{root}/two"
        await metadata_store.create(root)
        async with (
            metadata_store.watch(path) as one,
            metadata_store.watch(root, prefix=True) as two,
        ):
            await metadata_store.create(path, b"x")
            await metadata_store.set(path, b"y")
            for events in (one, two):
                assert await next_event(events) == WatchEvent(C, path, b"x", 0)
                assert await next_event(events) == WatchEvent(U, path, b"y", 1)

    # --- ephemeral nodes and sessions ---------------------------------------------------

    async def test_ephemeral_node(self, metadata_store: MetadataStore, root: str) -> None:
        path = f"{root}/eph"
        assert await metadata_store.create(path, b"me", ephemeral=True) == path
        assert await metadata_store.get(path) == Stat(b"me", 0, True)
        assert await metadata_store.set(path, b"me2") == 1
        assert await metadata_store.get(path) == Stat(b"me2", 1, True)
        parent = await metadata_store.get(root)
        assert parent is not None and not parent.ephemeral  # implicit parents persist

    async def test_ephemeral_sequential(self, metadata_store: MetadataStore, root: str) -> None:
        path = await metadata_store.create(f"{root}/es-", b"", ephemeral=True, sequential=True)
        stat = await metadata_store.get(path)
        assert stat is not None and stat.ephemeral

    async def test_ephemeral_cannot_have_children(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        await metadata_store.create(f"{root}/e", b"", ephemeral=True)
        with pytest.raises(InvalidArgument):
            await metadata_store.create(f"{root}/e/child", b"")
        with pytest.raises(InvalidArgument):
            await metadata_store.create(f"{root}/e/deep/child", b"")

    async def test_ephemeral_removed_when_owner_closes(
        self, metadata_store_factory: MetadataStoreFactory, root: str
    ) -> None:
        path = f"{root}/owned"
        async with metadata_store_factory() as observer:
            async with observer.watch(path) as events:
                async with metadata_store_factory() as owner:
                    await owner.create(path, b"owner", ephemeral=True)
                    await owner.create(f"{root}/kept", b"persistent")
                    assert await next_event(events) == WatchEvent(C, path, b"owner", 0)
                    assert await observer.get(path) == Stat(b"owner", 0, True)
                    assert await owner.set(path, b"owner2") == 1
                    assert await next_event(events) == WatchEvent(U, path, b"owner2", 1)
                # the deletion says which version went
                assert await next_event(events) == WatchEvent(D, path, None, 1)
            assert await observer.get(path) is None
            assert await observer.get(f"{root}/kept") == Stat(b"persistent", 0, False)

    async def test_session_expiry(
        self, root: str, two_stores: StorePair, expire_session: ExpireSession
    ) -> None:
        path = f"{root}/session"
        observer, owner = two_stores
        async with observer.watch(root, prefix=True) as events:
            await owner.create(f"{root}/persistent", b"p")
            await owner.create(path, b"e", ephemeral=True)
            await wait_event(events, C, path)
            await expire_session(owner)
            with trio.fail_after(WAIT):
                await owner.wait_session_expired()
            await wait_event(events, D, path)
        assert await observer.get(path) is None
        assert await owner.get(path) is None
        assert await observer.get(f"{root}/persistent") == Stat(b"p", 0, False)
        # persistent work goes on; ephemeral nodes need a new session
        await owner.set(f"{root}/persistent", b"q")
        with pytest.raises(SessionExpired):
            await owner.create(f"{root}/again", b"", ephemeral=True)
        await owner.new_session()
        await owner.create(f"{root}/again", b"", ephemeral=True)
        stat = await observer.get(f"{root}/again")
        assert stat is not None and stat.ephemeral

    async def test_new_session_drops_old_ephemerals(
        self, metadata_store: MetadataStore, root: str
    ) -> None:
        await metadata_store.create(f"{root}/old", b"", ephemeral=True)
        await metadata_store.new_session()
        assert await metadata_store.get(f"{root}/old") is None
        await metadata_store.create(f"{root}/new", b"", ephemeral=True)
        assert await metadata_store.exists(f"{root}/new")

    async def test_wait_session_expired_blocks_while_alive(
        self, metadata_store: MetadataStore, expire_session: ExpireSession
    ) -> None:
        with trio.move_on_after(QUIET) as scope:
            await metadata_store.wait_session_expired()
        assert scope.cancelled_caught
        await expire_session(metadata_store)
        with trio.fail_after(WAIT):
            await metadata_store.wait_session_expired()

    # --- server restarts ------------------------------------------------------------------

    async def test_store_survives_a_server_restart(self, restartable_server: ServerRestart) -> None:
        """Calls made right after the restart wait for the server; the session, its
        ephemeral nodes and the watches go on."""
        new_store, restart = restartable_server
        store = new_store()
        async with running_store(store), store.watch("/r", prefix=True) as events:
            await store.create("/r/eph", b"mine", ephemeral=True)
            await store.create("/r/kept", b"1")
            assert (await next_event(events)).path == "/r"
            assert (await next_event(events)).path == "/r/eph"
            assert (await next_event(events)).path == "/r/kept"
            session = getattr(store, "session_id", None)
            await trio.to_thread.run_sync(restart)
            with trio.fail_after(WAIT):
                assert await store.set("/r/kept", b"2") == 1
            assert await next_event(events) == WatchEvent(U, "/r/kept", b"2", 1)
            assert getattr(store, "session_alive", True)  # the stores that say so
            assert getattr(store, "session_id", None) == session
            assert await store.get("/r/eph") == Stat(b"mine", 0, True)
            await store.create("/r/new", b"", ephemeral=True)
            assert await store.children("/r") == ["eph", "kept", "new"]

    # --- leader election ---------------------------------------------------------------

    async def test_leader_election_failover(
        self, metadata_store_factory: MetadataStoreFactory, root: str
    ) -> None:
        path = f"{root}/election"
        async with metadata_store_factory() as b_store, trio.open_nursery() as b_tasks:
            b = LeaderElection(b_store, path, "b", b"addr-b")
            async with metadata_store_factory() as a_store:
                a = LeaderElection(a_store, path, "a", b"addr-a")
                assert await a.current_leader() is None
                async with trio.open_nursery() as a_tasks:
                    await a_tasks.start(a.run)
                    with trio.fail_after(WAIT):
                        await a.wait_leader()
                    assert a.is_leader
                    await b_tasks.start(b.run)
                    assert not b.is_leader
                    assert await b.current_leader() == "a"
                    assert await b.current_leader_info() == ("a", b"addr-a")
                    a_tasks.cancel_scope.cancel()  # a withdraws
                assert not a.is_leader
                with trio.fail_after(WAIT):
                    await b.wait_leader()
                assert await a.current_leader() == "b"
                # a rejoins behind b
                async with trio.open_nursery() as a_tasks:
                    await a_tasks.start(a.run)
                    assert not a.is_leader
                    assert b.is_leader
                    a_tasks.cancel_scope.cancel()
            b_tasks.cancel_scope.cancel()
        assert not b.is_leader

    async def test_leader_election_leader_store_closes(
        self, metadata_store_factory: MetadataStoreFactory, root: str
    ) -> None:
        path = f"{root}/election"
        async with metadata_store_factory() as b_store, trio.open_nursery() as b_tasks:
            b = LeaderElection(b_store, path, "b")
            async with metadata_store_factory() as a_store, trio.open_nursery() as a_tasks:
                a = LeaderElection(a_store, path, "a")
                await a_tasks.start(a.run)
                await b_tasks.start(b.run)
                assert a.is_leader and not b.is_leader
                a_tasks.cancel_scope.cancel()
            with trio.fail_after(WAIT):
                await b.wait_leader()
            b_tasks.cancel_scope.cancel()

    async def test_leader_election_session_expiry(
        self, root: str, two_stores: StorePair, expire_session: ExpireSession
    ) -> None:
        path = f"{root}/election"
        a_store, b_store = two_stores
        a = LeaderElection(a_store, path, "a")
        b = LeaderElection(b_store, path, "b")
        a_failed = trio.Event()

        async def run_a(
            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
        ) -> None:
            with pytest.raises(SessionExpired):
                await a.run(task_status=task_status)
            a_failed.set()

        async with trio.open_nursery() as nursery:
            await nursery.start(run_a)
            await nursery.start(b.run)
            assert a.is_leader
            await expire_session(a_store)
            with trio.fail_after(WAIT):
                await b.wait_leader()
                await a_failed.wait()
            assert not a.is_leader
            assert await b.current_leader() == "b"
            nursery.cancel_scope.cancel()

    async def test_lead_forever_campaigns_again_after_session_expiry(
        self,
        metadata_store_factory: MetadataStoreFactory,
        expire_session: ExpireSession,
        root: str,
    ) -> None:
        path = f"{root}/forever"
        async with metadata_store_factory() as store:
            send_term, terms = trio.open_memory_channel[trio.Event](10)

            async def work() -> None:
                ended = trio.Event()
                send_term.send_nowait(ended)
                try:
                    await trio.sleep_forever()
                finally:
                    ended.set()

            async with trio.open_nursery() as nursery:
                await nursery.start(partial(lead_forever, store, path, "a", work, retry_s=0.05))
                with trio.fail_after(WAIT):
                    first = await terms.receive()
                await expire_session(store)
                with trio.fail_after(WAIT):
                    await first.wait()  # the term ended with the session...
                await store.new_session()  # ...and the owner of the session renews it
                with trio.fail_after(WAIT):
                    second = await terms.receive()
                assert not second.is_set()
                nursery.cancel_scope.cancel()

    # --- locks ---------------------------------------------------------------------------

    async def test_lock_exclusion(self, root: str, two_stores: StorePair) -> None:
        path = f"{root}/lock"
        a_store, b_store = two_stores
        a = Lock(a_store, path, b"broker-a:6650")
        b = Lock(b_store, path, b"broker-b:6650")
        assert await a.acquire()
        assert a.held
        assert await b.owner() == b"broker-a:6650"
        assert not await b.acquire(blocking=False)
        assert not b.held
        b_got_it = trio.Event()

        async def wait_for_lock() -> None:
            assert await b.acquire()
            b_got_it.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_for_lock)
            with trio.move_on_after(QUIET):
                await b_got_it.wait()
            assert not b_got_it.is_set()  # blocked while a holds it
            await a.release()
            assert not a.held
            with trio.fail_after(WAIT):
                await b_got_it.wait()
        assert await a.owner() == b"broker-b:6650"
        assert not await a.acquire(blocking=False)
        await b.release()
        assert await a.owner() is None
        assert await a.acquire(blocking=False)
        await a.release()

    async def test_lock_released_when_holder_closes(
        self, metadata_store_factory: MetadataStoreFactory, root: str
    ) -> None:
        path = f"{root}/lock"
        async with metadata_store_factory() as b_store:
            b = Lock(b_store, path, b"b")
            b_got_it = trio.Event()

            async def wait_for_lock() -> None:
                assert await b.acquire()
                b_got_it.set()

            async with trio.open_nursery() as nursery:
                async with metadata_store_factory() as a_store:
                    a = Lock(a_store, path, b"a")
                    assert await a.acquire()
                    nursery.start_soon(wait_for_lock)
                    with trio.move_on_after(QUIET):
                        await b_got_it.wait()
                    assert not b.held
                with trio.fail_after(WAIT):
                    await b_got_it.wait()
            assert await b.owner() == b"b"

    async def test_lock_context_manager(self, metadata_store: MetadataStore, root: str) -> None:
        lock = Lock(metadata_store, f"{root}/cm", b"me")
        async with lock:
            assert lock.held
            stat = await metadata_store.get(f"{root}/cm")
            assert stat == Stat(b"me", 0, True)
        assert not lock.held
        assert await metadata_store.get(f"{root}/cm") is None

    async def test_lock_release_does_not_delete_another_holder(
        self, root: str, two_stores: StorePair
    ) -> None:
        path = f"{root}/lock"
        a_store, b_store = two_stores
        a = Lock(a_store, path, b"a")
        assert await a.acquire()
        await a_store.delete(path)  # someone broke the lock
        b = Lock(b_store, path, b"b")
        assert await b.acquire(blocking=False)
        await a.release()
        assert await b.owner() == b"b"

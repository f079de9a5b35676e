"""The embedded (SQLite) metadata store: the contract suite plus what only it does."""

from __future__ import annotations

import sqlite3
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing

import pigeon.core.metadata as metadata
from pigeon.core.errors import BadVersion, ConfigError, MetadataError, SessionExpired
from pigeon.core.metadata import (
    EmbeddedMetadataStore,
    EventType,
    MetadataStore,
    Stat,
    WatchEvent,
)
from pigeon.core.testing import MetadataStoreContract, run_until_ready_and_kill
from pigeon.core.testing import running_store as running

WAIT = 20.0


class TestEmbeddedContract(MetadataStoreContract):
    @pytest.fixture
    def new_metadata_store(self, tmp_path: Path) -> Callable[[], MetadataStore]:
        return lambda: EmbeddedMetadataStore(tmp_path)

    @pytest.fixture
    def metadata_store_url(self, tmp_path: Path) -> str:
        return f"embedded://{tmp_path}"


# --- persistence ----------------------------------------------------------------------


async def test_data_survives_close_and_reopen(tmp_path: Path) -> None:
    async with running(EmbeddedMetadataStore(tmp_path)) as store:
        await store.create("/topics/t1", b"config")
        await store.set("/topics/t1", b"config2")
        await store.create("/brokers/b1", b"addr", ephemeral=True)
        first = await store.create("/q/n-", b"", sequential=True)
    assert (tmp_path / "metadata.db").is_file()
    async with running(EmbeddedMetadataStore(tmp_path)) as store:
        assert await store.get("/topics/t1") == Stat(b"config2", 1, False)
        assert await store.get("/brokers/b1") is None  # the session ended with the store
        assert await store.children("/brokers") == []
        second = await store.create("/q/n-", b"", sequential=True)
        assert second > first


async def test_database_file_path_accepted(tmp_path: Path) -> None:
    db = tmp_path / "custom.db"
    async with running(EmbeddedMetadataStore(db)) as store:
        await store.create("/x", b"1")
    assert db.is_file()
    async with running(EmbeddedMetadataStore(db)) as store:
        assert await store.get("/x") == Stat(b"1", 0, False)


async def test_writes_survive_kill_9(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, trio
        from pigeon.core.metadata import EmbeddedMetadataStore

        async def main():
            store = EmbeddedMetadataStore(sys.argv[1], session_timeout=0.3)
            async with trio.open_nursery() as nursery:
                await nursery.start(store.run)
                await store.create("/durable", b"0")
                for i in range(1, 51):
                    await store.set("/durable", str(i).encode())
                await store.create("/eph", b"x", ephemeral=True)
                print("ready", flush=True)
                await trio.sleep_forever()

        trio.run(main)
        """
    )
    await run_until_ready_and_kill(script, str(tmp_path))

    async with running(EmbeddedMetadataStore(tmp_path, session_timeout=0.3)) as store:
        assert await store.get("/durable") == Stat(b"50", 50, False)
        # the dead session's ephemeral node goes once its heartbeat is older than 0.3 s
        async with store.watch("/eph") as events:
            if await store.exists("/eph"):
                with trio.fail_after(WAIT):
                    event = await anext(events)
                assert (event.type, event.path) == (EventType.DELETED, "/eph")
        assert await store.get("/eph") is None


# --- sessions ---------------------------------------------------------------------------


def _insert_session(db: Path, session: str, heartbeat: float, node: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute(
            "INSERT INTO sessions (id, heartbeat, timeout, pid, started) VALUES (?, ?, 10, 0, ?)",
            (session, heartbeat, heartbeat),
        )
        conn.execute(
            "INSERT INTO nodes (path, parent, value, version, owner, ctime, mtime)"
            " VALUES (?, '/svc', x'', 0, ?, 0, 0)",
            (node, session),
        )
    finally:
        conn.close()


async def test_stale_sessions_removed_at_open(tmp_path: Path) -> None:
    async with running(EmbeddedMetadataStore(tmp_path)) as store:
        await store.create("/svc/persistent", b"")
    db = tmp_path / "metadata.db"
    # a process killed 100 s ago, and one that is alive (fresh heartbeat)
    _insert_session(db, "dead", time.time() - 100, "/svc/dead")
    _insert_session(db, "alive", time.time() + 3600, "/svc/alive")
    async with running(EmbeddedMetadataStore(tmp_path)) as store:
        assert await store.children("/svc") == ["alive", "persistent"]


async def test_session_expires_after_missed_keepalive(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    timeout = 3.0
    owner = EmbeddedMetadataStore(tmp_path, session_timeout=timeout)
    observer = EmbeddedMetadataStore(tmp_path, session_timeout=1000 * timeout)
    async with running(owner), running(observer):
        await owner.create("/e", b"", ephemeral=True)
        await trio.sleep(100 * timeout)  # the keepalive keeps the session alive
        assert owner.session_alive and await observer.exists("/e")

        # the process stalls for just under the timeout: nothing happens
        await trio.sleep(0.01)  # a keepalive ran 0.01 s ago
        autojump_clock.jump(timeout - 0.05)
        await trio.testing.wait_all_tasks_blocked()
        assert owner.session_alive

        async with observer.watch("/e") as events:
            # ... and for just over it: the session expires
            autojump_clock.jump(timeout + 0.01)
            await trio.testing.wait_all_tasks_blocked()
            assert not owner.session_alive
            with trio.fail_after(1):
                await owner.wait_session_expired()
                event = await anext(events)
        assert (event.type, event.path) == (EventType.DELETED, "/e")
        assert observer.session_alive
        with pytest.raises(SessionExpired):
            await owner.create("/e", b"", ephemeral=True)


async def test_session_removed_by_another_process_expires(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with running(EmbeddedMetadataStore(tmp_path, session_timeout=3.0)) as store:
        await store.create("/e", b"", ephemeral=True)
        conn = sqlite3.connect(tmp_path / "metadata.db", isolation_level=None)
        conn.execute("DELETE FROM sessions WHERE id = ?", (store.session_id,))
        conn.close()
        with trio.fail_after(3.0):
            await store.wait_session_expired()
        assert await store.get("/e") is None


async def test_close_ends_session(tmp_path: Path) -> None:
    store = EmbeddedMetadataStore(tmp_path)
    async with running(store):
        assert store.session_alive
        await store.create("/e", b"", ephemeral=True)
    assert not store.session_alive
    with trio.fail_after(1):
        await store.wait_session_expired()
    async with running(store):  # a store may run again, with a new session
        assert store.session_alive
        assert await store.get("/e") is None


# --- two stores on one directory ------------------------------------------------------------


async def test_two_stores_share_writes_and_watches(tmp_path: Path) -> None:
    async with (
        running(EmbeddedMetadataStore(tmp_path)) as a,
        running(EmbeddedMetadataStore(tmp_path / "metadata.db")) as b,
        b.watch("/shared", prefix=True) as events,
    ):
        await a.create("/shared/x", b"1")
        await a.set("/shared/x", b"2")
        assert await b.get("/shared/x") == Stat(b"2", 1, False)  # visible at once
        with trio.fail_after(WAIT):  # events arrive with b's next poll
            assert await anext(events) == WatchEvent(EventType.CREATED, "/shared", b"", 0)
            assert await anext(events) == WatchEvent(EventType.CREATED, "/shared/x", b"1", 0)
            assert await anext(events) == WatchEvent(EventType.CHANGED, "/shared/x", b"2", 1)


# --- watches ------------------------------------------------------------------------------------


async def test_watch_overflow_fails_instead_of_dropping(tmp_path: Path) -> None:
    async with running(EmbeddedMetadataStore(tmp_path, watch_buffer=5)) as store:
        await store.create("/w", b"")
        async with store.watch("/w") as events:
            for i in range(8):
                await store.set("/w", str(i).encode())
            for version in range(1, 6):  # what fitted in the buffer
                assert (await anext(events)).version == version
            with pytest.raises(MetadataError, match="overflowed"):
                await anext(events)


async def test_watch_fails_if_change_log_trimmed_past_it(tmp_path: Path) -> None:
    writer = EmbeddedMetadataStore(tmp_path)
    watcher_store = EmbeddedMetadataStore(tmp_path, poll_interval=3600)
    async with (
        running(writer),
        running(watcher_store),
        watcher_store.watch("/", prefix=True) as events,
    ):
        await writer.create("/n", b"")
        for i in range(20):
            await writer.set("/n", str(i).encode())
        writer._changelog_keep_rows = 5
        writer._changelog_retention = 0.0
        await writer._keepalive()  # trims the change log
        await watcher_store.create("/other", b"")  # reads the change log
        with pytest.raises(MetadataError, match="change log"):
            await anext(events)


async def test_watch_ends_with_error_when_store_closes(tmp_path: Path) -> None:
    async with running(EmbeddedMetadataStore(tmp_path)) as store:
        watch = store.watch("/x")
        events = await watch.__aenter__()
    try:
        with pytest.raises(MetadataError, match="closed"):
            await anext(events)
    finally:
        await watch.__aexit__(None, None, None)


# --- misc -----------------------------------------------------------------------------------------


async def test_run_twice_at_once_refused(tmp_path: Path) -> None:
    async with running(EmbeddedMetadataStore(tmp_path)) as store:
        with pytest.raises(MetadataError, match="already running"):
            await store.run()


async def test_newer_schema_refused(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "metadata.db", isolation_level=None)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    store = EmbeddedMetadataStore(tmp_path)
    with pytest.raises(MetadataError, match="schema version 99"):
        await store.run()
    assert not store.statistics().running


@pytest.mark.parametrize(
    ("url", "db_path"),
    [
        ("embedded:///abs/dir", "/abs/dir/metadata.db"),
        ("embedded://rel/dir", "rel/dir/metadata.db"),
        ("embedded:rel", "rel/metadata.db"),
        ("embedded:///abs/my%20dir", "/abs/my dir/metadata.db"),
        ("embedded:///abs/file.db", "/abs/file.db"),
    ],
)
def test_from_url(url: str, db_path: str) -> None:
    assert EmbeddedMetadataStore.from_url(url).db_path == db_path


def test_from_url_options() -> None:
    store = EmbeddedMetadataStore.from_url("embedded:///d?session_timeout=2.5&poll_interval=0.01")
    assert store.session_timeout == 2.5
    assert store.poll_interval == 0.01


@pytest.mark.parametrize(
    "url", ["zk://host/x", "embedded://", "embedded:///d?nope=1", "embedded:///d?session_timeout=x"]
)
def test_from_url_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        EmbeddedMetadataStore.from_url(url)


def test_public_names() -> None:
    for name in metadata.__all__:
        assert not name.startswith("_")
        assert hasattr(metadata, name), name
    public = {n for n in vars(metadata) if not n.startswith("_")}
    modules = {"annotations"}  # from __future__
    assert public - modules == set(metadata.__all__)
    for name in ("MetadataStore", "Stat", "WatchEvent", "EventType", "Op"):
        assert name in metadata.__all__
    for name in ("EmbeddedMetadataStore", "LeaderElection", "Lock"):
        assert name in metadata.__all__


# --- the writer thread ------------------------------------------------------------------


class _HeldCommits:
    """Patches ``set_value`` so that a set of ``/held`` waits in the writer thread
    until :meth:`release`, telling the test when it got there."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        from pigeon.core.metadata import _sqlite

        self.entered = threading.Event()
        self.released = threading.Event()
        real = _sqlite.set_value

        def set_value(conn: sqlite3.Connection, path: str, *args: object) -> int:
            if path == "/held":
                self.entered.set()
                if not self.released.wait(WAIT):
                    raise RuntimeError("the held commit was never released")
            return real(conn, path, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(_sqlite, "set_value", set_value)

    async def wait_entered(self) -> None:
        assert await trio.to_thread.run_sync(self.entered.wait, WAIT)

    def release(self) -> None:
        self.released.set()


async def test_a_commit_in_progress_does_not_hold_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A commit that takes long (a disk busy with a bookie's fsyncs) must leave the trio
    # thread free: here the commit only ends when a trio task releases it.
    held = _HeldCommits(monkeypatch)
    async with running(EmbeddedMetadataStore(tmp_path)) as store:
        await store.create("/held", b"0")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.set, "/held", b"1")
            await held.wait_entered()
            assert await store.get("/held") == Stat(b"0", 0, False)  # reads still served
            held.release()
        assert await store.get("/held") == Stat(b"1", 1, False)


async def test_writes_queued_behind_a_commit_share_one_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = _HeldCommits(monkeypatch)
    async with running(EmbeddedMetadataStore(tmp_path)) as store:
        for path in ["/held", "/bad", *(f"/n{i}" for i in range(20))]:
            await store.create(path, b"0")
        before = store.statistics()
        outcomes: dict[str, object] = {}

        async def write(path: str, version: int | None) -> None:
            try:
                outcomes[path] = await store.set(path, b"new", version=version)
            except Exception as exc:
                outcomes[path] = exc

        async def cancelled_write(scope_ready: trio.Event, scopes: list[trio.CancelScope]) -> None:
            with trio.CancelScope() as scope:
                scopes.append(scope)
                scope_ready.set()
                await store.create("/withdrawn", b"")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, "/held", None)
            await held.wait_entered()
            for i in range(20):
                nursery.start_soon(write, f"/n{i}", 0)
            nursery.start_soon(write, "/bad", 7)  # a wrong version: fails alone
            ready, scopes = trio.Event(), list[trio.CancelScope]()
            nursery.start_soon(cancelled_write, ready, scopes)
            await ready.wait()
            await trio.testing.wait_all_tasks_blocked()
            scopes[0].cancel()  # withdrawn before the thread took it: never applied
            await trio.testing.wait_all_tasks_blocked()
            held.release()

        after = store.statistics()
        assert outcomes["/held"] == 1
        assert isinstance(outcomes["/bad"], BadVersion)
        assert await store.get("/bad") == Stat(b"0", 0, False)
        assert await store.get("/withdrawn") is None
        assert [outcomes[f"/n{i}"] for i in range(20)] == [1] * 20
        # the held round, then one round for all 21 queued behind it
        assert after.commit_rounds - before.commit_rounds == 2
        assert after.committed_writes - before.committed_writes == 22


async def test_writes_commit_inline_under_a_mock_clock(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with running(EmbeddedMetadataStore(tmp_path)) as store:
        await store.create("/a", b"")
        assert store.statistics().commit_rounds == 0


async def test_a_lock_held_by_another_process_past_busy_timeout_fails_the_write(
    tmp_path: Path,
) -> None:
    async with running(EmbeddedMetadataStore(tmp_path, busy_timeout=0.2)) as store:
        await store.create("/a", b"")
        other = sqlite3.connect(tmp_path / "metadata.db", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(MetadataError, match=r"stayed locked for 0\.2s"):
                await store.set("/a", b"1")
            other.execute("ROLLBACK")
        finally:
            other.close()
        assert await store.set("/a", b"2") == 1


async def test_a_writer_thread_that_fails_fails_its_writes_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pigeon.core.metadata._group_commit import GroupCommitter

    async with running(EmbeddedMetadataStore(tmp_path)) as store:
        await store.create("/a", b"")

        def broken(self: GroupCommitter, batch: object) -> None:
            raise RuntimeError("a bug in the writer")

        monkeypatch.setattr(GroupCommitter, "_commit", broken)
        with trio.fail_after(WAIT), pytest.raises(MetadataError, match="writer failed"):
            await store.set("/a", b"1")
        with trio.fail_after(WAIT), pytest.raises(MetadataError, match="closing or failed"):
            await store.set("/a", b"2")
        assert await store.get("/a") == Stat(b"", 0, False)  # reads still work
    assert "metadata writer thread" in caplog.text

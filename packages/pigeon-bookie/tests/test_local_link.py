"""The in-process link between a broker's BookieClient and a bookie of the same process
(``pigeon standalone``): the same answers and typed errors as over TCP, no socket, the
link trusted, and the bookie's metrics telling which links it serves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from pigeon.bookie import BookieConfig, BookieServer
from pigeon.bookie.testing import pipelined_adds
from pigeon.core._bookie_client import BookieClient
from pigeon.core.auth import AuthenticationToken
from pigeon.core.errors import (
    AuthenticationError,
    BookieReadOnly,
    ConnectionClosed,
    EntryNotFound,
    InvalidEntryId,
    PigeonError,
    SegmentFenced,
    SegmentNotFound,
)
from pigeon.core.rpc import frame_batch
from pigeon.core.testing.servers import SecurityFiles

TIMEOUT = 20
GIB = 1 << 30


@pytest.fixture(scope="module")
def sec(tmp_path_factory: pytest.TempPathFactory) -> SecurityFiles:
    return SecurityFiles.create(tmp_path_factory.mktemp("sec"))


def payload(segment_id: int, entry_id: int, size: int = 1000) -> bytes:
    return (f"{segment_id}:{entry_id}:".encode() * (size // 4 + 1))[:size]


@asynccontextmanager
async def linked(
    tmp_path: Path, **options: Any
) -> AsyncIterator[tuple[BookieServer, BookieClient, str]]:
    """A bookie on loopback and a BookieClient that reaches it in-process."""
    options.setdefault("fsync", "always")
    config = BookieConfig(data_dir=str(tmp_path / "bookie"), port=0, **options)
    server = BookieServer(config)
    server.disk_usage = lambda: (100 * GIB, 50 * GIB)
    client = BookieClient(name="test")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            await nursery.start(client.run)
            client.add_local(server.advertised, server.open_local_link)
            try:
                yield server, client, server.advertised
            finally:
                client.close()
                nursery.cancel_scope.cancel()


@pytest.mark.parametrize("storage", ["segment-files", "journal"])
async def test_adds_and_reads_go_in_process_and_the_metrics_say_so(
    tmp_path: Path, storage: str
) -> None:
    async with linked(tmp_path, ledger_storage=storage) as (server, client, addr):
        results = await pipelined_adds(client, addr, 1, list(range(100)), payload, lac=-1)
        assert all(err is None for err in results.values())
        got = await client.read_entries(addr, 1, 0, 99)
        assert [(i, bytes(d)) for i, d in got] == [(i, payload(1, i)) for i in range(100)]
        conn = client.connection_nowait(addr)
        assert conn is not None and conn.in_process
        assert server.connections == {"tcp": 0, "in_process": 1}
        text = server.render_metrics()
        assert f'pigeon_bookie_connections{{bookie="{addr}",link="in_process"}} 1' in text
        assert f'pigeon_bookie_connections{{bookie="{addr}",link="tcp"}} 0' in text
        # the same bookie still serves TCP clients beside it
        other = BookieClient(name="tcp")
        async with trio.open_nursery() as nursery:
            await nursery.start(other.run)
            assert bytes((await other.read_entries(addr, 1, 5, 5))[0][1]) == payload(1, 5)
            assert server.connections == {"tcp": 1, "in_process": 1}
            other.close()
            nursery.cancel_scope.cancel()


async def test_bookie_errors_cross_the_link_as_the_same_typed_errors(tmp_path: Path) -> None:
    async with linked(tmp_path, min_free_disk_bytes=GIB) as (server, client, addr):
        await client.add_entry(addr, 1, 0, -1, b"zero")
        bad: list[tuple[Any, type[PigeonError]]] = [
            (lambda: client.read_entries(addr, 9, 0, 0), SegmentNotFound),
            (lambda: client.read_lac(addr, 9), SegmentNotFound),
            (lambda: client.add_entry(addr, 1, 0, 0, b"again"), InvalidEntryId),
            (lambda: client.read_entries(addr, 1, 3, 4), EntryNotFound),
        ]
        for call, error in bad:
            with pytest.raises(error) as info:
                await call()
            assert not info.value.retriable
        await client.fence(addr, 1)
        with pytest.raises(SegmentFenced):
            await client.add_entry(addr, 1, 1, 0, b"late")
        server.disk_usage = lambda: (100 * GIB, GIB // 2)  # below min_free_disk_bytes
        server.check_disk()
        with pytest.raises(BookieReadOnly) as info:
            await client.add_entry(addr, 2, 0, -1, b"full")
        assert info.value.retriable
        conn = client.connection_nowait(addr)
        assert conn is not None and conn.in_process  # one link answered them all


async def test_the_link_is_trusted_while_the_port_still_authenticates(
    tmp_path: Path, sec: SecurityFiles
) -> None:
    table = sec.node_table(tls=False)
    async with linked(tmp_path, **table) as (server, client, addr):
        assert server.authenticator is not None
        await client.add_entry(addr, 1, 0, -1, b"trusted")
        other = BookieClient(name="tcp", authentication=AuthenticationToken("not-a-token"))
        async with trio.open_nursery() as nursery:
            await nursery.start(other.run)
            with pytest.raises(AuthenticationError):
                await other.read_entries(addr, 1, 0, 0)
            other.close()
            nursery.cancel_scope.cancel()
        assert server.connections["in_process"] == 1


async def test_a_stopped_bookie_fails_pending_adds_and_new_links(tmp_path: Path) -> None:
    config = BookieConfig(data_dir=str(tmp_path / "bookie"), port=0, fsync="always")
    server = BookieServer(config)
    server.disk_usage = lambda: (100 * GIB, 50 * GIB)
    client = BookieClient(name="test")
    errors: list[BaseException | None] = []
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as outer:
            await outer.start(client.run)
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                client.add_local(server.advertised, server.open_local_link)
                addr = server.advertised
                await client.add_entry(addr, 1, 0, -1, b"a")
                conn = client.connection_nowait(addr)
                assert conn is not None
                client.add_entry_nowait(conn, 1, 1, 0, b"b", lambda _r, e: errors.append(e))
                nursery.cancel_scope.cancel()  # the bookie stops before it answers
            with trio.fail_after(5):
                await conn.closed_event.wait()
            assert len(errors) == 1 and isinstance(errors[0], ConnectionClosed)
            with pytest.raises(ConnectionClosed, match="not running"):
                await client.add_entry(addr, 1, 2, 0, b"c")
            client.close()
            outer.cancel_scope.cancel()


async def test_adds_sent_in_a_batch_are_answered_at_its_end_by_the_same_task(
    tmp_path: Path,
) -> None:
    """A reader's batch (here ``frame_batch``, as a handler runs in one) hands its adds
    to an idle in-process bookie at the batch's end: stored and answered, in order, before
    any other task runs (no reader task woken per add, each way); outside a batch the
    link's reader tasks take them, as before."""
    async with linked(tmp_path, ledger_storage="journal", fsync="never") as (_s, client, addr):
        await client.add_entry(addr, 1, 0, -1, payload(1, 0))  # the link is open
        conn = client.connection_nowait(addr)
        assert conn is not None
        answered: list[tuple[int, BaseException | None]] = []
        with frame_batch():
            for i in range(1, 6):
                client.add_entry_nowait(
                    conn, 1, i, i - 1, payload(1, i), lambda _r, e, i=i: answered.append((i, e))
                )
            assert answered == []  # at the end of the batch, not while it runs
        assert answered == [(i, None) for i in range(1, 6)]  # no await in between
        sixth = trio.Event()

        def last(_r: Any, e: BaseException | None) -> None:
            answered.append((6, e))
            sixth.set()

        client.add_entry_nowait(conn, 1, 6, 5, payload(1, 6), last)
        assert len(answered) == 5  # no batch: the link's readers take it
        with trio.fail_after(TIMEOUT):
            await sixth.wait()
        assert answered[-1] == (6, None)
        got = await client.read_entries(addr, 1, 0, 6)
        assert [(i, bytes(d)) for i, d in got] == [(i, payload(1, i)) for i in range(7)]

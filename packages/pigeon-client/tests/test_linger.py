"""A producer without a batching delay (``batching_max_delay_ms=0``, Kafka's
``linger.ms=0``): a batch leaves as soon as the client gets to it, carrying every message
added meanwhile, on every face — not one entry per message, and no waiting for a delay;
while a batch waits for its receipt the next one is held, and leaves with everything sent
meanwhile when the receipt comes.

Against a real ``pigeon standalone`` process; what a user notices is the message ids: the
messages of one burst share an entry (one ``(segment_id, entry_id)``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import pigeon.client.asyncio as aio
import pigeon.client.trio as tr
from pigeon.client import Client, MessageId
from pigeon.core.testing.servers import Standalone

pytestmark = pytest.mark.integration

BURST = 50


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    base = tmp_path_factory.mktemp("linger")
    with contextlib.closing(Standalone(base / "data", log_dir=base, fsync=None).start()) as s:
        yield s


@pytest.fixture
def url(server: Standalone) -> str:
    return server.url


@contextlib.contextmanager
def paused(server: Standalone) -> Iterator[None]:
    """The server stopped (SIGSTOP): nothing sent is answered until the block ends."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def wait_in_flight(engine: object) -> None:
    """Until the producer's partition engine has a batch waiting for its receipt."""
    deadline = time.monotonic() + 10
    while not engine.link.pending:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the first message was never sent"
        time.sleep(0.001)


def entries(ids: list[MessageId]) -> set[tuple[int, int]]:
    return {(i.segment_id, i.entry_id) for i in ids}


def test_sync_a_burst_added_while_the_engine_is_busy_leaves_as_one_entry(url: str) -> None:
    with Client(url) as client, client.create_producer("linger-sync", batching_max_delay_ms=0) as p:
        # The engine's thread is busy until `go`: the burst accumulates meanwhile, and the
        # first message's seal (queued behind the busy call) takes all of it.
        go = threading.Event()
        client.engine_thread.soon(go.wait, 10)
        try:
            futures = [p.send_async(b"m%d" % i) for i in range(BURST)]
        finally:
            go.set()
        ids = [f.result(10) for f in futures]
        assert len(entries(ids)) == 1, "the burst was split although the engine was busy"
        assert [i.batch_index for i in ids] == list(range(BURST))
        # one at a time: each sent alone, in order, and acknowledged
        alone = [p.send(b"alone%d" % i, timeout=10) for i in range(3)]
        assert len(entries(alone)) == 3
        assert sorted(alone) == alone and alone[0] > ids[-1]


def test_trio_messages_added_before_the_task_yields_share_an_entry(url: str) -> None:
    async def main() -> list[MessageId]:
        got: list[MessageId] = []
        async with tr.Client(url) as client:
            p = await client.create_producer("linger-trio", batching_max_delay_ms=0)
            for i in range(BURST):  # no checkpoint while there is room: one burst
                await p.send_async(b"m%d" % i, callback=lambda mid, err: got.append(mid))
            await p.flush()
            await p.close()
        return got

    ids = trio.run(main)
    assert len(ids) == BURST and len(entries(ids)) == 1


def test_asyncio_messages_added_in_one_loop_step_share_an_entry(url: str) -> None:
    async def main() -> list[MessageId]:
        async with aio.Client(url) as client:
            p = await client.create_producer("linger-asyncio", batching_max_delay_ms=0)
            futures = [p.send_async(b"m%d" % i) for i in range(BURST)]
            ids = list(await asyncio.gather(*futures))
            await p.close()
        return ids

    ids = asyncio.run(main())
    assert len(entries(ids)) == 1


HELD = 20


def test_sync_messages_sent_while_a_batch_waits_for_its_receipt_leave_together(
    server: Standalone,
) -> None:
    with (
        Client(server.url) as client,
        client.create_producer("held-sync", batching_max_delay_ms=0) as p,
    ):
        p.send(b"warm-up", timeout=10)
        with paused(server):
            first = p.send_async(b"first")
            wait_in_flight(p._handle.engines[0])
            futures = []
            for i in range(HELD):
                futures.append(p.send_async(b"m%d" % i))
                # the engine gets to it before the next: alone if nothing were in flight
                passed = threading.Event()
                client.engine_thread.soon(passed.set)
                assert passed.wait(10)
        ids = [f.result(10) for f in futures]
        assert len(entries(ids)) == 1, "messages left one by one behind a batch in flight"
        assert first.result(10) < ids[0]
        # nothing in flight: the next message leaves at once, alone
        assert len(entries([p.send(b"after", timeout=10)])) == 1


def test_trio_messages_sent_while_a_batch_waits_for_its_receipt_leave_together(
    server: Standalone,
) -> None:
    async def main() -> list[MessageId]:
        got: list[MessageId] = []
        async with tr.Client(server.url) as client:
            p = await client.create_producer("held-trio", batching_max_delay_ms=0)
            await p.send(b"warm-up")
            with paused(server):
                await p.send_async(b"first", callback=lambda mid, err: None)
                with trio.fail_after(10):
                    while not p._handle.engines[0].link.pending:  # noqa: ASYNC110
                        await trio.sleep(0.001)
                for i in range(HELD):
                    await p.send_async(b"m%d" % i, callback=lambda mid, err: got.append(mid))
                    await trio.sleep(0.001)  # the timer task runs between messages
            await p.flush()
            await p.close()
        return got

    ids = trio.run(main)
    assert len(ids) == HELD and len(entries(ids)) == 1


def test_asyncio_messages_sent_while_a_batch_waits_for_its_receipt_leave_together(
    server: Standalone,
) -> None:
    async def main() -> list[MessageId]:
        async with aio.Client(server.url) as client:
            p = await client.create_producer("held-asyncio", batching_max_delay_ms=0)
            await p.send(b"warm-up")
            with paused(server):
                p.send_async(b"first")
                deadline = time.monotonic() + 10
                while not p._handle.engines[0].link.pending:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.001)
                futures = []
                for i in range(HELD):
                    futures.append(p.send_async(b"m%d" % i))
                    await asyncio.sleep(0.001)  # the loop's seal runs between messages
            ids = list(await asyncio.gather(*futures))
            await p.close()
        return ids

    ids = asyncio.run(main())
    assert len(entries(ids)) == 1


def test_sync_a_batch_held_behind_one_lost_with_the_server_leaves_after_the_restart(
    tmp_path: Path,
) -> None:
    # The server dies with the first batch unanswered and the next one held behind it:
    # after the restart the producer resends the first, and its receipt lets the held
    # one go; every message is stored once, in order.
    with (
        contextlib.closing(
            Standalone(tmp_path / "data", log_dir=tmp_path, fsync="always").start()
        ) as server,
        Client(server.url) as client,
        client.create_producer("held-restart", batching_max_delay_ms=0, send_timeout=60) as p,
    ):
        p.send(b"warm-up", timeout=10)
        os.kill(server.pid, signal.SIGSTOP)
        first = p.send_async(b"first")
        wait_in_flight(p._handle.engines[0])
        futures = [p.send_async(b"m%d" % i) for i in range(HELD)]
        passed = threading.Event()
        client.engine_thread.soon(passed.set)
        assert passed.wait(10)
        assert p._handle.logic.held[0], "the batch was not held behind the first"
        server.kill9()  # stopped: it dies without answering
        server.restart()
        ids = [f.result(60) for f in [first, *futures]]
        assert ids == sorted(ids)
        with client.create_reader("held-restart", "earliest") as reader:
            got = [reader.read_next(timeout=10).value for _ in range(HELD + 2)]
        assert got == [b"warm-up", b"first", *(b"m%d" % i for i in range(HELD))]
        assert not reader_has_more(client, "held-restart", HELD + 2)


def reader_has_more(client: Client, topic: str, count: int) -> bool:
    """Whether the topic holds more than ``count`` messages (a duplicate)."""
    with client.create_reader(topic, "earliest") as reader:
        for _ in range(count):
            reader.read_next(timeout=10)
        return bool(reader.has_message_available())

"""A producer without a batching delay (``batching_max_delay_ms=0``, Kafka's
``linger.ms=0``): a batch leaves as soon as the client gets to it, carrying every message
added meanwhile, on every face — not one entry per message, and no waiting for a delay.

Against a real ``pigeon standalone`` process; what a user notices is the message ids: the
messages of one burst share an entry (one ``(segment_id, entry_id)``)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest
import trio

import pigeon.client.asyncio as aio
import pigeon.client.trio as tr
from pigeon.client import Client, MessageId
from pigeon.core.testing.servers import Standalone

pytestmark = pytest.mark.integration

BURST = 50


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("linger")
    with contextlib.closing(Standalone(base / "data", log_dir=base, fsync=None).start()) as s:
        yield s.url


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

"""Compacted topics through the sync and asyncio faces: read_compacted readers and
consumers, TableView (its listeners run on the engine thread / the event loop).  The trio
face is covered in test_compaction."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from admin_support import AdminStandalone

import pigeon.client.asyncio as aio
from pigeon.client import Client
from pigeon.core import TopicName
from pigeon.core.errors import InvalidArgument

PREFIX = "persistent://public/default/"
PAIRS = [("a", b"a1"), ("b", b"b1"), ("a", b"a2"), ("b", b""), ("c", b"c1")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AdminStandalone]:
    s = AdminStandalone(Path(tmp_path_factory.mktemp("compaction")) / "data").start()
    try:
        yield s
    finally:
        s.stop()


def produce_and_compact(server: AdminStandalone, topic: str) -> None:
    with Client(server.service_url) as client, client.create_producer(topic) as producer:
        for key, value in PAIRS:
            producer.send(value, key=key)

    async def compact() -> str:
        assert server.service is not None
        t = await server.service.get_topic(TopicName.parse(PREFIX + topic))
        await t.compact()
        return str(t.ledger.compaction_status["status"])

    assert server.call(compact) == "SUCCESS"


def test_sync_face(server: AdminStandalone) -> None:
    produce_and_compact(server, "faces-sync")
    with Client(server.service_url) as client:
        reader = client.create_reader("faces-sync", "earliest", read_compacted=True)
        got = []
        while reader.has_message_available():
            got.append(reader.read_next(timeout=5))
        assert [(m.key, m.value) for m in got] == [("a", b"a2"), ("c", b"c1")]
        reader.close()
        consumer = client.subscribe(
            "faces-sync", "s", initial_position="earliest", read_compacted=True
        )
        assert consumer.receive(timeout=5).value == b"a2"
        consumer.close()
        with pytest.raises(InvalidArgument, match="read_compacted"):
            client.subscribe("faces-sync", "x", subscription_type="key_shared", read_compacted=True)
        with client.create_table_view("faces-sync") as view:
            assert dict(view.items()) == {"a": b"a2", "c": b"c1"}
            assert sorted(view.keys()) == ["a", "c"] and len(view) == 2
            seen: list[tuple[str, bytes | None]] = []
            updated = threading.Event()

            def listener(key: str, value: bytes | None) -> None:
                seen.append((key, value))
                if len(seen) == 4:
                    updated.set()

            view.for_each_and_listen(listener)
            with client.create_producer("faces-sync") as producer:
                producer.send(b"d1", key="d")
                producer.send(b"", key="a")
            assert updated.wait(10)
            assert seen[2:] == [("d", b"d1"), ("a", None)]
            assert dict(view.items()) == {"c": b"c1", "d": b"d1"}


def test_asyncio_face(server: AdminStandalone) -> None:
    produce_and_compact(server, "faces-aio")

    async def main() -> None:
        async with aio.Client(server.service_url) as client:
            reader = await client.create_reader("faces-aio", "earliest", read_compacted=True)
            assert (await reader.read_next(timeout=5)).value == b"a2"
            await reader.close()
            async with await client.create_table_view("faces-aio") as view:
                assert dict(view.items()) == {"a": b"a2", "c": b"c1"}
                loop = asyncio.get_running_loop()
                updates: asyncio.Queue[tuple[str, bytes | None]] = asyncio.Queue()

                def listener(key: str, value: bytes | None) -> None:
                    assert asyncio.get_running_loop() is loop  # on the event loop
                    updates.put_nowait((key, value))

                view.for_each_and_listen(listener)
                producer = await client.create_producer("faces-aio")
                await producer.send(b"", key="c")
                await producer.close()
                got = [await asyncio.wait_for(updates.get(), 10) for _ in range(3)]
                assert sorted(got[:2]) == [("a", b"a2"), ("c", b"c1")]
                assert got[2] == ("c", None)
                assert "c" not in view and view.get("a") == b"a2"

    asyncio.run(main())

"""The sync, trio and asyncio client faces run the same scenario with the same outcome.

One ``pigeon standalone`` process serves the module; each face uses its own topic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import pigeon.client.asyncio as asyncio_face
import pigeon.client.trio as trio_face
from pigeon.client import Client as SyncClient
from pigeon.client import Timeout
from pigeon.core.errors import NotSupported
from pigeon.core.testing.servers import Standalone

pytestmark = pytest.mark.integration

OP_TIMEOUT = 10.0
VALUES = [f"v{i}".encode() for i in range(5)]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base: Path = tmp_path_factory.mktemp("faces")
    server = Standalone(base / "data", log_dir=base, fsync=None).start()
    try:
        yield server.url
    finally:
        server.close()


def summary(ids, first, again, read, errors) -> dict[str, Any]:
    return {
        "offsets": [mid.offset for mid in ids],
        "first": [(m.value, m.key, m.properties, m.offset, m.redelivery_count) for m in first],
        "again": sorted((m.value, m.redelivery_count) for m in again),
        "read": [(m.value, m.offset) for m in read],
        "errors": errors,
    }


def run_sync(url: str, topic: str) -> dict[str, Any]:
    errors = []
    with SyncClient(url, operation_timeout=OP_TIMEOUT) as client:
        consumer = client.subscribe(
            topic, "s", subscription_type="shared", initial_position="earliest"
        )
        try:
            client.subscribe(topic, "s", subscription_type="exclusive")
        except Exception as exc:  # the subscription is shared already
            errors.append(type(exc).__name__)
        with client.create_producer(topic, batching_max_messages=1) as producer:
            ids = [
                producer.send(v, key=f"k{i}", properties={"i": str(i)})
                for i, v in enumerate(VALUES)
            ]
        first = [consumer.receive(timeout=OP_TIMEOUT) for _ in VALUES]
        for m in first[:3]:
            consumer.acknowledge(m)
        try:
            consumer.acknowledge_cumulative(first[4])
        except NotSupported as exc:
            errors.append(type(exc).__name__)
        consumer.close()
        consumer = client.subscribe(topic, "s", subscription_type="shared")
        again = [consumer.receive(timeout=OP_TIMEOUT) for _ in range(2)]
        try:
            consumer.receive(timeout=1.0)
            errors.append("more than expected")
        except Timeout:
            pass
        consumer.close()
        reader = client.create_reader(topic, "earliest")
        read = []
        while reader.has_message_available():
            read.append(reader.read_next(timeout=OP_TIMEOUT))
        reader.close()
    return summary(ids, first, again, read, errors)


async def run_async(client: Any, topic: str) -> dict[str, Any]:
    """The scenario of :func:`run_sync`, for the trio and asyncio faces alike."""
    errors = []
    consumer = await client.subscribe(
        topic, "s", subscription_type="shared", initial_position="earliest"
    )
    try:
        await client.subscribe(topic, "s", subscription_type="exclusive")
    except Exception as exc:
        errors.append(type(exc).__name__)
    producer = await client.create_producer(topic, batching_max_messages=1)
    ids = [
        await producer.send(v, key=f"k{i}", properties={"i": str(i)}) for i, v in enumerate(VALUES)
    ]
    await producer.close()
    first = [await consumer.receive(timeout=OP_TIMEOUT) for _ in VALUES]
    for m in first[:3]:
        await consumer.acknowledge(m)
    try:
        await consumer.acknowledge_cumulative(first[4])
    except NotSupported as exc:
        errors.append(type(exc).__name__)
    await consumer.close()
    consumer = await client.subscribe(topic, "s", subscription_type="shared")
    again = [await consumer.receive(timeout=OP_TIMEOUT) for _ in range(2)]
    try:
        await consumer.receive(timeout=1.0)
        errors.append("more than expected")
    except Timeout:
        pass
    await consumer.close()
    reader = await client.create_reader(topic, "earliest")
    read = []
    while await reader.has_message_available():
        read.append(await reader.read_next(timeout=OP_TIMEOUT))
    await reader.close()
    return summary(ids, first, again, read, errors)


def run_trio(url: str, topic: str) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with trio_face.Client(url, operation_timeout=OP_TIMEOUT) as client:
            return await run_async(client, topic)

    return trio.run(main)


def run_asyncio(url: str, topic: str) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with asyncio_face.Client(url, operation_timeout=OP_TIMEOUT) as client:
            return await run_async(client, topic)

    return asyncio.run(main())


EXPECTED = {
    "offsets": [0, 1, 2, 3, 4],
    "first": [(v, f"k{i}", {"i": str(i)}, i, 0) for i, v in enumerate(VALUES)],
    "again": [(VALUES[3], 1), (VALUES[4], 1)],
    "read": [(v, i) for i, v in enumerate(VALUES)],
    "errors": ["SubscriptionBusy", "NotSupported"],
}


@pytest.mark.parametrize("face", ["sync", "trio", "asyncio"])
def test_the_three_faces_agree(url: str, face: str) -> None:
    runner = {"sync": run_sync, "trio": run_trio, "asyncio": run_asyncio}[face]
    assert runner(url, f"faces-{face}") == EXPECTED

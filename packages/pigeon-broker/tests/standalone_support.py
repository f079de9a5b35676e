"""Helpers for tests that run a standalone in the test's own trio run (``pigeon_standalone``
or :func:`pigeon.core.testing.in_process_standalone`) and talk to it through the real
client: produce, receive (``receive_n`` and ``drain`` come from :mod:`pigeon.core.testing`),
read back; a raw protocol producer; a real-time limit for virtual-time tests.

The ``client`` fixture (``conftest.py``) is a client connected to ``pigeon_standalone``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import trio

from pigeon.client.trio import Client, Consumer, Producer
from pigeon.core._rpc import connect_tcp
from pigeon.core._schema import BrokerFrame
from pigeon.core.batch import encode_batch
from pigeon.core.codecs import NONE
from pigeon.core.testing import InProcessStandalone, drain, receive_n

NS = "public/default"
PREFIX = "persistent://public/default/"


# ------------------------------------------------------------------ through the client


async def produce(client: Client, topic: str, values: list[bytes], **send: Any) -> list[Any]:
    """One message per entry (batching_max_messages=1), each send awaited; their ids."""
    producer = await client.create_producer(topic, batching_max_messages=1)
    ids = [await producer.send(v, **send) for v in values]
    await producer.close()
    return ids


async def subscribe_and_produce(
    client: Client, topic: str, sent: list[bytes], **subscribe: Any
) -> tuple[Consumer, list[Any]]:
    """A consumer of a new subscription ``s`` of ``topic`` from the earliest (``subscribe``:
    its other options), then ``sent`` produced (:func:`produce`) and received."""
    consumer = await client.subscribe(topic, "s", initial_position="earliest", **subscribe)
    await produce(client, topic, sent)
    return consumer, await receive_n(consumer, len(sent))


async def consumer_and_producer(
    client: Client, topic: str, **subscribe: Any
) -> tuple[Consumer, Producer]:
    """A consumer of subscription ``s`` of ``topic`` (``subscribe``: its options), then a
    producer with the default batching."""
    consumer = await client.subscribe(topic, "s", **subscribe)
    return consumer, await client.create_producer(topic)


def values(msgs: list[Any]) -> list[bytes]:
    return [m.value for m in msgs]


async def read_all(client: Client, topic: str) -> list[Any]:
    """Every message of ``topic`` still stored, through a reader from the earliest."""
    reader = await client.create_reader(topic, "earliest")
    out = await drain(reader, idle=1.0)
    await reader.close()
    return out


async def consume_all(client: Client, topic: str, n: int, sub: str = "check") -> list[Any]:
    """At least ``n`` messages of ``topic`` (and whatever follows within a second),
    through a new subscription ``sub`` from the earliest."""
    consumer = await client.subscribe(topic, sub, initial_position="earliest")
    out = await receive_n(consumer, n)
    out += await drain(consumer, idle=1.0)
    await consumer.close()
    return out


def backlog(cluster: InProcessStandalone, topic: str, sub: str) -> int:
    """The backlog of subscription ``sub`` of ``topic`` (in the default namespace)."""
    return int(cluster.service.topics[PREFIX + topic].subscriptions[sub].backlog())


async def set_backlog_quota(cluster: InProcessStandalone, quota_bytes: int, policy: str) -> None:
    """The default namespace's backlog quota and what happens above it."""
    await cluster.service.policies.set(
        NS, {"backlog_quota_bytes": quota_bytes, "backlog_quota_policy": policy}
    )


# ------------------------------------------------------------------ chunking

#: the chunk size of :func:`chunking_producer` (the broker's limit is megabytes)
CHUNK = 4096


async def chunking_producer(client: Client, topic: str, **options: Any) -> Producer:
    """A producer that sends each message alone (no batching), in chunks of CHUNK bytes."""
    return await client.create_producer(
        topic,
        chunking_enabled=True,
        batching_enabled=False,
        chunk_max_message_size=CHUNK,
        **options,
    )


# ------------------------------------------------------------------ raw protocol


def batch_of(values: list[bytes], producer_name: str, sequence_id: int) -> bytes:
    """One uncompressed batch of ``values`` as producer ``producer_name`` sends it."""
    return encode_batch(
        values,
        producer_name=producer_name,
        sequence_id=sequence_id,
        publish_time=int(time.time() * 1000),
        codec=NONE,
    )


async def raw_sends(
    url: str, topic: str, producer_name: str, sends: Sequence[tuple[int, int, bytes]]
) -> list[dict[str, Any]]:
    """Send (sequence id, message count, batch) over a raw protocol connection as
    producer ``producer_name``; the receipts, in order."""
    host, port = url[len("pigeon://") :].rsplit(":", 1)
    async with trio.open_nursery() as nursery:
        conn, _info = await connect_tcp(host, int(port), BrokerFrame, nursery)
        await conn.request(
            "createProducer",
            {"producerId": 1, "topic": topic, "producerName": producer_name},
            expect="producerCreated",
        )
        receipts = [
            await conn.request(
                "send",
                {"producerId": 1, "sequenceId": seq, "numMessages": n},
                payload=payload,
                expect="sendReceipt",
            )
            for seq, n, payload in sends
        ]
        conn.close()
        nursery.cancel_scope.cancel()
    return receipts


# ------------------------------------------------------------------ real time


@contextlib.contextmanager
def real_time_limit(seconds: float) -> Iterator[None]:
    """Cancel the block after ``seconds`` of *real* time (a busy loop stops virtual time)."""
    token = trio.lowlevel.current_trio_token()
    scope = trio.CancelScope()

    def fire() -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(scope.cancel)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        with scope:
            yield
    finally:
        timer.cancel()
    if scope.cancelled_caught:
        raise AssertionError(f"still running after {seconds}s of real time (hang or busy loop)")

"""Edge cases of the client features of issue 17 found in review (listeners, pause,
chunking, ack receipts, schemas), each against an in-process standalone."""

from __future__ import annotations

import pytest
import trio
from standalone_support import CHUNK, backlog, chunking_producer

from pigeon.client.schema import AvroSchema, Integer, JsonSchema, Record, String
from pigeon.client.trio import Client, DeadLetterPolicy
from pigeon.core.errors import Timeout
from pigeon.core.testing import InProcessStandalone, in_process_standalone

BIG = bytes(range(256)) * (3 * CHUNK // 256)


async def test_an_ack_receipt_of_a_chunked_message_acks_every_chunk(
    client, pigeon_standalone, autojump_clock
):
    consumer = await client.subscribe(
        "rcpt-big", "s", initial_position="earliest", ack_receipt_enabled=True
    )
    producer = await chunking_producer(client, "rcpt-big")
    await producer.send(BIG)
    msg = await consumer.receive(timeout=10)
    assert msg.value == BIG and len(msg.message_id.chunk_ids) > 2
    await consumer.acknowledge(msg)
    assert backlog(pigeon_standalone, "rcpt-big", "s") == 0, "every chunk is acknowledged"
    await consumer.close()
    await producer.close()


class Point(Record):
    x = Integer(required=True)
    label = String()


async def test_a_schema_consumer_dead_letters_and_reconsumes_its_messages(client, autojump_clock):
    schema = JsonSchema(Point)
    consumer = await client.subscribe(
        "dl-schema",
        "s",
        initial_position="earliest",
        schema=schema,
        negative_ack_redelivery_delay=0.1,
        dead_letter_policy=DeadLetterPolicy(max_redeliver_count=1, enable_retry=True),
    )
    dlq = await client.subscribe("dl-schema-s-DLQ", "d", initial_position="earliest", schema=schema)
    producer = await client.create_producer("dl-schema", schema=schema)
    await producer.send(Point(x=1, label="é"))
    await producer.send(Point(x=2))
    first = await consumer.receive(timeout=10)
    assert first.value == Point(x=1, label="é")
    await consumer.reconsume_later(first, 1.0)  # through the retry topic
    second = await consumer.receive(timeout=10)
    assert second.value == Point(x=2)
    await consumer.negative_acknowledge(second)
    got = []
    for _ in range(2):  # the retried one and the redelivered one (in either order)
        m = await consumer.receive(timeout=10)
        got.append((m.value.x, m.value.label, m.redelivery_count))
        if m.value.x == 2:
            await consumer.negative_acknowledge(m)
        else:
            await consumer.acknowledge(m)
    assert sorted(got) == [(1, "é", 0), (2, None, 1)]
    with pytest.raises(Timeout):  # redelivered a second time: dead-lettered instead
        await consumer.receive(timeout=5)
    dead = await dlq.receive(timeout=10)
    assert dead.value == Point(x=2)
    await consumer.close()
    await dlq.close()
    await producer.close()


def user_v1() -> type[Record]:
    class User(Record):
        name = String(required=True)

    return User


def user_v2() -> type[Record]:
    class User(Record):
        name = String(required=True)
        email = String(default="unknown", required_default=True)

    return User


async def test_a_multi_topic_consumer_decodes_each_topic_with_its_own_versions(
    client, autojump_clock
):
    """Schema versions are numbered per topic: version 0 of one topic is not another's."""
    v1, v2 = user_v1(), user_v2()
    on_a = await client.create_producer("vs-a", schema=AvroSchema(v1))  # vs-a's version 0
    on_b = await client.create_producer("vs-b", schema=AvroSchema(v2))  # vs-b's version 0
    consumer = await client.subscribe(
        ["vs-a", "vs-b"], "s", initial_position="earliest", schema=AvroSchema(v2)
    )
    await on_b.send(v2(name="b", email="b@x"))
    assert (await consumer.receive(timeout=10)).value == v2(name="b", email="b@x")
    await on_a.send(v1(name="a"))
    assert (await consumer.receive(timeout=10)).value == v2(name="a", email="unknown")
    await consumer.close()


SEVEN = bytes(range(256)) * (6 * CHUNK // 256) + b"tail"  # seven chunks


async def test_a_chunked_message_does_not_expire_while_the_consumer_is_paused(
    client, autojump_clock
):
    consumer = await client.subscribe(
        "exp-paused",
        "s",
        initial_position="earliest",
        receiver_queue_size=4,
        expire_time_of_incomplete_chunked_message=5,
    )
    consumer.pause()
    producer = await chunking_producer(client, "exp-paused")
    await producer.send(SEVEN)
    with pytest.raises(Timeout):  # four chunks taken in, no permits asked for
        await consumer.receive(timeout=1)
    await trio.sleep(30)  # paused for longer than the expiry
    consumer.resume()
    assert (await consumer.receive(timeout=10)).value == SEVEN
    await consumer.close()
    await producer.close()


async def test_a_chunked_message_does_not_expire_while_its_chunks_wait_in_the_queue(
    client, autojump_clock
):
    """A slow application: the last chunks arrived but wait for its next receive."""
    consumer = await client.subscribe(
        "exp-slow",
        "s",
        initial_position="earliest",
        receiver_queue_size=4,
        expire_time_of_incomplete_chunked_message=5,
    )
    producer = await chunking_producer(client, "exp-slow")
    await producer.send(SEVEN)
    await trio.sleep(1)  # the first four chunks arrived
    with pytest.raises(Timeout):  # takes them in (asking for more), nothing whole yet
        await consumer.receive(timeout=0)
    await trio.sleep(30)  # busy with something else; the other chunks arrive meanwhile
    assert (await consumer.receive(timeout=10)).value == SEVEN
    await consumer.close()
    await producer.close()


async def test_a_chunked_message_is_dead_lettered_whole_and_every_chunk_acknowledged(
    tmp_path, autojump_clock
):
    """Chunked because it is larger than the broker takes: the dead letter is chunked too."""
    async with (
        in_process_standalone(tmp_path / "p", max_message_size=CHUNK) as cluster,
        Client(cluster.url) as client,
    ):
        await dead_letter_big(client, cluster)


async def dead_letter_big(client: Client, cluster: InProcessStandalone) -> None:
    consumer = await client.subscribe(
        "dl-big",
        "s",
        initial_position="earliest",
        negative_ack_redelivery_delay=0.1,
        dead_letter_policy=DeadLetterPolicy(max_redeliver_count=1),
    )
    dlq = await client.subscribe("dl-big-s-DLQ", "d", initial_position="earliest")
    producer = await client.create_producer("dl-big", chunking_enabled=True, batching_enabled=False)
    await producer.send(BIG)
    for _ in range(2):
        await consumer.negative_acknowledge(await consumer.receive(timeout=10))
    with pytest.raises(Timeout):  # redelivered a second time: dead-lettered instead
        await consumer.receive(timeout=5)
    assert (await dlq.receive(timeout=10)).value == BIG
    await consumer.close()  # its acks go out first
    assert backlog(cluster, "dl-big", "s") == 0, "every chunk is acknowledged"
    await dlq.close()
    await producer.close()

"""Subscription types as docs/messaging.md describes them, in virtual time.

Every test runs broker + bookie + metadata in the test's trio run (``pigeon_standalone``)
with trio's autojump ``MockClock``, so waits cost no real time.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import trio
from standalone_support import drain, produce, real_time_limit, receive_n, values

from pigeon.client.trio import Client, Consumer, Producer
from pigeon.core.errors import ConsumerBusy, NotSupported, Timeout

# ----------------------------------------------------------------------------- helpers


def key_shared(client: Client, topic: str) -> Callable[..., Awaitable[Consumer]]:
    """``await sub("c1", **options)``: consumer ``c1`` of the key_shared subscription ``s``."""

    async def sub(name: str, **options: Any) -> Consumer:
        return await client.subscribe(
            topic, "s", subscription_type="key_shared", consumer_name=name, **options
        )

    return sub


KEYS = [f"k{i}" for i in range(20)]


async def _c1_holds_every_key(client: Client, topic: str) -> tuple[Any, Producer, Consumer, list]:
    """Consumer ``c1`` of the key_shared subscription ``s`` received message ``<key>:0``
    of every key of KEYS, and holds them unacknowledged; (``key_shared`` of the topic,
    the producer, c1, what c1 received)."""
    sub = key_shared(client, topic)
    producer = await client.create_producer(topic, batching_max_messages=1)
    c1 = await sub("c1")
    for k in KEYS:
        await producer.send(f"{k}:0".encode(), key=k)
    return sub, producer, c1, await receive_n(c1, len(KEYS))


# ----------------------------------------------------------------------------- exclusive


async def test_exclusive_refuses_a_second_consumer(client, autojump_clock):
    first = await client.subscribe("ex", "s", subscription_type="exclusive")
    with pytest.raises(ConsumerBusy):
        await client.subscribe("ex", "s", subscription_type="exclusive")
    await produce(client, "ex", [b"a", b"b"])
    got = await receive_n(first, 2)
    assert values(got) == [b"a", b"b"]
    await first.acknowledge_cumulative(got[1])
    await first.close()
    # once the holder is gone the subscription takes a new consumer
    second = await client.subscribe("ex", "s", subscription_type="exclusive")
    await produce(client, "ex", [b"c"])
    assert values(await receive_n(second, 1)) == [b"c"]
    await second.close()


async def test_exclusive_is_the_default_type(client, autojump_clock):
    first = await client.subscribe("ex-default", "s")
    with pytest.raises(ConsumerBusy):
        await client.subscribe("ex-default", "s")
    await first.close()


# ----------------------------------------------------------------------------- shared


async def test_shared_spreads_each_message_to_exactly_one_consumer(client, autojump_clock):
    consumers = [
        await client.subscribe("jobs", "workers", subscription_type="shared") for _ in range(3)
    ]
    sent = [f"job-{i}".encode() for i in range(60)]
    await produce(client, "jobs", sent)
    got: dict[int, list] = {}
    for i, c in enumerate(consumers):
        got[i] = await drain(c)
    every = [m.value for msgs in got.values() for m in msgs]
    assert sorted(every) == sorted(sent), "each message exactly once over all consumers"
    assert all(got[i] for i in got), f"a consumer got nothing: {[len(v) for v in got.values()]}"
    # round-robin: no consumer gets much more than its share
    assert max(len(v) for v in got.values()) <= 2 * len(sent) // 3
    for c in consumers:
        await c.close()


async def test_shared_consumer_leaving_hands_unacked_messages_to_the_others(client, autojump_clock):
    a = await client.subscribe("handover", "w", subscription_type="shared", receiver_queue_size=4)
    sent = [f"m{i}".encode() for i in range(4)]
    await produce(client, "handover", sent)
    held = await receive_n(a, 4)
    await a.acknowledge(held[0])
    b = await client.subscribe("handover", "w", subscription_type="shared")
    await a.close()  # flushes the one ack; the other three go to b
    again = await receive_n(b, 3)
    assert sorted(values(again)) == sent[1:]
    assert all(m.redelivery_count == 1 for m in again)
    assert await drain(b) == []
    await b.close()


async def test_cumulative_ack_inside_a_batch_leaves_the_rest_to_the_next_consumer(
    client, autojump_clock
):
    first = await client.subscribe("cumul-batch", "s", subscription_type="failover")
    producer = await client.create_producer(
        "cumul-batch", batching_max_messages=5, batching_max_delay_ms=10_000
    )
    for i in range(5):
        await producer.send_async(f"m{i}".encode())
    await producer.flush()  # one entry of five messages
    got = await receive_n(first, 5)
    await first.acknowledge_cumulative(got[2])
    await first.close()
    second = await client.subscribe("cumul-batch", "s", subscription_type="failover")
    rest = await drain(second)
    assert values(rest) == [b"m3", b"m4"]
    assert all(m.redelivery_count == 1 for m in rest)
    await second.close()
    await producer.close()


async def test_cumulative_ack_is_refused_on_shared_and_key_shared(client, autojump_clock):
    for sub_type in ("shared", "key_shared"):
        topic = f"cumul-{sub_type}"
        consumer = await client.subscribe(topic, "s", subscription_type=sub_type)
        await produce(client, topic, [b"x"], key="k")
        msg = await consumer.receive(timeout=10)
        with pytest.raises(NotSupported):
            await consumer.acknowledge_cumulative(msg)
        # the broker refuses it too, whatever a client sends
        engine = consumer._handle.engines[0]
        mid = msg.message_id
        with pytest.raises(NotSupported):
            await engine.ack([(mid.segment_id, mid.entry_id, mid.batch_index, mid.offset)], True)
        await consumer.close()


# ----------------------------------------------------------------------------- failover


async def test_failover_highest_priority_is_active_and_the_next_takes_over(client, autojump_clock):
    # b has the higher priority; of equal priority "c" loses to "b" by name, and
    # "a" (priority 0) is last despite its name.
    a = await client.subscribe(
        "payments", "ledger", subscription_type="failover", consumer_name="a"
    )
    c = await client.subscribe(
        "payments", "ledger", subscription_type="failover", consumer_name="c", priority=1
    )
    b = await client.subscribe(
        "payments", "ledger", subscription_type="failover", consumer_name="b", priority=1
    )
    sent = [f"p{i}".encode() for i in range(10)]
    await produce(client, "payments", sent)
    got_b = await receive_n(b, 10)
    assert values(got_b) == sent
    assert await drain(a, idle=1.0) == [] and await drain(c, idle=0.1) == []
    for m in got_b[:4]:
        await b.acknowledge(m)
    await b.close()
    # c is next (priority 1, name "c" before priority-0 "a"): every unacked message
    got_c = await receive_n(c, 6)
    assert values(got_c) == sent[4:]
    assert all(m.redelivery_count >= 1 for m in got_c)
    assert await drain(a, idle=1.0) == []
    await c.acknowledge_cumulative(got_c[2])  # failover allows cumulative acks
    await c.close()
    got_a = await receive_n(a, 3)
    assert values(got_a) == sent[7:]
    assert await drain(a, idle=1.0) == []
    await a.close()


async def test_failover_higher_priority_joining_takes_over_unacked_messages(client, autojump_clock):
    a = await client.subscribe("fo-join", "s", subscription_type="failover", consumer_name="a")
    sent = [f"f{i}".encode() for i in range(6)]
    await produce(client, "fo-join", sent[:3])
    got_a = await receive_n(a, 3)
    await a.acknowledge(got_a[0])
    await trio.sleep(1)  # the ack reaches the broker
    b = await client.subscribe(
        "fo-join", "s", subscription_type="failover", consumer_name="b", priority=5
    )
    await produce(client, "fo-join", sent[3:])
    got_b = await drain(b)
    assert values(got_b) == sent[1:], "the new active consumer gets every unacked message"
    assert [m.redelivery_count for m in got_b[:2]] == [1, 1]
    assert await drain(a, idle=1.0) == []
    await a.close()
    await b.close()


async def test_failover_spreads_partitions_over_consumers(client, autojump_clock):
    await client.create_topic("fo-parts", partitions=2)
    x = await client.subscribe("fo-parts", "s", subscription_type="failover", consumer_name="x")
    y = await client.subscribe("fo-parts", "s", subscription_type="failover", consumer_name="y")
    producer = await client.create_producer("fo-parts", message_router=lambda key, n: int(key))
    for i in range(10):
        await producer.send(f"v{i}".encode(), key=str(i % 2))
    got_x, got_y = await drain(x), await drain(y)
    assert len(got_x) + len(got_y) == 10
    # each partition has exactly one active consumer, and they differ
    assert {m.message_id.partition for m in got_x} == {0}
    assert {m.message_id.partition for m in got_y} == {1}
    await producer.close()
    await x.close()
    await y.close()


# ----------------------------------------------------------------------------- key_shared


async def test_key_shared_sends_each_key_to_one_consumer_in_order(client, autojump_clock):
    consumers = [
        await client.subscribe(
            "clicks-steady", "per-user", subscription_type="key_shared", consumer_name=f"c{i}"
        )
        for i in range(3)
    ]
    producer = await client.create_producer("clicks-steady", batching_max_messages=7)
    for n in range(5):
        for k in range(20):
            await producer.send_async(f"{n}".encode(), key=f"user-{k}")
    await producer.flush()
    owners: dict[str, set[int]] = defaultdict(set)
    per_key: dict[str, list[bytes]] = defaultdict(list)
    for i, c in enumerate(consumers):
        for m in await drain(c):
            owners[m.key].add(i)
            per_key[m.key].append(m.value)
    assert len(per_key) == 20
    assert all(len(o) == 1 for o in owners.values()), owners
    assert all(v == [b"0", b"1", b"2", b"3", b"4"] for v in per_key.values()), per_key
    assert len({i for o in owners.values() for i in o}) == 3, "a consumer got no key"
    await producer.close()
    for c in consumers:
        await c.close()


async def test_key_shared_new_consumer_waits_for_earlier_messages_to_be_acked(
    client, autojump_clock
):
    sub, producer, c1, first = await _c1_holds_every_key(client, "ks-join")
    c2 = await sub("c2")
    for k in KEYS:
        await producer.send(f"{k}:1".encode(), key=k)
    to_c1 = await drain(c1, idle=1.0)  # keys c1 keeps flow on
    assert await drain(c2, idle=5.0) == [], (
        "c2 got a key's message before its earlier one was acked"
    )
    for m in first:
        await c1.acknowledge(m)
    to_c2 = await drain(c2)
    assert to_c2, "c2 got none of the keys"
    assert sorted(values(to_c1 + to_c2)) == sorted(f"{k}:1".encode() for k in KEYS)
    assert not {m.key for m in to_c1} & {m.key for m in to_c2}
    await producer.close()
    await c1.close()
    await c2.close()


@dataclass
class Event:
    seq: int
    time: float
    consumer: str
    kind: str  # "delivered" | "acked"
    key: str
    value: int


async def test_key_shared_waiting_for_a_consumer_reads_nothing_again(
    pigeon_standalone, client, autojump_clock, monkeypatch
):
    """c1 takes no more (its one permit is used) while c2 could: dispatch waits for c1
    instead of reading the entries it cannot send over and over (a busy loop that would
    also keep the mock clock from ever advancing)."""

    sub = key_shared(client, "ks-wait")

    c1 = await sub("c1", receiver_queue_size=1)
    c2 = await sub("c2", receiver_queue_size=1000)
    subscription = pigeon_standalone.service.topics[
        "persistent://public/default/ks-wait"
    ].subscriptions["s"]
    read_one = subscription.ledger.read_one
    reads = 0

    async def counting_read_one(pos: tuple[int, int]) -> object:
        nonlocal reads
        reads += 1
        if reads > 1000:
            await trio.sleep_forever()  # spinning: stop here so that the test can end
        return await read_one(pos)

    monkeypatch.setattr(subscription.ledger, "read_one", counting_read_one)
    producer = await client.create_producer("ks-wait", batching_max_messages=1)
    for i in range(40):
        await producer.send(f"k{i}".encode(), key=f"k{i}")
    await trio.sleep(5)
    assert reads < 100, f"{reads} entries read again while waiting for c1"
    got = await drain(c1) + await drain(c2)
    assert sorted(values(got)) == sorted(f"k{i}".encode() for i in range(40))
    for c in (c1, c2):
        await c.close()
    await producer.close()


async def test_key_shared_keeps_per_key_order_while_consumers_join_and_leave(
    pigeon_standalone, autojump_clock
):
    """Keyed messages produced continuously; consumers join and leave mid-stream.

    Checks over the recorded (time, consumer, key, value, delivered/acked) events:
    every message is delivered and acknowledged; per key, the values in order of first
    delivery are strictly increasing; and no message is delivered to a consumer while an
    earlier message of its key is neither acknowledged nor (last) delivered to that same
    consumer -- i.e. a key never moves to a new consumer before the old one acked.
    """
    rng = random.Random(7)
    keys = [f"user-{i}" for i in range(12)]
    total = 480
    events: list[Event] = []
    counter = iter(range(10**9))

    acked_set: set[tuple[str, int]] = set()
    all_acked = trio.Event()

    def record(name: str, kind: str, msg) -> None:
        key = msg.key
        value = int(msg.value.decode().split(":")[1])
        events.append(Event(next(counter), trio.current_time(), name, kind, key, value))
        if kind == "acked":
            acked_set.add((key, value))
            if len(acked_set) == total:
                all_acked.set()

    with real_time_limit(120):
        async with Client(pigeon_standalone.url) as client:

            async def run_consumer(name: str, consumer: Consumer) -> None:
                inbox: list = []
                arrived = trio.Event()

                async def receiver() -> None:
                    nonlocal arrived
                    while True:
                        msgs = await consumer.batch_receive(100)
                        for m in msgs:
                            record(name, "delivered", m)
                        inbox.extend(msgs)
                        arrived.set()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(receiver)
                    while True:
                        while not inbox:
                            arrived = trio.Event()
                            await arrived.wait()
                        m = inbox.pop(0)
                        await trio.sleep(rng.uniform(0.01, 0.2))  # "processing"
                        await consumer.acknowledge(m)
                        record(name, "acked", m)

            consumers: dict[str, tuple[Consumer, trio.CancelScope]] = {}

            async def join(name: str, nursery: trio.Nursery) -> None:
                c = await client.subscribe(
                    "clicks",
                    "per-user",
                    subscription_type="key_shared",
                    consumer_name=name,
                    receiver_queue_size=20,
                )
                scope = trio.CancelScope()
                consumers[name] = (c, scope)

                async def task() -> None:
                    with scope:
                        await run_consumer(name, c)

                nursery.start_soon(task)

            async def leave(name: str) -> None:
                c, scope = consumers.pop(name)
                scope.cancel()  # stops processing: whatever it holds unacked is redelivered
                await c.close()

            async with trio.open_nursery() as nursery:
                await join("c1", nursery)

                async def producer_task() -> None:
                    producer = await client.create_producer("clicks", batching_max_messages=4)
                    next_value: dict[str, int] = defaultdict(int)
                    for i in range(total):
                        key = rng.choice(keys)
                        v = next_value[key]
                        next_value[key] += 1
                        await producer.send_async(f"{key}:{v}".encode(), key=key)
                        if i % 3 == 2:  # bursts of three: batches mix keys
                            await trio.sleep(0.15)
                    await producer.flush()
                    await producer.close()

                nursery.start_soon(producer_task)
                plan = [
                    (3, "join", "c2"),
                    (6, "join", "c3"),
                    (9, "leave", "c1"),
                    (12, "join", "c4"),
                    (15, "leave", "c2"),
                    (17, "join", "c5"),
                    (19, "leave", "c3"),
                ]
                start = trio.current_time()
                for at, what, name in plan:
                    await trio.sleep_until(start + at)
                    if what == "join":
                        await join(name, nursery)
                    else:
                        await leave(name)

                # let the remaining consumers finish everything
                with trio.move_on_after(120):
                    await all_acked.wait()
                sub = pigeon_standalone.service.topics[
                    "persistent://public/default/clicks"
                ].subscriptions["per-user"]
                held_by = [
                    (c.name, c.permits, c.join_offset, len(c.pending)) for c in sub.consumers
                ]
                stats = sub.dispatcher.statistics()
                state = (
                    f"mark_delete={sub.cursor.mark_delete} held={stats.held} "
                    f"redeliver={stats.redelivery_queue} consumers={held_by} "
                    f"max_dispatched={stats.max_dispatched} next_offset={sub.ledger.next_offset}"
                )
                for name in list(consumers):
                    await leave(name)

    delivered = [e for e in events if e.kind == "delivered"]
    assert len({e.consumer for e in delivered}) == 5

    # no message handed to a consumer while an earlier one of its key is outstanding elsewhere
    acked_at: dict[tuple[str, int], int] = {}
    last_owner: dict[tuple[str, int], str] = {}
    violations = []
    for e in sorted(events, key=lambda e: e.seq):
        if e.kind == "acked":
            acked_at.setdefault((e.key, e.value), e.seq)
            continue
        for earlier in range(e.value):
            k = (e.key, earlier)
            if k in acked_at:
                continue
            owner = last_owner.get(k)
            if owner != e.consumer:
                violations.append(
                    f"t={e.time:.2f} {e.consumer} got {e.key}:{e.value} while {e.key}:{earlier} "
                    f"was {'never delivered' if owner is None else f'unacked at {owner}'}"
                )
                break
        last_owner[(e.key, e.value)] = e.consumer
    assert not violations, "\n".join(violations[:10])

    # per-key order over the union of deliveries, redeliveries removed
    seen: dict[str, list[int]] = defaultdict(list)
    for e in delivered:
        if e.value not in seen[e.key]:
            seen[e.key].append(e.value)
    for key, vals in seen.items():
        assert vals == sorted(vals), (key, vals)

    # and nothing is lost
    acked = {(e.key, e.value) for e in events if e.kind == "acked"}
    assert len(acked) == total, f"only {len(acked)} of {total} messages were acknowledged; {state}"


async def test_key_shared_consumer_leaving_while_its_keys_are_held_strands_nothing(
    client, autojump_clock
):
    """c2 joins while c1 holds unacked messages (c2's new messages wait), c3 joins, c2
    leaves before its wait is over: every message must still reach someone."""
    # c1 holds the first message of every key unacknowledged
    sub, producer, c1, first = await _c1_holds_every_key(client, "ks-hold")
    c2 = await sub("c2")
    for k in KEYS:
        await producer.send(f"{k}:1".encode(), key=k)
    c3 = await sub("c3")
    got = await drain(c2, idle=1.0)
    assert got == [], "c2 got messages before c1 acked the earlier ones of their keys"
    await c2.close()
    for m in first:
        await c1.acknowledge(m)
    rest: list = []
    for _ in range(10):
        for c in (c1, c3):
            try:
                msgs = await c.batch_receive(100, timeout=1.0)
            except Timeout:
                continue
            for m in msgs:
                await c.acknowledge(m)
            rest.extend(msgs)
    missing = sorted({f"{k}:1".encode() for k in KEYS} - set(values(rest)))
    assert not missing, f"never delivered: {missing}"
    assert sorted(values(rest)) == sorted(f"{k}:1".encode() for k in KEYS)
    for c in (c1, c3):
        await c.close()
    await producer.close()


async def test_key_shared_redelivery_into_a_shared_batch_loses_nothing(client, autojump_clock):
    """One batch holds keys of two consumers; c2 leaves (its part goes to c1); c1 acks only
    that redelivered part and leaves: its own original part must still be redelivered."""
    keys = [f"k{i}" for i in range(20)]

    sub = key_shared(client, "ks-batch")

    c1, c2 = await sub("c1"), await sub("c2")
    producer = await client.create_producer(
        "ks-batch", batching_max_messages=100, batching_max_delay_ms=10_000
    )
    for k in keys:
        await producer.send_async(k.encode(), key=k)
    await producer.flush()  # one entry holding every key
    own1, own2 = await drain(c1), await drain(c2)
    assert own1 and own2 and len(own1) + len(own2) == 20
    await c2.close()
    moved = await drain(c1)
    assert sorted(values(moved)) == sorted(values(own2))
    assert all(m.redelivery_count == 1 for m in moved)
    for m in moved:
        await c1.acknowledge(m)
    await c1.close()  # own1 is still unacknowledged
    c3 = await sub("c3")
    again = await drain(c3)
    assert sorted(values(again)) == sorted(values(own1)), "c1's unacked messages were lost"
    await c3.close()
    await producer.close()

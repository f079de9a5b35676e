"""Nothing a caller passes to ``send`` may kill or wedge the client (issue #12, "Client bad
input"): a bad argument raises a typed error from the call itself, records nothing, and
the next normal send goes through at once, on every face.

Before the fix: a lone surrogate in a key or property killed the client's background
task (the batch failed to build in the batching timer) and every later send timed out; a
non-str property value raised but left a message slot in the batch, so the next batch was
refused; a 6 MB property key (only the value was measured) was resent in a loop.

The trio face runs against an in-process standalone in virtual time; the sync and
asyncio faces against one real ``pigeon standalone`` process for the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from pigeon.client import Client as SyncClient
from pigeon.client.asyncio import Client as AsyncioClient
from pigeon.client.trio import Client as TrioClient
from pigeon.core._codecs import NONE
from pigeon.core.batch import BatchBuilder
from pigeon.core.errors import InvalidArgument, MessageTooLarge, Timeout

MB = 1024 * 1024
OP_TIMEOUT = 10.0


Args = tuple[Any, dict[str, Any]]


def _case(value: Any = b"bad", **kwargs: Any) -> Callable[[], Args]:
    return lambda: (value, kwargs)


def _big_property_name() -> Args:
    return b"bad", {"properties": {"k" * (6 * MB): "v"}}


def _big_value_and_key() -> Args:
    return b"v" * (4 * MB), {"key": "k" * (3 * MB // 2)}


def _value_and_property_each_under_the_limit() -> Args:
    return b"v" * (2600 * 1024), {"properties": {"p": "x" * (2600 * 1024)}}


#: (id, the bad send's arguments (built when the test runs), the error it must raise)
BAD_SENDS: list[tuple[str, Callable[[], Args], type[Exception]]] = [
    ("surrogate-key", _case(key="\ud800"), InvalidArgument),
    ("surrogate-property-value", _case(properties={"k": "x\ud800"}), InvalidArgument),
    ("surrogate-property-name", _case(properties={"\udfff": "v"}), InvalidArgument),
    ("int-property-value", _case(properties={"k": 1}), InvalidArgument),
    ("int-property-name", _case(properties={1: "v"}), InvalidArgument),
    ("properties-not-a-mapping", _case(properties=[("k", "v")]), InvalidArgument),
    ("float-key", _case(key=3.5), InvalidArgument),
    ("str-value", _case("text"), InvalidArgument),
    ("none-value", _case(None), InvalidArgument),
    ("str-event-time", _case(event_time="soon"), InvalidArgument),
    ("huge-event-time", _case(event_time=2**64), InvalidArgument),
    ("nan-deliver-after", _case(deliver_after=float("nan")), InvalidArgument),
    ("inf-deliver-at", _case(deliver_at=float("inf")), InvalidArgument),
    ("6MB-property-name", _big_property_name, MessageTooLarge),
    ("4MB-value-1.5MB-key", _big_value_and_key, MessageTooLarge),
    ("2.6MB-value-2.6MB-property", _value_and_property_each_under_the_limit, MessageTooLarge),
]
CASES = [pytest.param(make, exc, id=name) for name, make, exc in BAD_SENDS]


# ----------------------------------------------------------------------------- the check

_ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=6)  # surrogates too
_NONE_CODEC = NONE


@settings(max_examples=300, deadline=None)
@given(
    name=st.text(max_size=20),
    value=st.binary(max_size=40),
    key=st.none() | _ANY_TEXT | st.binary(max_size=10),
    properties=st.none() | st.dictionaries(_ANY_TEXT, _ANY_TEXT, max_size=3),
    event_time=st.sampled_from([0, 1, -1, 2**63 - 1]),
)
def test_check_predicts_the_entry_size_and_every_build_failure(
    name: str, value: bytes, key: Any, properties: Any, event_time: int
) -> None:
    """What ``check`` accepts builds into an entry of exactly the size it said; what it
    refuses would have failed the whole batch in ``build`` (in the batching timer)."""
    builder = BatchBuilder(producer_name=name, codec=_NONE_CODEC)
    try:
        size = builder.check(value, key, properties, event_time)
    except InvalidArgument:
        with pytest.raises(InvalidArgument):
            builder.add(value, key, properties, event_time)
            builder.build(sequence_id=0, publish_time=0)
        return
    builder.add(value, key, properties, event_time)
    assert len(builder.build(sequence_id=0, publish_time=0)) == size


def topic_name() -> str:
    return f"bad-input-{uuid.uuid4().hex[:10]}"


# ----------------------------------------------------------------------------- trio


async def _trio_read_all(client: TrioClient, topic: str) -> list[bytes]:
    out: list[bytes] = []
    async with await client.create_reader(topic, "earliest") as reader:
        with contextlib.suppress(Timeout):  # nothing more within a second: all read
            while True:
                out.extend(m.value for m in await reader.batch_receive(100, timeout=1.0))
    return out


@pytest.mark.parametrize(("make", "error"), CASES)
async def test_trio_bad_send_raises_and_the_producer_goes_on(
    pigeon_standalone, autojump_clock, make, error
):
    value, kwargs = make()
    topic = topic_name()
    async with TrioClient(pigeon_standalone.url) as client:
        producer = await client.create_producer(topic, batching_max_delay_ms=20)
        results: list[Any] = []
        # a message already waiting in the batch the bad one would have joined
        await producer.send_async(b"before", callback=lambda m, e: results.append((m, e)))
        with pytest.raises(error):
            await producer.send_async(value, **kwargs)
        with pytest.raises(error):
            await producer.send(value, **kwargs)
        with trio.fail_after(5):
            after = await producer.send(b"after")
        assert [e for _m, e in results] == [None]
        assert after.offset == 1
        await producer.close()
        assert await _trio_read_all(client, topic) == [b"before", b"after"]


async def test_trio_surrogate_key_on_a_partitioned_topic(pigeon_standalone, autojump_clock):
    """The key is hashed to choose a partition: it is checked before that."""
    async with TrioClient(pigeon_standalone.url) as client:
        await client.create_topic("bad-input-partitioned", partitions=3)
        producer = await client.create_producer("bad-input-partitioned")
        with pytest.raises(InvalidArgument):
            await producer.send(b"x", key="\ud800")
        with trio.fail_after(5):
            await producer.send(b"ok", key="fine")
        await producer.close()


async def test_trio_callback_that_raises_does_not_stop_the_client(
    pigeon_standalone, autojump_clock
):
    def broken(msg_id: Any, error: BaseException | None) -> None:
        raise RuntimeError("application bug")

    async with TrioClient(pigeon_standalone.url) as client:
        producer = await client.create_producer("bad-callback")
        await producer.send_async(b"one", callback=broken)
        await producer.flush()
        with trio.fail_after(5):
            assert (await producer.send(b"two")).offset == 1
        await producer.close()


async def test_values_keys_and_properties_changed_after_the_call_do_not_reach_the_batch(
    pigeon_standalone, autojump_clock
):
    async with TrioClient(pigeon_standalone.url) as client:
        consumer = await client.subscribe("args-copy", "s", initial_position="earliest")
        producer = await client.create_producer("args-copy", batching_max_delay_ms=20)
        props: dict[str, str] = {}
        for i in range(3):
            props["n"] = str(i)
            key, value = bytearray(f"k{i}".encode()), bytearray(f"v{i}".encode())
            await producer.send_async(value, key=key, properties=props)
            props["n"], key[:], value[:] = "changed", b"changed", b"changed"
        await producer.flush()
        msgs = [await consumer.receive(timeout=5) for _ in range(3)]
        assert [m.properties for m in msgs] == [{"n": str(i)} for i in range(3)]
        assert [m.key for m in msgs] == ["k0", "k1", "k2"]
        assert [m.value for m in msgs] == [b"v0", b"v1", b"v2"]
        await producer.close()
        await consumer.close()


# ----------------------------------------------------------------------------- sync, asyncio


def _sync_read_all(client: SyncClient, topic: str) -> list[bytes]:
    out: list[bytes] = []
    with client.create_reader(topic, "earliest") as reader:
        while True:
            try:
                out.append(reader.read_next(timeout=1.0).value)
            except Timeout:
                return out


@pytest.mark.integration
@pytest.mark.parametrize(("make", "error"), CASES)
def test_sync_bad_send_raises_and_the_producer_goes_on(url: str, make, error) -> None:
    value, kwargs = make()
    topic = topic_name()
    with SyncClient(url, operation_timeout=OP_TIMEOUT) as client:
        with client.create_producer(topic, batching_max_delay_ms=20) as producer:
            before = producer.send_async(b"before")
            with pytest.raises(error):
                producer.send_async(value, **kwargs)
            with pytest.raises(error):
                producer.send(value, **kwargs)
            after = producer.send(b"after", timeout=5)  # the old client: Timeout
            assert before.result(timeout=5).offset == 0
            assert after.offset == 1
        assert _sync_read_all(client, topic) == [b"before", b"after"]


@pytest.mark.integration
@pytest.mark.parametrize(("make", "error"), CASES)
def test_asyncio_bad_send_raises_and_the_producer_goes_on(url: str, make, error) -> None:
    value, kwargs = make()
    topic = topic_name()

    async def scenario() -> None:
        async with AsyncioClient(url, operation_timeout=OP_TIMEOUT) as client:
            producer = await client.create_producer(topic, batching_max_delay_ms=20)
            before = producer.send_async(b"before")
            with pytest.raises(error):
                producer.send_async(value, **kwargs)
            with pytest.raises(error):
                await producer.send(value, **kwargs)
            after = await producer.send(b"after", timeout=5)
            assert (await asyncio.wait_for(before, 5)).offset == 0
            assert after.offset == 1
            await producer.close()
            reader = await client.create_reader(topic, "earliest")
            got = [(await reader.read_next(timeout=5)).value for _ in range(2)]
            assert got == [b"before", b"after"]
            with pytest.raises(Timeout):
                await reader.read_next(timeout=1.0)
            await reader.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))

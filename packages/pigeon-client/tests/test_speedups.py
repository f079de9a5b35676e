"""The sync producer's ``send_async`` hot path in C (``pigeon.client._speedups``) against
a real ``pigeon standalone`` process: it is built where a compiler is, it is what a
producer of one partition uses, and everything it sends is what the Python method sends
(``Producer.send_async``, the reference) — the same batches, ids, order and futures,
the same errors — with nothing leaked and nothing lost from several threads at once."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import inspect
import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest

from pigeon.client import Client, MessageId, _fast
from pigeon.client._sync import Producer
from pigeon.client.schema import StringSchema
from pigeon.core.errors import AlreadyClosed, ProducerQueueFull
from pigeon.core.testing.servers import clean_env

pytestmark = pytest.mark.integration

needs_c = pytest.mark.skipif(not _fast.SPEEDUPS, reason="pigeon.client._speedups not built")


@pytest.fixture
def client(url: str) -> Iterator[Client]:
    with Client(url) as c:
        yield c


def topic() -> str:
    return f"speedups-{uuid.uuid4().hex[:12]}"


def python_send(producer: Producer) -> Callable[..., Any]:
    """The reference: the Python ``send_async`` of ``producer``."""
    return Producer.send_async.__get__(producer)


def test_the_extension_is_built_where_a_compiler_is() -> None:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here: pure Python is the expected outcome")
    assert _fast.SPEEDUPS, "a compiler is here, but pigeon.client._speedups did not load"


def test_pigeon_no_speedups_keeps_the_python_method() -> None:
    env = clean_env()
    env["PIGEON_NO_SPEEDUPS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", "from pigeon.client import _fast; print(_fast.SPEEDUPS)"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    assert out.stdout.strip() == "False"


@needs_c
def test_a_producer_of_one_partition_gets_the_c_send_async(client: Client) -> None:
    with client.create_producer(topic()) as producer:
        assert type(producer.send_async).__name__ == "PlainSender"
        assert producer.send_async.__wrapped__ is Producer.send_async
        assert producer.send_async.__doc__ == Producer.send_async.__doc__
    with client.create_producer(topic(), schema=StringSchema()) as producer:
        # a schema encodes values: the Python method, always
        assert producer.send_async.__func__ is Producer.send_async
        assert producer.send_async("text").result(10).entry_id >= 0


def workload() -> list[tuple[Any, dict[str, Any]]]:
    """Messages of every kind: bytes alone (the C path), and every case it hands to
    Python: other bytes-likes, keys, properties, event times, callbacks, values too large
    for the open batch, a first message of each batch."""
    out: list[tuple[Any, dict[str, Any]]] = []
    for i in range(600):
        value: Any = b"v%05d" % i + b"." * (i % 37)
        kw: dict[str, Any] = {}
        if i % 97 == 5:
            value = bytearray(value)
        if i % 53 == 7:
            kw["key"] = f"k{i}"
        if i % 71 == 3:
            kw["properties"] = {"n": str(i)}
        if i % 89 == 11:
            kw["event_time"] = 1_700_000_000_000 + i
        if i % 113 == 13:
            value = b"L" * 5000  # over the batch's bytes: seals it
        out.append((value, kw))
    return out


@needs_c
def test_c_and_python_send_the_same_batches_ids_and_messages(client: Client) -> None:
    sent: dict[str, tuple[str, list[MessageId]]] = {}
    for name in ("c", "python"):
        t = topic()
        with client.create_producer(
            t, batching_max_messages=25, batching_max_bytes=4096, batching_max_delay_ms=60_000
        ) as producer:
            send = producer.send_async if name == "c" else python_send(producer)
            futures = [send(value, **kw) for value, kw in workload()]
            producer.flush()
            sent[name] = (t, [f.result(10) for f in futures])
    c_ids, py_ids = ([(i.entry_id, i.batch_index) for i in sent[n][1]] for n in ("c", "python"))
    assert c_ids == py_ids, "the C path batched differently from the Python method"
    assert len(set(c_ids)) == len(c_ids)
    for name in ("c", "python"):
        with client.create_reader(sent[name][0], "earliest") as reader:
            got = [reader.read_next(timeout=10) for _ in range(len(workload()))]
        assert [m.message_id for m in got] == sent[name][1]
        for m, (value, kw) in zip(got, workload(), strict=True):
            assert m.data == bytes(value)
            assert m.key == kw.get("key")
            assert dict(m.properties) == kw.get("properties", {})
            assert m.event_time == kw.get("event_time", 0)


@needs_c
def test_c_futures_are_futures(client: Client) -> None:
    called: list[MessageId] = []
    with client.create_producer(topic(), batching_max_delay_ms=60_000) as producer:
        first = producer.send_async(b"first")  # opens the batch (Python's path)
        futures = [producer.send_async(b"m%d" % i) for i in range(10)]
        futures[3].add_done_callback(lambda f: called.append(f.result()))
        assert not any(f.done() for f in futures)
        producer.flush()
        _, not_done = concurrent.futures.wait([first, *futures], timeout=10)
        assert not not_done
        ids = [f.result(0) for f in futures]
    assert [i.batch_index for i in ids] == list(range(1, 11))
    assert {i.entry_id for i in ids} == {first.result(0).entry_id}
    assert called == [ids[3]]
    assert not futures[0].cancel()


@needs_c
def test_errors_are_the_python_methods(client: Client) -> None:
    producer = client.create_producer(
        topic(), max_pending_messages=3, block_if_queue_full=False, batching_max_delay_ms=60_000
    )
    futures = [producer.send_async(b"x") for _ in range(3)]
    with pytest.raises(ProducerQueueFull):
        producer.send_async(b"one too many")
    producer.flush()
    assert all(f.result(10) for f in futures)
    producer.close()
    with pytest.raises(AlreadyClosed):
        producer.send_async(b"after close")
    with pytest.raises(TypeError):
        producer.send_async()


@needs_c
def test_nothing_is_leaked(client: Client) -> None:
    payload = b"p" * 100
    with client.create_producer(topic(), batching_max_messages=500) as producer:
        before = sys.getrefcount(payload)
        for _ in range(3):
            futures = [producer.send_async(payload) for _ in range(20_000)]
            producer.flush()
            assert all(f.done() for f in futures)
            del futures
        gc.collect()
        assert sys.getrefcount(payload) == before, "the C path keeps references to values"
        blocks = sys.getallocatedblocks()
        for _ in range(3):
            futures = [producer.send_async(payload) for _ in range(20_000)]
            producer.flush()
            del futures
        gc.collect()
        # one round's worth (60,000 futures) would be hundreds of thousands of blocks
        assert sys.getallocatedblocks() - blocks < 5_000


@needs_c
def test_threads_sending_at_once_lose_nothing_and_keep_their_order(client: Client) -> None:
    t = topic()
    per_thread = 5_000
    with client.create_producer(
        t, batching_max_messages=100, batching_max_delay_ms=1, max_pending_messages=2_000
    ) as producer:

        def sender(n: int) -> None:
            for i in range(per_thread):
                producer.send_async(b"%d:%d" % (n, i))

        threads = [threading.Thread(target=sender, args=(n,)) for n in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads)
        producer.flush()
    with client.create_reader(t, "earliest") as reader:
        got = [reader.read_next(timeout=10).data.decode() for _ in range(4 * per_thread)]
    by_thread: dict[str, list[int]] = {}
    for text in got:
        n, i = text.split(":")
        by_thread.setdefault(n, []).append(int(i))
    assert by_thread == {str(n): list(range(per_thread)) for n in range(4)}


@needs_c
def test_odd_max_pending_messages_keep_the_python_method(client: Client) -> None:
    for max_pending in (float("inf"), 1e6, 2**64):
        with client.create_producer(topic(), max_pending_messages=max_pending) as producer:
            assert producer.send_async.__func__ is Producer.send_async
            assert producer.send(b"x", timeout=10).entry_id >= 0


@needs_c
def test_a_patched_send_async_sees_every_call(client: Client) -> None:
    """``mock.patch.object(Producer, "send_async")``, the usual way to intercept sends in a
    test, sees the C path's calls too."""
    with client.create_producer(topic(), batching_max_delay_ms=60_000) as producer:
        with mock.patch.object(Producer, "send_async", autospec=True) as patched:
            producer.send_async(b"a")
            producer.send_async(b"b", key="k")
        assert patched.call_count == 2
        after = producer.send_async(b"after")
        producer.flush()
        assert isinstance(after.result(10), MessageId)
    # the bound method's signature: ``value`` first, no ``self``
    assert next(iter(inspect.signature(producer.send_async).parameters)) == "value"


@pytest.mark.parametrize("path", ["c", "python"])
def test_sends_racing_close_fail_or_are_stored(client: Client, path: str) -> None:
    """Sends from another thread while ``close()`` runs either raise AlreadyClosed or get
    a receipt: none is left in a batch nothing seals (it was, when ``closed`` was set only
    after the flush)."""
    producer = client.create_producer(topic(), batching_max_delay_ms=300)
    send = producer.send_async if path == "c" else python_send(producer)
    accepted: list[Any] = []
    sending = threading.Event()

    def sender() -> None:
        with contextlib.suppress(AlreadyClosed):
            for i in range(1_000_000):
                accepted.append(send(b"m%d" % i))
                if i == 1_000:
                    sending.set()
        sending.set()

    thread = threading.Thread(target=sender)
    thread.start()
    assert sending.wait(30)
    producer.close()
    thread.join(30)
    assert not thread.is_alive()
    _, unresolved = concurrent.futures.wait(accepted, timeout=30)
    assert not unresolved, f"{len(unresolved)} sends accepted during close() got no receipt"
    assert producer._handle.outstanding == 0


@needs_c
def test_a_producer_of_another_shape_keeps_the_python_method(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects the C path cannot read (here: a BatchBuilder whose ``_values`` is no
    slot) leave the producer on the Python method instead of failing to open it."""
    from pigeon.core import _batch_builder

    class Builder(_batch_builder.BatchBuilder):
        _values = None  # type: ignore[assignment]  # a class attribute over the slot

    monkeypatch.setattr("pigeon.client._core.BatchBuilder", Builder)
    with client.create_producer(topic()) as producer:
        assert producer.send_async.__func__ is Producer.send_async

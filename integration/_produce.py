"""Produce and receive helpers of the integration tests (the sync client against real
``pigeon standalone`` processes): bounded receives, the content of sent messages, and a
producer that sends in the background until stopped.

Every wait is bounded in time and iterations.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pigeon.client import Client, Consumer, Message, MessageId, Timeout

OP_TIMEOUT = 10.0  # client operation timeout: a dead server fails a call, never hangs it


def receive_n(consumer: Consumer, n: int, *, timeout: float = 30.0) -> list[Message]:
    """Exactly ``n`` messages (fails if they do not all arrive within ``timeout``)."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    for _ in range(n + 10_000):
        if len(out) >= n:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            out.extend(consumer.batch_receive(min(1000, n - len(out)), timeout=min(left, 1.0)))
        except Timeout:
            continue
    assert len(out) == n, f"received {len(out)} of {n} messages within {timeout}s"
    return out


def drain(consumer: Consumer, *, idle: float = 0.5, limit: int = 100_000) -> list[Message]:
    """Whatever else arrives until nothing came for ``idle`` seconds (at most ``limit``)."""
    out: list[Message] = []
    while len(out) < limit:
        try:
            out.extend(consumer.batch_receive(1000, timeout=idle))
        except Timeout:
            return out
    raise AssertionError(f"more than {limit} messages kept arriving")


def assert_nothing_more(consumer: Consumer, idle: float = 0.5) -> None:
    extra = drain(consumer, idle=idle, limit=1000)
    assert not extra, f"unexpected extra deliveries: {extra[:5]}"


def receive_ids(
    consumer: Consumer, wanted: Iterable[MessageId], *, timeout: float = 30.0
) -> list[Message]:
    """Receive until every id in ``wanted`` was seen, then drain the rest."""
    missing = set(wanted)
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    for _ in range(len(missing) + 10_000):
        if not missing:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            batch = consumer.batch_receive(1000, timeout=min(left, 1.0))
        except Timeout:
            continue
        out.extend(batch)
        missing.difference_update(m.message_id for m in batch)
    assert not missing, (
        f"{len(missing)} broker-acknowledged messages are missing, e.g. {sorted(missing)[:5]}"
    )
    return out + drain(consumer)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Sent:
    value: bytes
    key: str | None
    properties: dict[str, str]


def produce(url: str, topic: str, items: list[Sent], **producer_options: Any) -> list[MessageId]:
    """Send ``items`` (send_async + flush) and return the broker's MessageIds, in order."""
    with (
        Client(url, operation_timeout=OP_TIMEOUT) as client,
        client.create_producer(topic, **producer_options) as producer,
    ):
        futures = [
            producer.send_async(s.value, key=s.key, properties=s.properties or None) for s in items
        ]
        producer.flush()
        return [f.result(timeout=OP_TIMEOUT) for f in futures]


def assert_content(received: list[Message], sent: list[Sent]) -> None:
    assert len(received) == len(sent)
    for i, (m, s) in enumerate(zip(received, sent, strict=True)):
        assert (m.value, m.key, m.properties) == (s.value, s.key, s.properties), (
            f"message {i} (offset {m.offset}) differs"
        )


def read_all(client: Client, topic: str, *, idle: float = 1.0) -> list[Message]:
    """Everything stored on ``topic``, read from the earliest (until ``idle`` seconds
    pass without a message)."""
    reader = client.create_reader(topic, "earliest")
    try:
        return drain(reader, idle=idle)
    finally:
        reader.close()


def background_message(i: int) -> Sent:
    """The ``i``-th message of a :class:`BackgroundProducer`: a value, a key of seven and
    a property."""
    return Sent(f"bg-{i}".encode(), f"bg-key-{i % 7}", {"bg": str(i)})


class BackgroundProducer(threading.Thread):
    """Sends numbered messages (``message(i)``) in bursts until stopped; remembers every
    future.  At most ``burst`` sends are in flight: a paused server does not pile them up.

    After the server is killed its pending sends fail (send timeout); closing the
    producer and the client is bounded by that timeout.
    """

    def __init__(
        self,
        url: str,
        topic: str,
        *,
        burst: int = 20,
        send_timeout: float = 2.0,
        message: Callable[[int], Sent] = background_message,
    ) -> None:
        super().__init__(name="background-producer", daemon=True)
        self.url = url
        self.topic = topic
        self.burst = burst
        self.send_timeout = send_timeout
        self.message = message
        self.stop = threading.Event()
        self.sent: list[tuple[Sent, concurrent.futures.Future[MessageId]]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with (
                Client(self.url, operation_timeout=OP_TIMEOUT) as client,
                client.create_producer(
                    self.topic,
                    batching_max_messages=self.burst,
                    batching_max_delay_ms=1,
                    send_timeout=self.send_timeout,
                ) as producer,
            ):
                for i in range(1_000_000):
                    if self.stop.is_set():
                        break
                    s = self.message(i)
                    fut = producer.send_async(s.value, key=s.key, properties=s.properties or None)
                    self.sent.append((s, fut))
                    if i % self.burst == self.burst - 1:
                        recent = [f for _, f in self.sent[-self.burst :]]
                        concurrent.futures.wait(recent, timeout=3 * self.send_timeout)
        except BaseException as exc:  # reported by the test, never lost in the thread
            self.error = exc

    def acknowledged(self) -> list[tuple[Sent, MessageId]]:
        out = []
        for s, f in list(self.sent):
            if f.done() and f.exception() is None:
                out.append((s, f.result()))
        return out

    def wait_acknowledged(self, count: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.acknowledged()) < count:
            assert self.error is None, f"background producer failed: {self.error!r}"
            assert time.monotonic() < deadline, (
                f"only {len(self.acknowledged())} of {count} background sends acknowledged"
            )
            time.sleep(0.01)

    def stop_and_join(self, timeout: float = 30.0) -> None:
        self.stop.set()
        self.join(timeout)
        assert not self.is_alive(), "background producer did not stop"

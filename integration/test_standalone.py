"""Acceptance tests of ``pigeon standalone`` as a real process, over loopback.

Each test starts its own server (see ``conftest.py``) on free ports with its data under
``tmp_path``, talks to it with the sync client, the CLI or raw sockets, and leaves it to
the fixture to kill it by PID.  Every wait is bounded in time and iterations; no
assertion depends on how fast the machine is (a slow machine can only make a check
weaker, never make it fail).
"""

from __future__ import annotations

import collections
import concurrent.futures
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
from _wire import RawConnection, frame_bytes

from pigeon.client import Client, Consumer, Message, MessageId, Timeout
from pigeon.core import PluginManager
from pigeon.core._codecs import CodecSet
from pigeon.core._framing import DEFAULT_MAX_FRAME_SIZE, build_message, encode_frame
from pigeon.core._schema import BrokerFrame
from pigeon.core.batch import BatchBuilder
from pigeon.core.errors import (
    CorruptFrame,
    FrameTooLarge,
    InvalidTopicName,
    MessageTooLarge,
    ProtocolError,
    ProtocolVersionMismatch,
    UnknownMessageType,
)
from pigeon.core.testing.servers import Standalone, clean_env, free_ports, pigeon_command

pytestmark = pytest.mark.integration

MAX_MESSAGE_SIZE = 5 * 1024 * 1024  # the broker's default max_message_size
OP_TIMEOUT = 10.0  # client operation timeout: a dead server fails a call, never hangs it


# ----------------------------------------------------------------------------- helpers


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


# ------------------------------------------------------------------ a. 10,000 in order


def message_a(i: int) -> Sent:
    """Varied content: binary and empty values, missing keys and properties, non-ASCII."""
    value = f"value-{i}|".encode() + bytes((i * 7 + j) % 256 for j in range(i % 41))
    if i % 997 == 0:
        value = b""
    key = None if i % 7 == 0 else f"key-{i % 100}-ключ"
    properties = {} if i % 5 == 0 else {"i": str(i), "mod3": str(i % 3), "ü": "✓" * (i % 3)}
    return Sent(value, key, properties)


def test_10000_messages_in_order_with_content_intact(standalone: Standalone) -> None:
    n = 10_000
    sent = [message_a(i) for i in range(n)]
    before_ms = int(time.time() * 1000)
    ids = produce(
        standalone.url, "events", sent, batching_max_messages=1000, batching_max_delay_ms=5
    )
    after_ms = int(time.time() * 1000)
    assert [mid.offset for mid in ids] == list(range(n))
    assert len(set(ids)) == n

    with (
        Client(standalone.url, operation_timeout=OP_TIMEOUT) as client,
        client.subscribe(
            "events", "sub-a", subscription_type="exclusive", initial_position="earliest"
        ) as consumer,
    ):
        received = receive_n(consumer, n, timeout=60)
        assert [m.offset for m in received] == list(range(n))
        assert [m.message_id for m in received] == ids
        assert_content(received, sent)
        for m in received:
            assert before_ms - 5000 <= m.publish_time <= after_ms + 5000, m
            assert m.redelivery_count == 0
            assert m.topic == "persistent://public/default/events"
        consumer.acknowledge_cumulative(received[-1])
        assert_nothing_more(consumer)


# ------------------------------------------------------------------ b. crash recovery


class BackgroundProducer(threading.Thread):
    """Sends numbered messages in bursts until stopped; remembers every future.

    After the server is killed its pending sends fail (send timeout); closing the
    producer and the client is bounded by that timeout.
    """

    def __init__(self, url: str, topic: str, *, burst: int = 20, send_timeout: float = 2.0):
        super().__init__(name="background-producer", daemon=True)
        self.url = url
        self.topic = topic
        self.burst = burst
        self.send_timeout = send_timeout
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
                    s = Sent(f"bg-{i}".encode(), f"bg-key-{i % 7}", {"bg": str(i)})
                    fut = producer.send_async(s.value, key=s.key, properties=s.properties)
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


def test_crash_recovery_keeps_acknowledged_messages_and_acks(standalone: Standalone) -> None:
    topic = "crash"
    first, acked_count, held_count = 1000, 600, 200
    sent_first = [Sent(f"first-{i}".encode(), f"k{i % 10}", {"i": str(i)}) for i in range(first)]
    expected: dict[MessageId, Sent] = dict(
        zip(
            produce(standalone.url, topic, sent_first, batching_max_messages=50),
            sent_first,
            strict=True,
        )
    )

    # Acknowledge the first 600 and close the consumer: close persists the cursor.
    with (
        Client(standalone.url, operation_timeout=OP_TIMEOUT) as client,
        client.subscribe(topic, "orig", initial_position="earliest") as consumer,
    ):
        acked = receive_n(consumer, acked_count)
        assert [m.offset for m in acked] == list(range(acked_count))
        for m in acked:
            consumer.acknowledge(m)

    background = BackgroundProducer(standalone.url, topic)
    background.start()
    holder = Client(standalone.url, operation_timeout=OP_TIMEOUT)
    try:
        background.wait_acknowledged(200)
        # Receive 200 more without acknowledging them, and keep that consumer open.
        consumer = holder.subscribe(topic, "orig", initial_position="earliest")
        held = receive_n(consumer, held_count)
        assert [m.offset for m in held] == list(range(acked_count, acked_count + held_count))

        assert background.is_alive(), "the producer must still be sending when the server dies"
        standalone.kill9()
        background.stop_and_join()
        consumer.close()
    finally:
        holder.close()
        background.stop_and_join()
    assert background.error is None, f"background producer failed: {background.error!r}"
    bg_acked = background.acknowledged()
    assert len(bg_acked) >= 200
    expected.update((mid, s) for s, mid in bg_acked)

    standalone.restart()
    with Client(standalone.url, operation_timeout=OP_TIMEOUT) as client:
        # Every message the broker acknowledged survived, intact, in one contiguous log.
        with client.subscribe(topic, "audit", initial_position="earliest") as audit:
            stored = receive_ids(audit, expected)
        offsets = [m.offset for m in stored]
        assert offsets == list(range(len(stored))), "offsets are not contiguous after recovery"
        values = [m.value for m in stored]
        assert len(values) == len(set(values)), "a message is stored twice"
        for m in stored:
            s = expected.get(m.message_id)
            if s is not None:
                assert (m.value, m.key, m.properties) == (s.value, s.key, s.properties), m
            else:  # sent, unacknowledged when the server died, yet stored: must be whole
                assert m.value.startswith(b"bg-"), m

        # The original subscription resumes after the 600 acked messages: the 200 that
        # were received but not acknowledged come again, and nothing acked does.
        with client.subscribe(topic, "orig", initial_position="earliest") as consumer:
            again = receive_n(consumer, len(stored) - acked_count)
            assert [m.offset for m in again] == list(range(acked_count, len(stored)))
            assert [m.value for m in again[:held_count]] == [m.value for m in held]
            assert_nothing_more(consumer)


# ------------------------------------------------------------------ c. shared subscription


def poll(
    consumers: dict[str, Consumer],
    on_message: Callable[[str, Message], None],
    until: Callable[[], bool],
    *,
    timeout: float = 30.0,
    what: str = "",
) -> None:
    deadline = time.monotonic() + timeout
    for _ in range(1_000_000):
        if until():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for name, consumer in consumers.items():
            try:
                batch = consumer.batch_receive(100, timeout=0.02)
            except Timeout:
                continue
            for m in batch:
                on_message(name, m)
    raise AssertionError(f"gave up waiting for {what}")


def test_shared_subscription_redelivers_unacked_messages_of_a_closed_consumer(
    standalone: Standalone,
) -> None:
    topic, sub, n = "shared-topic", "workers", 300
    with Client(standalone.url, operation_timeout=OP_TIMEOUT) as client:
        consumers = {
            name: client.subscribe(
                topic,
                sub,
                subscription_type="shared",
                initial_position="earliest",
                consumer_name=name,
            )
            for name in ("a", "b", "c")
        }
        try:
            # Small batches (an entry goes whole to one consumer), so all three get some.
            with client.create_producer(topic, batching_max_messages=5) as producer:
                futures = [producer.send_async(f"job-{i}".encode()) for i in range(n)]
                producer.flush()
            all_ids = {f.result(timeout=OP_TIMEOUT) for f in futures}
            assert len(all_ids) == n

            received: dict[str, list[Message]] = {"a": [], "b": [], "c": []}
            acks: dict[str, list[MessageId]] = {"a": [], "b": []}

            def on_message(name: str, m: Message) -> None:
                received[name].append(m)
                if name != "c":  # c holds everything it gets
                    consumers[name].acknowledge(m)
                    acks[name].append(m.message_id)

            poll(
                consumers,
                on_message,
                lambda: sum(map(len, received.values())) >= n,
                what="the first delivery of every message",
            )
            delivered = [m.message_id for ms in received.values() for m in ms]
            assert len(delivered) == n and set(delivered) == all_ids, "each message to exactly one"
            assert all(received[name] for name in "abc"), {k: len(v) for k, v in received.items()}
            assert all(m.redelivery_count == 0 for ms in received.values() for m in ms)
            held = {m.message_id: m.value for m in received["c"]}

            # c leaves without acknowledging: its messages go to a and b.
            consumers.pop("c").close()
            redelivered: list[Message] = []

            def on_redelivery(name: str, m: Message) -> None:
                redelivered.append(m)
                on_message(name, m)

            poll(
                consumers,
                on_redelivery,
                lambda: len(redelivered) >= len(held),
                what="redelivery of c's unacknowledged messages",
            )
            assert_nothing_more(consumers["a"], idle=0.3)
            assert_nothing_more(consumers["b"], idle=0.3)
            assert {m.message_id: m.value for m in redelivered} == held
            assert len(redelivered) == len(held)
            assert all(m.redelivery_count >= 1 for m in redelivered), [
                (m.message_id, m.redelivery_count) for m in redelivered if m.redelivery_count < 1
            ]

            counts = collections.Counter(acks["a"] + acks["b"])
            assert set(counts) == all_ids
            assert max(counts.values()) == 1, "a message was acknowledged twice"
        finally:
            for consumer in consumers.values():
                consumer.close()

        # The broker agrees that nothing is left on the subscription.
        with client.subscribe(topic, sub, subscription_type="shared") as consumer:
            assert_nothing_more(consumer, idle=1.0)


# ------------------------------------------------------------------ d. clean shutdown


def test_sigterm_exits_cleanly_and_data_survives_restart(standalone: Standalone) -> None:
    topic, n, acked_count = "shutdown", 500, 200
    sent = [Sent(f"m-{i}".encode(), f"k-{i % 3}", {"n": str(i)}) for i in range(n)]
    produce(standalone.url, topic, sent)
    with Client(standalone.url, operation_timeout=OP_TIMEOUT) as client:
        with client.subscribe(topic, "d", initial_position="earliest") as consumer:
            for m in receive_n(consumer, acked_count):
                consumer.acknowledge(m)
        # SIGTERM while a producer and a consumer are still connected.
        producer = client.create_producer(topic)
        live = client.subscribe(topic, "live", initial_position="earliest")
        receive_n(live, 10)
        code = standalone.terminate(timeout=15)  # raises if it takes longer
        assert code == 0, f"exit code {code}; log:\n{standalone.log_tail()}"
        live.close()
        producer.close()
    assert "Traceback" not in standalone.log_text(), standalone.log_tail()

    standalone.restart()
    with Client(standalone.url, operation_timeout=OP_TIMEOUT) as client:
        with client.subscribe(topic, "audit", initial_position="earliest") as audit:
            stored = receive_n(audit, n)
            assert [m.offset for m in stored] == list(range(n))
            assert_content(stored, sent)
            assert_nothing_more(audit)
        with client.subscribe(topic, "d", initial_position="earliest") as consumer:
            rest = receive_n(consumer, n - acked_count)
            assert [m.offset for m in rest] == list(range(acked_count, n))
        with client.create_producer(topic) as producer:
            assert producer.send(b"after restart").offset == n


def test_sigterm_closes_every_topic_without_errors(standalone: Standalone) -> None:
    # A clean shutdown persists every cursor and closes every ledger (so the next start
    # has nothing to recover); none of that may fail.
    topics = [f"many-{i}" for i in range(6)]
    with Client(standalone.url, operation_timeout=OP_TIMEOUT) as client:
        for topic in topics:
            with client.create_producer(topic) as producer:
                producer.send(b"one", key="k")
                producer.send(b"two", key="k")
            with client.subscribe(topic, "s", initial_position="earliest") as consumer:
                consumer.acknowledge(consumer.receive(timeout=OP_TIMEOUT))
    assert standalone.terminate(timeout=15) == 0
    log = standalone.log_text()
    assert "shutting down" in log, standalone.log_tail()
    shutdown = log[log.index("shutting down") :].splitlines()
    problems = [line for line in shutdown if "level=WARNING" in line or "level=ERROR" in line]
    assert not problems, "clean shutdown reported failures:\n" + "\n".join(problems)

    standalone.restart()
    with Client(standalone.url, operation_timeout=OP_TIMEOUT) as client:
        for topic in topics:
            with client.subscribe(topic, "s", initial_position="earliest") as consumer:
                m = consumer.receive(timeout=OP_TIMEOUT)
                assert (m.value, m.offset) == (b"two", 1), topic
            with client.create_producer(topic) as producer:
                assert producer.send(b"three").offset == 2, topic


# ------------------------------------------------------------------ e. CLI round trip


def run_cli(
    *args: str, stdin: str | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*pigeon_command(), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(),
        check=False,
    )
    assert result.returncode == 0, (
        f"pigeon {' '.join(args)} exited {result.returncode}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


def test_a_second_instance_on_taken_ports_says_so_in_one_line(
    standalone: Standalone, tmp_path: Any
) -> None:
    """A second ``pigeon standalone`` on ports another one holds exits 2 with one line
    naming the server and the address (it printed a 100-line exception group)."""
    bookie_port, broker_port = free_ports(2)
    for args, server, port in (
        (["--bookie-port", str(standalone.bookie_port)], "pigeon-bookie", standalone.bookie_port),
        (
            ["--port", str(standalone.port), "--bookie-port", str(bookie_port)],
            "pigeon-broker",
            standalone.port,
        ),
        (
            [
                "--port",
                str(broker_port),
                "--bookie-port",
                str(bookie_port),
                "--http-port",
                str(standalone.http_port),
            ],
            "admin API",
            standalone.http_port,
        ),
    ):
        result = subprocess.run(
            [
                *pigeon_command(),
                "--log-level",
                "ERROR",
                "standalone",
                "--data-dir",
                str(tmp_path / server),
                "--http-port",
                "-1",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
            check=False,
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"error: ConfigError: {server} cannot listen on 127.0.0.1:{port}: address already"
            " in use (is another instance running? pick another port)"
        ]


def test_cli_produce_then_consume(standalone: Standalone) -> None:
    url, topic = standalone.url, "cli-topic"
    out = run_cli(
        "produce", topic, "m1", "m2", "m3", "-u", url, "-k", "the-key", "-p", "a=1", "-p", "b=two"
    )
    assert "3 messages produced" in out.stderr
    out = run_cli("produce", topic, "-u", url, stdin="line-4\nline 5 with spaces\n")
    assert "2 messages produced" in out.stderr

    out = run_cli("consume", topic, "-s", "plain", "-u", url, "-n", "5", "--timeout", "10")
    assert out.stdout.splitlines() == ["m1", "m2", "m3", "line-4", "line 5 with spaces"]
    assert "5 messages consumed" in out.stderr

    out = run_cli(
        "consume", topic, "-s", "keyed", "-u", url, "-n", "5", "--timeout", "10", "--show-key"
    )
    lines = out.stdout.splitlines()
    assert len(lines) == 5, out.stdout
    for i, line in enumerate(lines[:3]):
        assert "key='the-key'" in line and f"offset={i}" in line, line
        assert "'a': '1'" in line and "'b': 'two'" in line, line
        assert line.endswith(f"value=m{i + 1}"), line
    assert "key=None" in lines[3] and lines[4].endswith("value=line 5 with spaces")

    # consume acknowledged what it printed: the subscription has nothing left.
    out = run_cli("consume", topic, "-s", "plain", "-u", url, "-n", "1", "--timeout", "1")
    assert out.stdout == ""
    assert "0 messages consumed" in out.stderr


# ------------------------------------------------------------------ f. bad input

BASELINE_TOPIC = "baseline"
BASELINE = [Sent(f"baseline-{i}".encode(), f"bk{i}", {"b": str(i)}) for i in range(20)]


@pytest.fixture
def server(standalone: Standalone) -> Standalone:
    """A standalone that already stores a known topic (checked after each bad input)."""
    ids = produce(standalone.url, BASELINE_TOPIC, BASELINE)
    assert [mid.offset for mid in ids] == list(range(len(BASELINE)))
    return standalone


def assert_still_serving(server: Standalone) -> None:
    """The server is alive, serves a new well-behaved client, and kept its data."""
    assert server.running, f"server died; log:\n{server.log_tail()}"
    with Client(server.url, operation_timeout=OP_TIMEOUT) as client:
        topic = unique("after")
        with client.subscribe(topic, "s", initial_position="earliest") as consumer:
            with client.create_producer(topic) as producer:
                mid = producer.send(b"still here", key="k")
            m = consumer.receive(timeout=OP_TIMEOUT)
            assert (m.value, m.key, m.message_id) == (b"still here", "k", mid)
        with client.subscribe(BASELINE_TOPIC, unique("check"), initial_position="earliest") as c:
            stored = receive_n(c, len(BASELINE))
            assert [m.offset for m in stored] == list(range(len(BASELINE)))
            assert_content(stored, BASELINE)
            assert_nothing_more(c, idle=0.3)


def error_codes(frames: list[Any]) -> list[int | None]:
    return [f.error_code for f in frames]


@pytest.mark.parametrize(
    ("garbage", "code"),
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: pigeon\r\n\r\n", FrameTooLarge.code, id="http"),
        pytest.param(struct.pack("<I", 64) + b"\xff" * 64, CorruptFrame.code, id="bad-capnp"),
        pytest.param(struct.pack("<I", 3) + b"abc", CorruptFrame.code, id="short-frame"),
    ],
)
def test_garbage_bytes_get_a_typed_error_and_a_close(
    server: Standalone, garbage: bytes, code: int
) -> None:
    for after_handshake in (False, True):
        with RawConnection(server.port) as raw:
            if after_handshake:
                raw.handshake()
            raw.send(garbage)
            if garbage.startswith(b"GET ") and not after_handshake:
                # an HTTP client on the native port is answered in HTTP, which it can show
                raw._fill(12, time.monotonic() + OP_TIMEOUT)
                assert bytes(raw._buf).startswith(b"HTTP/1.1 400"), bytes(raw._buf[:80])
                continue
            assert error_codes(raw.read_until_closed()) == [code], after_handshake
    assert_still_serving(server)


def test_oversize_length_prefix_is_refused_before_reading_the_body(server: Standalone) -> None:
    with RawConnection(server.port) as raw:
        raw.handshake()
        # Announce 4 GiB - 1 and one byte over the limit; send only a few bytes of body.
        raw.send(struct.pack("<I", DEFAULT_MAX_FRAME_SIZE + 1) + b"\0" * 16)
        assert error_codes(raw.read_until_closed()) == [FrameTooLarge.code]
    with RawConnection(server.port) as raw:
        raw.send(struct.pack("<I", 0xFFFFFFFF) + b"\0" * 16)
        assert error_codes(raw.read_until_closed()) == [FrameTooLarge.code]
    assert_still_serving(server)


def _batch(values: list[bytes], *, producer_name: str, sequence_id: int = 0) -> bytes:
    builder = BatchBuilder(
        producer_name=producer_name,
        codec=CodecSet.from_registry(PluginManager().codecs).by_name("none"),
        max_messages=len(values),
        max_bytes=1 << 30,
    )
    for v in values:
        builder.add(v)
    return builder.build(sequence_id=sequence_id, publish_time=int(time.time() * 1000))


def _raw_producer(raw: RawConnection, topic: str) -> str:
    answer = raw.request("createProducer", {"producerId": 1, "topic": topic}, request_id=2)
    assert answer.kind == "producerCreated", answer
    return str(answer.body["producerName"])


def test_truncated_frames_then_disconnect_store_nothing(server: Standalone) -> None:
    topic = "truncated"
    # A send frame cut in half: its batch must not be stored.
    with RawConnection(server.port) as raw:
        raw.handshake()
        name = _raw_producer(raw, topic)
        frame = frame_bytes(
            "send",
            {"producerId": 1, "sequenceId": 0, "numMessages": 2},
            request_id=3,
            payload=_batch([b"half-1", b"half-2"], producer_name=name),
        )
        raw.send(frame[: len(frame) // 2])
    # A length prefix promising more than ever comes; and a prefix cut in half.
    with RawConnection(server.port) as raw:
        raw.handshake()
        raw.send(struct.pack("<I", 1000) + b"\0" * 10)
    with RawConnection(server.port) as raw:
        raw.send(frame_bytes("connect", {"protocolVersion": 1, "clientName": "x"})[:2])

    assert_still_serving(server)
    with Client(server.url, operation_timeout=OP_TIMEOUT) as client:
        with client.create_producer(topic) as producer:
            assert producer.send(b"whole").offset == 0, "part of a truncated frame was stored"
        with client.subscribe(topic, "s", initial_position="earliest") as consumer:
            assert consumer.receive(timeout=OP_TIMEOUT).value == b"whole"
            assert_nothing_more(consumer)


def test_wrong_protocol_version_gets_version_mismatch_then_close(server: Standalone) -> None:
    message = build_message(BrokerFrame, 1, "connect", {"protocolVersion": 99, "clientName": "x"})
    with RawConnection(server.port) as raw:
        raw.send(b"".join(bytes(p) for p in encode_frame(message)))
        frames = raw.read_until_closed()
    assert [(f.request_id, f.error_code) for f in frames] == [(1, ProtocolVersionMismatch.code)]
    assert "99" in frames[0].body["message"]
    assert_still_serving(server)


def test_request_before_connect_gets_protocol_error_then_close(server: Standalone) -> None:
    # errors.ProtocolError: "The peer broke the protocol; the connection is closed."
    with RawConnection(server.port) as raw:
        raw.send(frame_bytes("lookup", {"topic": "events"}, request_id=1))
        frames = raw.read_until_closed()
    assert [(f.request_id, f.error_code) for f in frames] == [(1, ProtocolError.code)]
    assert_still_serving(server)


INVALID_TOPICS = [
    "bad topic",
    "a/b",
    "a/b/c/d",
    "http://public/default/x",
    "persistent://public/default",
    "events/",
    "x" * 300,
]


def test_invalid_topic_names(server: Standalone) -> None:
    with Client(server.url, operation_timeout=OP_TIMEOUT) as client:
        for topic in INVALID_TOPICS:
            with pytest.raises(InvalidTopicName):
                client.create_producer(topic)
            with pytest.raises(InvalidTopicName):
                client.subscribe(topic, "s")
    # The broker checks too, whatever a client does, and keeps the connection.
    with RawConnection(server.port) as raw:
        raw.handshake()
        request_id = 1
        for topic in INVALID_TOPICS:
            request_id += 1
            answer = raw.request("lookup", {"topic": topic}, request_id=request_id)
            assert (answer.request_id, answer.error_code) == (request_id, InvalidTopicName.code)
            request_id += 1
            answer = raw.request(
                "createProducer", {"producerId": 1, "topic": topic}, request_id=request_id
            )
            assert (answer.request_id, answer.error_code) == (request_id, InvalidTopicName.code)
        assert raw.request("ping", None, request_id=request_id + 1).kind == "ok"
    assert_still_serving(server)


def test_message_over_max_size_is_refused_and_nothing_stored(server: Standalone) -> None:
    topic = "big"
    with (
        Client(server.url, operation_timeout=OP_TIMEOUT) as client,
        client.create_producer(topic) as producer,
    ):
        with pytest.raises(MessageTooLarge):
            producer.send(b"x" * (MAX_MESSAGE_SIZE + 1))
        with pytest.raises(MessageTooLarge):  # fits alone, not with the batch header
            producer.send(b"x" * MAX_MESSAGE_SIZE)
    # The broker enforces the limit whatever the client does.
    with RawConnection(server.port) as raw:
        raw.handshake()
        name = _raw_producer(raw, topic)
        payload = _batch([b"y" * (MAX_MESSAGE_SIZE + 1024)], producer_name=name)
        answer = raw.request(
            "send",
            {"producerId": 1, "sequenceId": 0, "numMessages": 1},
            request_id=3,
            payload=payload,
        )
        assert (answer.request_id, answer.error_code) == (3, MessageTooLarge.code)
        # a refused send fences its producer until it re-attaches (issue #12)
        push = raw.read_frame(timeout=OP_TIMEOUT)
        assert push is not None and push.kind == "closedByBroker"
        assert raw.request("ping", None, request_id=4).kind == "ok"

    assert_still_serving(server)
    with Client(server.url, operation_timeout=OP_TIMEOUT) as client:
        with client.create_producer(topic) as producer:
            assert producer.send(b"small").offset == 0, "part of an oversize message was stored"
        with client.subscribe(topic, "s", initial_position="earliest") as consumer:
            assert consumer.receive(timeout=OP_TIMEOUT).value == b"small"
            assert_nothing_more(consumer)


def test_messages_under_the_limit_are_not_refused_because_of_batching(
    standalone: Standalone,
) -> None:
    # Each message fits in max_message_size on its own; batched together they would not,
    # so the producer must put them in separate batches rather than fail both.
    small, large = b"s" * (100 * 1024), b"L" * (MAX_MESSAGE_SIZE - 50 * 1024)
    with (
        Client(standalone.url, operation_timeout=OP_TIMEOUT) as client,
        client.create_producer("near-limit", batching_max_delay_ms=1000) as producer,
    ):
        assert producer.send(large).offset == 0  # alone it is accepted
        futures = [producer.send_async(small), producer.send_async(large)]
        producer.flush()
        assert [f.result(timeout=OP_TIMEOUT).offset for f in futures] == [1, 2]


def test_unknown_message_types(server: Standalone) -> None:
    with RawConnection(server.port) as raw:
        raw.handshake()
        # A kind the broker does not serve (it only ever sends it): typed error, same id,
        # and the connection keeps working.
        answer = raw.request("lookupResult", {"topic": "events"}, request_id=5)
        assert (answer.request_id, answer.error_code) == (5, UnknownMessageType.code)
        assert raw.request("ping", None, request_id=6).kind == "ok"
        # A union member this schema does not know (a newer peer): typed error.
        message = bytearray(build_message(BrokerFrame, 7, "ping", None))
        assert message[24] == 4  # the union discriminant of BrokerFrame: ping
        message[24] = 200
        raw.send(b"".join(bytes(p) for p in encode_frame(bytes(message))))
        frame = raw.read_frame()
        assert frame is not None and frame.error_code == UnknownMessageType.code, frame
    assert_still_serving(server)

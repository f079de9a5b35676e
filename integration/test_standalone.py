"""Acceptance tests of ``pigeon standalone`` as a real process, over loopback.

A test that kills, stops or restarts its server starts its own (see ``conftest.py``) on
free ports with its data under ``tmp_path``; the others share one per module
(``shared``), each on its own topics.  Each talks to its server with the sync client,
the CLI or raw sockets, and leaves it to the fixture to kill it by PID.  Every wait is
bounded in time and iterations; no assertion depends on how fast the machine is (a slow
machine can only make a check weaker, never make it fail).
"""

from __future__ import annotations

import collections
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
from _produce import (
    OP_TIMEOUT,
    BackgroundProducer,
    Sent,
    assert_content,
    assert_nothing_more,
    produce,
    receive_ids,
    receive_n,
)

from pigeon.client import Client, Consumer, Message, MessageId, Timeout
from pigeon.core.testing.servers import Standalone, clean_env, free_ports, pigeon_command

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def shared(module_standalone_factory: Callable[..., Standalone]) -> Standalone:
    """The module's standalone, for tests that neither kill nor restart it."""
    return module_standalone_factory().start()


# ------------------------------------------------------------------ a. 10,000 in order


def message_a(i: int) -> Sent:
    """Varied content: binary and empty values, missing keys and properties, non-ASCII."""
    value = f"value-{i}|".encode() + bytes((i * 7 + j) % 256 for j in range(i % 41))
    if i % 997 == 0:
        value = b""
    key = None if i % 7 == 0 else f"key-{i % 100}-ключ"
    properties = {} if i % 5 == 0 else {"i": str(i), "mod3": str(i % 3), "ü": "✓" * (i % 3)}
    return Sent(value, key, properties)


def test_10000_messages_in_order_with_content_intact(shared: Standalone) -> None:
    n = 10_000
    sent = [message_a(i) for i in range(n)]
    before_ms = int(time.time() * 1000)
    ids = produce(shared.url, "events", sent, batching_max_messages=1000, batching_max_delay_ms=5)
    after_ms = int(time.time() * 1000)
    assert [mid.offset for mid in ids] == list(range(n))
    assert len(set(ids)) == n

    with (
        Client(shared.url, operation_timeout=OP_TIMEOUT) as client,
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
    shared: Standalone,
) -> None:
    topic, sub, n = "shared-topic", "workers", 300
    with Client(shared.url, operation_timeout=OP_TIMEOUT) as client:
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
    shared: Standalone, tmp_path: Any
) -> None:
    """A second ``pigeon standalone`` on ports another one holds exits 2 with one line
    naming the port and its flag (it printed a 100-line exception group)."""
    bookie_port, broker_port = free_ports(2)
    for args, flag, port in (
        (["--bookie-port", str(shared.bookie_port)], "--bookie-port", shared.bookie_port),
        (
            ["--port", str(shared.port), "--bookie-port", str(bookie_port)],
            "--port",
            shared.port,
        ),
        (
            [
                "--port",
                str(broker_port),
                "--bookie-port",
                str(bookie_port),
                "--http-port",
                str(shared.http_port),
            ],
            "--http-port",
            shared.http_port,
        ),
    ):
        result = subprocess.run(
            [
                *pigeon_command(),
                "--log-level",
                "ERROR",
                "standalone",
                "--data-dir",
                str(tmp_path / flag.strip("-")),
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
            f"error: ConfigError: port {port} is already in use ({flag}): stop what holds it"
            f" (another pigeon standalone?) or pass another {flag}"
        ]


def test_cli_produce_then_consume(shared: Standalone) -> None:
    url, topic = shared.url, "cli-topic"
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

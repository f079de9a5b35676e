"""The Kafka part of the nemesis workload: a Kafka producer and a Kafka consumer group.

Topic ``k`` of :data:`~._workload.TOPICS` is a 3-partition topic that the native
producers write too.  Beside them, one confluent-kafka producer ``kp0`` (idempotent,
``acks=all``, the way an application that must not lose messages is configured) sends
``rate`` messages/s to it through the brokers' Kafka listeners (each behind its proxy:
the brokers advertise the proxies), and one confluent-kafka consumer in group
``kafka-group`` reads it, committing as Kafka consumers do.  Its deliveries are checked
like a reader's: every acknowledged message of ``k``, from either kind of producer, must
reach it.  The native final read then reads ``k`` from the earliest offset like every
other topic, so a Kafka-acknowledged message missing from the log is a loss.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from ._history import Delivery, History, MsgId, Send, format_payload
from ._history import parse_payload as parse
from ._topology import Topology

__all__ = ["KAFKA_TOPIC", "KafkaWorkload"]

KAFKA_TOPIC = "k"
GROUP = "kafka-group"
LABEL = f"{KAFKA_TOPIC}/{GROUP}"
PRODUCER = "kp0"
#: librdkafka statistics of the consumer every this many ms (see ``_consumer_stats``)
STATS_INTERVAL_MS = 5000
#: samples in a row a partition's position may stand still with a lag before it is a stall
STALL_SAMPLES = 3


def _debug_options(role: str = "producer") -> dict[str, Any]:
    """``PIGEON_NEMESIS_KAFKA_DEBUG=eos,msg,broker`` (the producer) and
    ``PIGEON_NEMESIS_KAFKA_CONSUMER_DEBUG=cgrp,fetch`` (the consumer): librdkafka's debug
    contexts, logged to the run's client.log (logger ``pigeon.nemesis.librdkafka``)."""
    variable = (
        "PIGEON_NEMESIS_KAFKA_DEBUG"
        if role == "producer"
        else ("PIGEON_NEMESIS_KAFKA_CONSUMER_DEBUG")
    )
    contexts = os.environ.get(variable, "")
    if not contexts:
        return {}
    logger = logging.getLogger(f"pigeon.nemesis.librdkafka.{role}")
    logger.setLevel(logging.DEBUG)
    return {"debug": contexts, "log_level": 7, "logger": logger}


class KafkaWorkload:
    def __init__(
        self,
        topology: Topology,
        history: History,
        delivered: dict[str, set[MsgId]],
        *,
        rate: float = 100.0,
        timeout: float = 600.0,
    ) -> None:
        from confluent_kafka import Consumer, Producer

        self.history = history
        self.rate = rate
        self.delivered = delivered
        bootstrap = topology.kafka_bootstrap
        #: SASL_SSL with the workload's token in secure mode
        security = topology.kafka_options()
        self.topic = f"nemesis-{KAFKA_TOPIC}"
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "message.timeout.ms": int(timeout * 1000),
                "topic.metadata.refresh.interval.ms": 2000,
                "log_level": 3,
                **security,
                **_debug_options(),
            }
        )
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": GROUP,
                "auto.offset.reset": "earliest",
                "session.timeout.ms": 10000,
                "heartbeat.interval.ms": 1000,
                "topic.metadata.refresh.interval.ms": 2000,
                "log_level": 3,
                "error_cb": self._consumer_error,
                "statistics.interval.ms": STATS_INTERVAL_MS,
                "stats_cb": self._consumer_stats,
                **security,
                **_debug_options("consumer"),
            }
        )
        #: partition -> (fetch state, leader, broker) last recorded
        self._partition_states: dict[str, tuple[Any, ...]] = {}
        #: partition -> (next offset, samples it stood still with a lag)
        self._positions: dict[str, tuple[int, int]] = {}
        self._stop_produce = threading.Event()
        self._stop_consume = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start producing and consuming (after the native workload's start, which
        creates the topics and lists the readers)."""
        self.history.readers.setdefault(KAFKA_TOPIC, []).append(LABEL)
        self.delivered[LABEL] = set()
        self.consumer.subscribe(
            [self.topic],
            on_assign=self._assignment("kafka-consumer-assigned"),
            on_revoke=self._assignment("kafka-consumer-revoked"),
            on_lost=self._assignment("kafka-consumer-lost"),
        )
        for target, name in ((self._produce, PRODUCER), (self._consume, LABEL)):
            t = threading.Thread(target=target, name=name, daemon=True)
            self._threads.append(t)
            t.start()

    def _produce(self) -> None:
        h = self.history
        start = time.monotonic()
        seq = 0
        while not self._stop_produce.is_set():
            delay = start + seq / self.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            send = Send(KAFKA_TOPIC, PRODUCER, seq, h.now())
            h.sends.append(send)
            try:
                self.producer.produce(
                    self.topic,
                    value=format_payload(KAFKA_TOPIC, PRODUCER, seq),
                    key=f"{PRODUCER}-{seq % 16}".encode(),
                    on_delivery=self._resolver(send),
                )
            except Exception as exc:  # BufferError (queue full) and the like
                send.failed, send.error = h.now(), f"{type(exc).__name__}: {exc}"
            self.producer.poll(0)
            seq += 1

    def _resolver(self, send: Send) -> Any:
        h = self.history

        def resolved(err: Any, msg: Any) -> None:
            if err is None:
                send.position = (msg.partition(), -1, -1, -1)  # Kafka names an offset only
                send.acked = h.now()
            else:
                send.failed, send.error = h.now(), str(err)

        return resolved

    def _assignment(self, kind: str) -> Any:
        """A rebalance callback recording the partitions in the history's events (a
        group that stops consuming shows there whether it still holds its partitions)."""

        def record(_consumer: Any, partitions: list[Any]) -> None:
            self.history.event(kind, ",".join(str(p.partition) for p in partitions))

        return record

    def _consumer_error(self, err: Any) -> None:
        self.history.event("kafka-consumer-error", str(err)[:200])

    def _consumer_stats(self, text: str) -> None:
        """librdkafka's statistics: an event when a partition's fetch state, leader or
        fetching broker changes, and one when its position stands still with a lag for
        :data:`STALL_SAMPLES` samples -- a consumer that stops without an error then
        shows which state it is stuck in (e.g. ``validate-epoch-wait``, ``offset-wait``)
        and on which broker."""
        try:
            partitions = json.loads(text)["topics"][self.topic]["partitions"]
        except (ValueError, KeyError, TypeError):
            return
        for index, p in sorted(partitions.items()):
            if index == "-1" or not p.get("desired", True):
                continue
            state = (p.get("fetch_state"), p.get("leader"), p.get("broker"))
            if self._partition_states.get(index) != state:
                self._partition_states[index] = state
                self.history.event(
                    "kafka-consumer-partition",
                    f"{index}: fetch_state={state[0]} leader={state[1]} broker={state[2]}",
                )
            offset, lag = int(p.get("next_offset", -1)), int(p.get("consumer_lag", -1))
            last, still = self._positions.get(index, (offset, 0))
            still = still + 1 if offset == last and lag > 0 else 0
            self._positions[index] = (offset, still)
            if still == STALL_SAMPLES:
                self.history.event(
                    "kafka-consumer-stalled",
                    f"{index}: next_offset={offset} lag={lag} fetch_state={state[0]}"
                    f" leader={state[1]} broker={state[2]} fetchq={p.get('fetchq_cnt')}",
                )

    def _consume(self) -> None:
        h = self.history
        seen = self.delivered[LABEL]
        while not self._stop_consume.is_set():
            msg = self.consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error() is not None:
                h.event("kafka-consumer-error", str(msg.error())[:200])
                continue
            value = msg.value() or b""
            mid = parse(value)
            raw = "" if mid is not None else repr(value[:40])
            h.deliveries.append(
                Delivery(
                    h.now(), LABEL, "kc0", mid, (msg.partition(), -1, -1, msg.offset()), 0, raw
                )
            )
            if mid is not None:
                seen.add(mid)

    def stop_production(self, timeout: float) -> None:
        """Stop sending; wait (bounded) until every send is acknowledged or failed."""
        self._stop_produce.set()
        self._threads[0].join(10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self.producer) > 0:
            self.producer.poll(0.2)

    def close(self) -> None:
        self._stop_produce.set()
        self._stop_consume.set()
        for t in self._threads:
            t.join(10)
        try:
            self.consumer.close()
        except Exception as exc:  # a consumer closing under faults may complain
            self.history.event("kafka-consumer-error", f"close: {exc}"[:200])
        self.producer.flush(5)

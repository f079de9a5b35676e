"""The workload: producers, consumers of every subscription type, readers, a final read.

Everything runs on threads of the test process with the sync client, one ``Client`` per
producer, per topic's consumers, for the readers, and for the final read; each client
survives node failures by its own reconnects.  Every step lands in the
:class:`~._history.History`:

* producers ``p0``, ``p1``, ... send with default settings (so de-duplication is on),
  ``send_async``, ``rate`` messages/s each, round-robin over the topics; each message
  carries ``producer:topic:seq`` and a key (for key_shared), but on the topics of
  :data:`KEYLESS`, whose messages are a value alone (where it is built, the sync
  producer's ``send_async`` in C, ``pigeon.client._speedups``, sends those);
* every subscription of :data:`TOPICS` is opened before production starts (earliest);
  its consumers acknowledge everything they get; a consumer whose client raises is
  opened again (an application would) and the error is recorded;
* readers (non-durable) read the plain topics from the earliest position, resuming
  after the last message they read if their reader has to be opened again;
* subscription ``receipts`` of topic ``a`` acknowledges with receipts
  (``ack_receipt_enabled``) and records each confirmed ack (:class:`AckReceipt`);
* a sampler asks the admin API every :data:`SAMPLE_EVERY` seconds how many consumers
  each subscription has and its backlog.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from pigeon.client import Client, Consumer, Message, MessageId, Reader, Timeout

from ._history import AckReceipt, Attach, Delivery, History, LogRecord, MsgId, Send, format_payload
from ._history import parse_payload as parse
from ._topology import NAMESPACE, Topology

__all__ = ["CONSUMERS", "TOPICS", "Workload", "topic_name"]

#: topic key -> (partitions, subscription types, readers)
TOPICS: dict[str, tuple[int, list[str], int]] = {
    "a": (0, ["exclusive", "shared", "receipts"], 1),
    "b": (0, ["failover", "key_shared"], 1),
    "p": (3, ["exclusive", "failover", "shared", "key_shared"], 0),
    # written by the native producers and a Kafka producer, read by a Kafka consumer
    # group (see _kafka_workload)
    "k": (3, [], 0),
}
#: topics whose messages have no key (no key_shared subscription, one partition)
KEYLESS = frozenset({"a"})
#: an exclusive subscription whose consumer acknowledges with receipts
#: (``ack_receipt_enabled``): cumulatively, one receipt per batch received
RECEIPTS = "receipts"
#: consumers opened per subscription type
CONSUMERS = {"exclusive": 1, "failover": 2, "shared": 2, "key_shared": 2, RECEIPTS: 1}
OP_TIMEOUT = 30.0
#: after the last fault was healed, how long sends in flight get to resolve
SETTLE_TIMEOUT = 15.0
SAMPLE_EVERY = 2.0
KEYS_PER_PRODUCER = 16
RECEIVE_BATCH = 500
#: messages/s the final read is sure to manage (it reads ~1,000-3,000/s here)
FINAL_READ_RATE = 400.0
#: a final read that stops short of the log's end re-attaches this many times in all
FINAL_READ_ATTACHES = 3


def topic_name(key: str) -> str:
    return f"persistent://{NAMESPACE}/nemesis-{key}"


def _position(mid: MessageId) -> tuple[int, int, int, int]:
    return (mid.partition, mid.segment_id, mid.entry_id, mid.batch_index)


def _brief(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


class Workload:
    def __init__(
        self, topology: Topology, history: History, *, producers: int = 3, rate: float = 200.0
    ) -> None:
        self.topology = topology
        self.history = history
        self.url = topology.service_url
        self.producer_count = producers
        self.rate = rate
        self.clients: list[Client] = []
        self.futures: list[concurrent.futures.Future[Any]] = []
        #: subscription or reader -> ids delivered so far (for the drain)
        self.delivered: dict[str, set[MsgId]] = {}
        self._produce_stop = threading.Event()
        self._consume_stop = threading.Event()
        self._sample_stop = threading.Event()
        self._producers: list[threading.Thread] = []
        self._consumers: list[threading.Thread] = []
        self._sampler: threading.Thread | None = None

    def _client(self) -> Client:
        client = Client(self.url, operation_timeout=OP_TIMEOUT, **self.topology.client_options())
        self.clients.append(client)
        return client

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        h = self.history
        admin = self._client()
        for key, (partitions, types, readers) in TOPICS.items():
            if partitions:
                admin.create_topic(topic_name(key), partitions)
            h.subscriptions[key] = [f"{key}/{t}" for t in types]
            h.readers[key] = [f"{key}/reader-{i}" for i in range(readers)]
        for key, (_partitions, types, _readers) in TOPICS.items():
            client = self._client()
            for t in types:
                sub = f"{key}/{t}"
                h.consumers_expected[sub] = CONSUMERS[t]
                self.delivered[sub] = set()
                for i in range(CONSUMERS[t]):
                    self._spawn_consumer(client, key, t, sub, f"{sub}/{i}")
            for reader in h.readers[key]:
                self.delivered[reader] = set()
                self._spawn_reader(key, reader)
        self._sampler = threading.Thread(target=self._sample, name="sampler", daemon=True)
        self._sampler.start()
        for i in range(self.producer_count):
            client = self._client()
            producers = {key: client.create_producer(topic_name(key)) for key in TOPICS}
            t = threading.Thread(
                target=self._produce, args=(f"p{i}", producers), name=f"p{i}", daemon=True
            )
            self._producers.append(t)
        for t in self._producers:
            t.start()

    # ------------------------------------------------------------------ producers

    def _produce(self, label: str, producers: dict[str, Any]) -> None:
        h = self.history
        keys = list(producers)
        seqs = dict.fromkeys(keys, 0)
        start = time.monotonic()
        i = 0
        while not self._produce_stop.is_set():
            delay = start + i / self.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            key = keys[i % len(keys)]
            i += 1
            seq = seqs[key]
            seqs[key] = seq + 1
            send = Send(key, label, seq, h.now())
            h.sends.append(send)
            try:
                if key in KEYLESS:  # a bytes value alone: the C path of send_async
                    fut = producers[key].send_async(format_payload(key, label, seq))
                else:
                    fut = producers[key].send_async(
                        format_payload(key, label, seq), key=f"{label}-{seq % KEYS_PER_PRODUCER}"
                    )
            except Exception as exc:
                send.failed, send.error = h.now(), _brief(exc)
                continue
            self.futures.append(fut)
            fut.add_done_callback(self._resolver(send))

    def _resolver(self, send: Send) -> Callable[[concurrent.futures.Future[Any]], None]:
        h = self.history

        def resolved(fut: concurrent.futures.Future[Any]) -> None:
            exc = fut.exception()
            if exc is None:
                send.position = _position(fut.result())
                send.acked = h.now()
            else:
                send.failed, send.error = h.now(), _brief(exc)

        return resolved

    def stop_production(self, timeout: float = SETTLE_TIMEOUT) -> None:
        """Stop sending and wait (bounded) for every send to be acknowledged or fail;
        what is still unresolved then counts as pending (outcome unknown)."""
        self._produce_stop.set()
        for t in self._producers:
            t.join(10)
        self.history.production_stopped = self.history.now()
        concurrent.futures.wait([f for f in self.futures if not f.done()], timeout=timeout)

    # ------------------------------------------------------------------ consumers

    def _spawn_consumer(self, client: Client, key: str, kind: str, sub: str, label: str) -> None:
        def subscribe() -> Consumer:
            return client.subscribe(
                topic_name(key),
                kind,
                subscription_type="exclusive" if kind == RECEIPTS else kind,
                initial_position="earliest",
                consumer_name=label.replace("/", "-"),
                ack_receipt_enabled=kind == RECEIPTS,
            )

        first = subscribe()
        t = threading.Thread(
            target=self._consume, args=(sub, label, first, subscribe), name=label, daemon=True
        )
        self._consumers.append(t)
        t.start()

    def _consume(
        self, sub: str, label: str, consumer: Consumer | None, subscribe: Callable[[], Consumer]
    ) -> None:
        h = self.history
        seen = self.delivered[sub]
        while not self._consume_stop.is_set():
            if consumer is None:
                try:
                    consumer = subscribe()
                    h.event("consumer-reopened", label)
                except Exception as exc:
                    h.event("consumer-error", f"{label} subscribe: {_brief(exc)}")
                    self._consume_stop.wait(1.0)
                    continue
            # read before receiving: a re-attach after it (even before the ack is sent)
            # shows as a new generation, and such a receipt is not recorded
            generation = consumer._handle.engines[0].generation
            try:
                msgs = consumer.batch_receive(RECEIVE_BATCH, timeout=0.5)
            except Timeout:
                continue
            except Exception as exc:
                h.event("consumer-error", f"{label} receive: {_brief(exc)}")
                with contextlib.suppress(Exception):
                    consumer.close()
                consumer = None
                continue
            now = h.now()
            for m in msgs:
                self._record(now, sub, label, m, seen)
            if sub.endswith("/" + RECEIPTS):
                self._acknowledge_with_receipt(sub, label, consumer, msgs, generation)
                continue
            try:
                for m in msgs:
                    consumer.acknowledge(m)
            except Exception as exc:
                h.event("consumer-error", f"{label} acknowledge: {_brief(exc)}")
        if consumer is not None:
            _close_quietly(consumer)

    def _acknowledge_with_receipt(
        self, sub: str, label: str, consumer: Consumer, msgs: list[Message], generation: int
    ) -> None:
        """Acknowledge ``msgs`` cumulatively and wait for the receipt; recorded only when
        the consumer did not re-attach since ``generation``, read before it received them
        (after a re-attach the broker hands unacknowledged messages over again before
        the ack can reach it: such copies are not the broker forgetting a stored ack)."""
        h = self.history
        engine = consumer._handle.engines[0]  # topic a: one partition
        try:
            # the newest: a redelivered message may come after newer ones
            consumer.acknowledge_cumulative(max(msgs, key=lambda m: m.offset))
        except Exception as exc:
            h.event("ack-not-persisted", f"{label}: {_brief(exc)}")
            return
        if engine.generation != generation:
            return
        now = h.now()
        for m in msgs:
            mid = parse(m.value)
            if mid is not None:
                h.receipts.append(AckReceipt(now, sub, mid))

    def _record(self, now: float, sub: str, label: str, m: Message, seen: set[MsgId]) -> None:
        mid = parse(m.value)
        raw = "" if mid is not None else repr(bytes(m.value[:40]))
        self.history.deliveries.append(
            Delivery(now, sub, label, mid, _position(m.message_id), m.redelivery_count, raw)
        )
        if mid is not None:
            seen.add(mid)

    def _spawn_reader(self, key: str, label: str) -> None:
        client = self._client()
        reader = client.create_reader(topic_name(key), "earliest")
        t = threading.Thread(
            target=self._read, args=(client, key, label, reader), name=label, daemon=True
        )
        self._consumers.append(t)
        t.start()

    def _read(self, client: Client, key: str, label: str, reader: Reader | None) -> None:
        h = self.history
        seen = self.delivered[label]
        last: MessageId | str = "earliest"
        while not self._consume_stop.is_set():
            if reader is None:
                try:
                    reader = client.create_reader(topic_name(key), last)
                    h.event("reader-reopened", f"{label} after={last}")
                except Exception as exc:
                    h.event("reader-error", f"{label} open: {_brief(exc)}")
                    self._consume_stop.wait(1.0)
                    continue
            try:
                m = reader.read_next(timeout=0.5)
            except Timeout:
                continue
            except Exception as exc:
                h.event("reader-error", f"{label} read: {_brief(exc)}")
                with contextlib.suppress(Exception):
                    reader.close()
                reader = None
                continue
            last = m.message_id
            self._record(h.now(), label, label, m, seen)
        if reader is not None:
            _close_quietly(reader)

    # ------------------------------------------------------------------ attach samples

    def _sample(self) -> None:
        while not self._sample_stop.wait(SAMPLE_EVERY):
            try:
                self.sample()
            except Exception as exc:  # an odd answer must not end the sampling
                self.history.event("sample-error", _brief(exc))

    def sample(self) -> list[Attach]:
        """One admin-API sample of every expected subscription (recorded and returned)."""
        out: list[Attach] = []
        for key, (partitions, _types, _readers) in TOPICS.items():
            # one partition at a time: the partitions may be owned by different brokers
            names = [f"nemesis-{key}-partition-{i}" for i in range(partitions)] or [
                f"nemesis-{key}"
            ]
            parts = [self.topology.topic_stats(name) for name in names]
            if any(p is None for p in parts):
                continue
            for sub in self.history.subscriptions[key]:
                name = sub.split("/", 1)[1]
                subs = [p.get("subscriptions", {}).get(name) for p in parts if p is not None]
                consumers = min((s["consumers"] if s else 0) for s in subs)
                backlog = sum(s["backlog"] for s in subs if s)
                attached = set.intersection(*(set(s["consumer_names"] if s else ()) for s in subs))
                a = Attach(
                    self.history.now(), key, sub, consumers, backlog, tuple(sorted(attached))
                )
                self.history.attach.append(a)
                out.append(a)
        return out

    # ------------------------------------------------------------------ the end

    def acked(self) -> dict[str, set[MsgId]]:
        out: dict[str, set[MsgId]] = {key: set() for key in TOPICS}
        for s in self.history.sends:
            if s.acked is not None:
                out[s.topic].add(s.id)
        return out

    def drain(self, deadline: float) -> bool:
        """Let consumers and readers run until each got every acknowledged message of its
        topic (True) or ``deadline`` passes (False); then take a last attach sample once
        every backlog is empty (or at the deadline)."""
        acked = self.acked()
        groups = {
            g: key
            for key in TOPICS
            for g in [*self.history.subscriptions[key], *self.history.readers[key]]
        }
        done = False
        while time.monotonic() < deadline:
            if all(acked[key] <= self.delivered[g] for g, key in groups.items()):
                done = True
                break
            time.sleep(0.5)
        self._sample_stop.set()
        if self._sampler is not None:
            self._sampler.join(10)
        self.history.drained_at = self.history.now()
        while True:
            samples = self.sample()
            settled = len(samples) == len(self.history.consumers_expected) and all(
                a.backlog == 0 and a.consumers >= self.history.consumers_expected[a.subscription]
                for a in samples
            )
            if settled or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        self._consume_stop.set()
        for t in self._consumers:
            t.join(5)
        return done

    def final_read(self, timeout: float, idle: float = 5.0) -> None:
        """Read every topic from the earliest position with a fresh subscription, each
        within ``timeout`` seconds plus one per :data:`FINAL_READ_RATE` acknowledged
        messages of the topic; how each read ended goes to
        ``history.final_read_status``: ``complete`` (every acknowledged message seen),
        ``idle`` (nothing more came for ``idle`` seconds at the end of the log, so what is
        missing is not stored), or why the topic could not be read to its end
        (``stalled``, ``unreadable``: its missing messages are unverified, not lost)."""
        acked = self.acked()
        client = self._client()
        for key in TOPICS:
            bound = timeout + len(acked[key]) / FINAL_READ_RATE
            status = self._read_topic(client, key, acked[key], time.monotonic() + bound, idle)
            self.history.final_read_status[key] = status

    def _read_topic(
        self, client: Client, key: str, want: set[MsgId], deadline: float, idle: float
    ) -> str:
        """Read ``key`` to its end; when nothing comes for ``idle`` seconds before the
        log's end (the admin API's next offsets), re-attach and go on, a few times."""
        h = self.history
        got: set[MsgId] = set()
        last: dict[int, int] = {}  # partition -> highest offset read
        index = 0
        for attempt in range(FINAL_READ_ATTACHES):
            consumer: Consumer | None = None
            while consumer is None:
                try:
                    consumer = client.subscribe(
                        topic_name(key), "final-read", initial_position="earliest"
                    )
                except Exception as exc:
                    h.event("final-read-error", f"{key} subscribe: {_brief(exc)}")
                    if time.monotonic() >= deadline:
                        return f"unreadable: subscribe failed: {_brief(exc)}"
                    time.sleep(1.0)
            quiet_since = time.monotonic()
            try:
                while True:
                    quiet = time.monotonic() - quiet_since
                    if want <= got and quiet >= 1.0:
                        return "complete"
                    if quiet >= idle:
                        break
                    if time.monotonic() >= deadline:
                        return (
                            f"unreadable: still reading after {len(got)} messages at the deadline"
                        )
                    try:
                        msgs = consumer.batch_receive(RECEIVE_BATCH, timeout=0.5)
                    except Timeout:
                        continue
                    except Exception as exc:
                        h.event("final-read-error", f"{key} receive: {_brief(exc)}")
                        break
                    quiet_since = time.monotonic()
                    for m in msgs:
                        mid = parse(m.value)
                        raw = "" if mid is not None else repr(bytes(m.value[:40]))
                        where = _position(m.message_id)
                        h.final_read.append(LogRecord(key, mid, where, m.offset, index, raw))
                        index += 1
                        last[where[0]] = max(last.get(where[0], -1), m.offset)
                        if mid is not None:
                            got.add(mid)
                    with contextlib.suppress(Exception):
                        # acknowledged (cumulatively: the subscription is exclusive), so
                        # that a re-attach does not hand it all over again
                        newest = {m.message_id.partition: m for m in msgs}
                        for m in newest.values():
                            consumer.acknowledge_cumulative(m)
            finally:
                _close_quietly(consumer)
            short = self._short_of_log_end(key, last)
            if short is None:
                return "idle"  # at the end of the log: what is missing is not stored
            h.event("final-read-stall", f"{key} attempt={attempt + 1} {short}")
        return f"stalled: {short}"

    def _short_of_log_end(self, key: str, last: dict[int, int]) -> str | None:
        """None when ``last`` (partition -> offset read) reached the end of every
        partition of ``key``, else where the read stopped short."""
        partitions = TOPICS[key][0]
        names = {i: f"nemesis-{key}-partition-{i}" for i in range(partitions)} or {
            -1: f"nemesis-{key}"
        }
        short = []
        for partition, name in names.items():
            stats = self.topology.topic_stats(name)
            if stats is None or stats.get("next_offset") is None:
                short.append(f"{name}: end of the log unknown")
                continue
            read = last.get(partition, -1) + 1
            if read < stats["next_offset"]:
                short.append(f"{name}: read up to offset {read} of {stats['next_offset']}")
        return "; ".join(short) or None

    def close(self) -> None:
        """Close every client, each bounded in time (a wedged close is left behind)."""
        self._produce_stop.set()
        self._consume_stop.set()
        self._sample_stop.set()
        closers = [
            threading.Thread(target=_close_quietly, args=(c,), daemon=True) for c in self.clients
        ]
        for t in closers:
            t.start()
        deadline = time.monotonic() + 10
        for t in closers:
            t.join(max(0.0, deadline - time.monotonic()))


def _close_quietly(thing: Any) -> None:
    with contextlib.suppress(Exception):
        thing.close()

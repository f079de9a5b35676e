"""Producer and consumer behaviour shared by every face, as plain synchronous classes.

The faces supply the two things that differ — how a sealed batch reaches the engine and
how a timer is started (directly in trio; via ``run_sync_soon`` from the sync face's
threads) — and their own locking and waiting.

A batch is due ``max_delay`` after its first message.  The timer seals it then, but a
timer started from another thread starts late (the hop to the engine's thread) and an
event loop's timer fires late (``epoll`` waits whole milliseconds, rounded up); so a face
whose caller is not on the engine's thread also gives a ``clock``, the deadline is taken
from it when the first message is added, and a message added after the deadline seals
the batch at once (it goes with it): a steady producer's batch leaves on time.
With no delay (``max_delay`` 0, :attr:`ProducerLogic.linger`) the timer is due at once
and seals whatever the batch holds when the face gets to it, unless a batch of the
partition is still waiting for its receipt: then the batch is held (:attr:`ProducerLogic.
held`) and sealed when the last receipt comes (:meth:`ProducerLogic.engine_idle`), with
every message added meanwhile, as Kafka's ``linger.ms=0`` batches behind requests in
flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from itertools import repeat
from typing import Any

from pigeon.client._chunks import ChunkReceipts, chunk_uuid
from pigeon.client._core import (
    PLAIN_SLACK,
    SLACK_PER_BATCH,
    ConsumerCore,
    ProducerCore,
    Router,
    arrow_module,
    normalize_message,
)
from pigeon.client._engine import PendingBatch
from pigeon.client._future import MessageFuture
from pigeon.client._message import Message
from pigeon.client._options import (
    ArrowSendOptions,
    DeadLetterPolicy,
    MultiplierRedeliveryBackoff,
)
from pigeon.core.batch import message_body_size
from pigeon.core.errors import InvalidArgument, NotSupported, PigeonError

__all__ = ["ConsumerLogic", "DeadLetterPolicy", "ProducerLogic"]

ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
REAL_TOPIC = "REAL_TOPIC"
RECONSUME_TIMES = "RECONSUMETIMES"
DELAY_TIME = "DELAY_TIME"
_MAX_SEQUENCE_ID = 2**63 - 1


@dataclass(eq=False)
class ProducerLogic:
    """Routing and batching over one accumulator per partition."""

    engines: list[Any]
    cores: list[ProducerCore]
    router: Router
    _: KW_ONLY
    max_delay: float
    submit: Callable[[Any, Any], None]
    #: ``start_timer(index, generation)``: seal partition ``index``'s batch at its
    #: ``cores[index].due`` (when a clock is given), else ``max_delay`` from now
    start_timer: Callable[[int, int], None]
    #: the face's clock (seconds), read when a batch opens and on each later message;
    #: None: only the timer seals a batch that is not full
    clock: Callable[[], float] | None = None
    #: the schema's encoder of values (None: values are bytes)
    encode: Callable[[Any], bytes] | None = None
    #: set by open_producer: ``(completions, state, partition)`` -> the batch's receipt handler
    callback_for: Callable[[list[Any], Any, int], Any] = field(init=False)

    def __post_init__(self) -> None:
        #: no batching delay: the timer is started due at once and seals the batch when
        #: the engine gets to it (the next pass of its scheduler), carrying every message
        #: added meanwhile — Kafka's ``linger.ms=0``. Under load the engine is busy and
        #: batches grow; a lone message waits for one hop, not for a delay.
        self.linger = self.max_delay <= 0
        if self.linger:
            self.clock = None  # only the timer seals a batch that is not full
        #: per partition, with no delay: its open batch waits for the receipts of the
        #: batches in flight, and :meth:`engine_idle` seals it when the last one comes
        self.held = [False] * len(self.cores)
        self.multi = len(self.cores) > 1
        #: the one accumulator of a producer of one partition (None: partitioned)
        self._single = None if self.multi else self.cores[0]
        if self.encode is not None:
            # a schema producer encodes first; a producer of bytes pays nothing for it
            self.add_plain = self._add_plain_encoded  # type: ignore[method-assign,assignment]

    def _add_plain_encoded(self, value: Any, *message: Any) -> MessageFuture:
        """:meth:`add_plain` of the encoded value (``message``: its other arguments)."""
        assert self.encode is not None
        return ProducerLogic.add_plain(self, self.encode(value), *message)

    def add(
        self,
        value: Any,
        key: str | bytes | None,
        properties: Mapping[str, str] | None,
        event_time: int,
        deliver_at: int,
        completion: Any,
        make_completion: Callable[[ProducerCore], Any] | None = None,
        sequence_id: int | None = None,
    ) -> Any:
        """Add one message; returns its completion (made by ``make_completion`` if given).

        ``sequence_id`` sets the message's sequence id explicitly (it must not go down);
        the broker stores each (producer name, sequence id) once, which makes replays
        idempotent (the Spark sink's exactly-once writes rely on it).
        """
        core = self._single
        if (
            core is not None
            and make_completion is None
            and not deliver_at
            and sequence_id is None
            and self.encode is None
            and type(value) is bytes
            and key is None
            and not properties
            and event_time.__class__ is int
            and not event_time
            and core.count
            and len(value) <= core.plain_max
            and core.batch_bytes + len(value) <= core.plain_room
        ):
            # a bytes value alone into the open batch it fits in (as add_plain's hot path)
            self._add_open(core, value, completion)
            return completion
        # Everything is checked before anything is recorded: a bad argument raises here
        # and leaves the producer as it was.
        if self.encode is not None:
            value = self.encode(value)
        value, key, properties = normalize_message(value, key, properties)
        body = message_body_size(value, key, properties, event_time)
        if sequence_id is not None and (
            not isinstance(sequence_id, int) or not 0 <= sequence_id <= _MAX_SEQUENCE_ID
        ):
            raise InvalidArgument(
                f"sequence_id must be an int in [0, {_MAX_SEQUENCE_ID}], got {sequence_id!r}"
            )
        index = self.router.choose(key)
        core = self.cores[index]
        chunked = core.check_fits(body)
        if sequence_id is not None:
            expected = core.next_sequence_id + len(core)
            if sequence_id != expected:
                if sequence_id < expected and len(core):
                    raise InvalidArgument(
                        f"sequence_id {sequence_id} is below the batch's next one ({expected})"
                    )
                self.seal(index)  # a batch holds consecutive sequence ids
                core.next_sequence_id = sequence_id
        if chunked:
            return self._add_chunked(
                index, value, key, properties, event_time, deliver_at, completion, make_completion
            )
        if core.would_overflow(body):
            # The broker refuses a batch over max_message_size: start a new one instead.
            self.seal(index)
        if deliver_at:
            # A delayed message travels in a batch of its own (the delay is per batch).
            self.seal(index)
        if make_completion is not None:
            completion = make_completion(core)
        full = core.builder.add(value, key, properties, event_time)  # adds nothing if it raises
        core.added(completion, body)
        if deliver_at:
            self.seal(index, deliver_at=deliver_at)
        elif full:
            self.seal(index)
        elif len(core) == 1:
            self._opened(index, core)
        elif self.clock is not None and self.clock() >= core.due:
            self.seal(index)
        return completion

    def add_plain(
        self,
        value: Any,
        key: str | bytes | None,
        properties: Mapping[str, str] | None,
        event_time: int,
    ) -> MessageFuture:
        """The hot path of ``send_async``: no delay, no explicit sequence id (with a
        schema, the value is encoded first: see ``__post_init__``).

        Returns a :class:`MessageFuture` sharing its batch's state; per message this is a
        list append, a few counters and one small object.
        """
        core = self._single
        if (
            core is not None
            and type(value) is bytes
            and key is None
            and not properties
            and event_time.__class__ is int
            and not event_time
        ):
            # The hot path of the hot path: a bytes value alone, to the one partition, in
            # a batch already open that it fits in (every check of the general path below,
            # done with two precomputed limits; see ProducerCore.plain_max).
            n = core.count
            size = len(value)
            if n and size <= core.plain_max and core.batch_bytes + size <= core.plain_room:
                full = core.builder.add_value(value)
                core.count = n + 1
                core.batch_bytes += size + PLAIN_SLACK
                future = MessageFuture(core.state or core.batch_state(), n)
                if full:
                    self.seal(0)
                elif self.clock is not None and self.clock() >= core.due:
                    self.seal(0)  # due (its timer is late): it leaves now, with this message
                return future
        return self._add_plain(value, key, properties, event_time)

    def _add_open(self, core: ProducerCore, value: bytes, completion: Any) -> None:
        """Add a checked bytes value alone to ``core``'s open batch (``add``'s hot path)."""
        n = core.count
        full = core.builder.add_value(value)
        if completion is not None:
            completions = core.completions
            if len(completions) < n:
                completions.extend(repeat(None, n - len(completions)))
            completions.append(completion)
        core.count = n + 1
        core.batch_bytes += len(value) + PLAIN_SLACK
        # full (or not batching), or due (its timer is late): it leaves now, with it
        if full or (self.clock is not None and self.clock() >= core.due):
            self.seal(0)

    def _add_plain(
        self,
        value: Any,
        key: str | bytes | None,
        properties: Mapping[str, str] | None,
        event_time: int,
    ) -> MessageFuture:
        """:meth:`add_plain` of any message (the first of a batch, with a key, ...)."""
        # Checked before anything is recorded (see add).
        if type(value) is bytes and key is None and not properties and event_time.__class__ is int:
            properties = None
            body = message_body_size(value, None, None, event_time)
        else:
            value, key, properties = normalize_message(value, key, properties)
            body = message_body_size(value, key, properties, event_time)
        index = self.router.choose(key) if self.multi else 0
        core = self.cores[index]
        if core.check_fits(body):
            return self._add_chunked(  # type: ignore[no-any-return]
                index, value, key, properties, event_time, 0, None, _message_future
            )
        if core.would_overflow(body):
            self.seal(index)  # the broker refuses a batch over max_message_size
        n = len(core)
        full = core.builder.add(value, key, properties, event_time)
        core.added(None, body)
        future = MessageFuture(core.batch_state(), n)
        if full:
            self.seal(index)
        elif n == 0:
            self._opened(index, core)
        elif self.clock is not None and self.clock() >= core.due:
            self.seal(index)  # due (its timer is late): it leaves now, with this message
        return future

    def _add_chunked(
        self,
        index: int,
        value: bytes,
        key: str | bytes | None,
        properties: Mapping[str, str] | None,
        event_time: int,
        deliver_at: int,
        completion: Any,
        make_completion: Callable[[ProducerCore], Any] | None,
    ) -> Any:
        """Send a message too large for one entry as chunks, each an entry of its own
        (see :mod:`pigeon.client._chunks`); its completion resolves with the last chunk's
        receipt (a ChunkMessageId naming the first chunk too)."""
        core = self.cores[index]
        size = core.chunk_size(
            message_body_size(b"", key, properties, event_time), core.builder.producer_name
        )
        self.seal(index)  # (empty: a chunking producer does not batch)
        total = len(value)
        n = -(-total // size)
        uuid = chunk_uuid(core.builder.producer_name, core.next_sequence_id)
        receipts = ChunkReceipts()
        view = memoryview(value)
        for i in range(n):
            if i < n - 1:
                callback = receipts.part(i)
            else:
                if make_completion is not None:
                    completion = make_completion(core)
                state, core.state = core.state, None
                callback = receipts.last(self.callback_for([completion], state, core.partition))
            batch = core.seal_chunk(
                callback,
                view[i * size : (i + 1) * size],
                key,
                properties if i == 0 else None,
                event_time if i == 0 else 0,
                (uuid, i, n, total),
                deliver_at,
            )
            self.submit(self.engines[index], batch)
        self.router.batch_sealed(index)
        return completion

    def add_arrow(
        self, sent: ArrowSendOptions, make_callback: Callable[[int, int], Any]
    ) -> list[Any]:
        """Send the rows of an Arrow table or record batch (a ``send_arrow`` call's) as
        entries built from its buffers (see :mod:`pigeon.client._arrow`); returns the
        callback that ``make_callback(partition, num_rows)`` made for each entry, in order.

        Everything is checked before anything is recorded. A partition's batch of
        single messages is sealed before the partition's first Arrow entry (order and
        sequence ids stay those of the calls). Rows with a key go to ``crc32(key) %
        partitions`` like single messages (computed for all rows at once; a custom
        ``message_router`` is called once per row); entries of rows without a key go
        round-robin, one entry per partition in turn (as single messages' batches).
        """
        data, value, key, properties = sent.data, sent.value, sent.key, sent.properties
        event_time = sent.event_time
        arrow = arrow_module()
        if self.encode is not None:
            raise NotSupported(
                "send_arrow sends bytes: a producer with a schema encodes values one by one"
                " (use send)"
            )
        pa = arrow.pa
        if isinstance(data, pa.Table):
            batches = data.to_batches()
        elif isinstance(data, pa.RecordBatch):
            batches = [data]
        else:
            raise InvalidArgument(
                f"send_arrow takes a pyarrow Table or RecordBatch, not {type(data).__name__}"
            )
        sequence_id = sent.sequence_id
        if sequence_id is not None:
            if not isinstance(sequence_id, int) or not 0 <= sequence_id <= _MAX_SEQUENCE_ID:
                raise InvalidArgument(
                    f"sequence_id must be an int in [0, {_MAX_SEQUENCE_ID}], got {sequence_id!r}"
                )
            if self.multi:
                raise InvalidArgument(
                    "send_arrow: sequence_id needs a producer of one partition (create one "
                    "per partition topic, e.g. topic-partition-0)"
                )
            expected = self.cores[0].next_sequence_id + len(self.cores[0])
            if sequence_id < expected and len(self.cores[0]):
                raise InvalidArgument(
                    f"sequence_id {sequence_id} is below the batch's next one ({expected})"
                )
        limit = min(c.max_message_size - c.header_bytes - SLACK_PER_BATCH for c in self.cores)
        first = self.cores[0].builder
        work: list[tuple[int | None, Any, list[tuple[int, int]]]] = []
        for rb in batches:
            if not rb.num_rows:
                continue
            rows = arrow.plan_rows(
                rb, value=value, key=key, properties=properties, event_time=event_time
            )
            for index, part in self._arrow_routes(
                arrow, rb, rows, value, key, properties, event_time
            ):
                spans = list(
                    arrow.split_points(
                        part,
                        max_messages=first.max_messages,
                        max_bytes=first.max_bytes,
                        max_entry=limit,
                    )
                )
                work.append((index, part, spans))
        out = []
        for index, part, spans in work:
            for start, end in spans:
                i = index if index is not None else (self.router.current if self.multi else 0)
                core = self.cores[i]
                if len(core):
                    self.seal(i)  # the single messages before go first
                if sequence_id is not None:
                    core.next_sequence_id = sequence_id  # checked above; later entries follow
                    sequence_id = None
                seq = core.next_sequence_id
                count = end - start
                callback = make_callback(core.partition, count)
                try:
                    payload = arrow.encode_entry(
                        part,
                        start,
                        end,
                        producer_name=core.builder.producer_name,
                        sequence_id=seq,
                        codec=core.builder.codec,
                        schema_version=core.builder.schema_version,
                    )
                    batch = PendingBatch(seq, count, payload, callback)
                except Exception as exc:  # checked input cannot cause it: fail this entry
                    error = (
                        exc
                        if isinstance(exc, PigeonError)
                        else InvalidArgument(f"entry could not be built: {exc!r}")
                    )
                    batch = PendingBatch(seq, count, b"", callback, error=error)
                core.next_sequence_id = seq + count
                self.router.batch_sealed(i)
                self.submit(self.engines[i], batch)
                out.append(callback)
        return out

    def _arrow_routes(
        self,
        arrow: Any,
        rb: Any,
        rows: Any,
        value: str,
        key: str | None,
        properties: str | None,
        event_time: str | None,
    ) -> list[tuple[int | None, Any]]:
        """``(partition or None for round-robin, rows)`` of a planned record batch."""
        router = self.router
        if not self.multi or (rows.keys is None and router.custom is None):
            return [(0 if not self.multi else None, rows)]
        pa, pc = arrow.pa, arrow.pc
        n = router.partitions
        if router.custom is not None:
            keys = rows.keys.to_pylist() if rows.keys is not None else [None] * rows.n
            chosen = [router.choose(k) for k in keys]  # one call per row: documented
            parts = pa.array(chosen, pa.int32())
        else:
            parts = pc.fill_null(
                arrow.key_partitions(rows.keys, n), pa.scalar(router.current, pa.int32())
            )
        out: list[tuple[int | None, Any]] = []
        for p in sorted(p for p in pc.unique(parts).to_pylist() if p is not None):
            picked = rb.take(pc.indices_nonzero(pc.equal(parts, p)))
            out.append(
                (
                    p,
                    arrow.plan_rows(
                        picked,
                        value=value,
                        key=key,
                        properties=properties,
                        event_time=event_time,
                    ),
                )
            )
        return out

    def _opened(self, index: int, core: ProducerCore) -> None:
        """Partition ``index``'s batch got its first message: it is due ``max_delay``
        from now."""
        if self.clock is not None:
            core.due = self.clock() + self.max_delay
        self.start_timer(index, core.generation)

    def seal(self, index: int, *, deliver_at: int = 0) -> None:
        """Seal partition ``index``'s batch and submit it: the one way a batch is sealed
        (when full, before one that would not fit, on a delay, on a timer, on flush)."""
        self.held[index] = False
        batch = self.cores[index].seal(self.callback_for, deliver_at=deliver_at)
        if batch is not None:
            self.router.batch_sealed(index)
            self.submit(self.engines[index], batch)

    def seal_all(self) -> None:
        for i in range(len(self.cores)):
            self.seal(i)

    def timer_fired(self, index: int, generation: int) -> None:
        """The timer started for batch ``generation`` of partition ``index`` is up: seal
        it (with no delay, whatever batch is open, or hold it while a batch of the
        partition waits for its receipt: see :attr:`linger`)."""
        if self.linger:
            if self.engines[index].link.pending:
                self.held[index] = True
            else:
                self.seal(index)
        elif self.cores[index].generation == generation:
            self.seal(index)

    def engine_idle(self, index: int) -> None:
        """Every batch partition ``index`` sent has its receipt (or failed): seal the
        batch held for that (see :attr:`linger`)."""
        if self.held[index]:
            self.seal(index)


@dataclass(eq=False)
class ConsumerLogic:
    """Received entries to messages, with dead-lettering, nacks and ack timeouts."""

    core: ConsumerCore
    _: KW_ONLY
    subscription: str
    dead_letter: DeadLetterPolicy | None = None
    ack_timeout: float = 0.0
    negative_ack_delay: float = 1.0
    #: the nack delay grows with the message's redelivery count (else negative_ack_delay)
    negative_ack_backoff: MultiplierRedeliveryBackoff | None = None
    #: a timed-out message waits this long more, growing with its redelivery count
    ack_timeout_backoff: MultiplierRedeliveryBackoff | None = None
    dead: list[Message] = field(default_factory=list)
    nacked: list[tuple[float, Message]] = field(default_factory=list)
    unacked: dict[tuple[int, int, int], tuple[float, Message]] = field(default_factory=dict)

    def next_messages(self, max_messages: int, now: float) -> list[Message]:
        """Messages for the application (may be empty if all were dead-lettered)."""
        msgs = self.core.take(max_messages)
        if self.dead_letter is not None:
            limit = self.dead_letter.max_redeliver_count
            keep = []
            for m in msgs:
                times = m.redelivery_count
                if RECONSUME_TIMES in m.properties:
                    times = max(times, int(m.properties[RECONSUME_TIMES]))
                if times > limit:
                    self.dead.append(m)
                else:
                    keep.append(m)
            msgs = keep
        if self.ack_timeout > 0:
            deadline = now + self.ack_timeout
            backoff = self.ack_timeout_backoff
            for m in msgs:
                mid = m.message_id
                due = deadline if backoff is None else deadline + backoff.next(m.redelivery_count)
                self.unacked[(mid.segment_id, mid.entry_id, mid.batch_index)] = (due, m)
        return msgs

    def acked(self, segment_id: int, entry_id: int, batch_index: int) -> None:
        if self.unacked:
            self.unacked.pop((segment_id, entry_id, batch_index), None)

    def negative_acknowledge(self, message: Message, now: float) -> None:
        mid = message.message_id
        self.unacked.pop((mid.segment_id, mid.entry_id, mid.batch_index), None)
        backoff = self.negative_ack_backoff
        delay = (
            self.negative_ack_delay if backoff is None else backoff.next(message.redelivery_count)
        )
        self.nacked.append((now + delay, message))

    def due_redeliveries(self, now: float) -> list[Message]:
        """Messages whose nack delay or ack timeout has passed (to be redelivered)."""
        due: list[Message] = []
        if self.nacked:
            due.extend(m for at, m in self.nacked if at <= now)
            self.nacked = [(at, m) for at, m in self.nacked if at > now]
        if self.unacked:
            expired = [k for k, (deadline, _m) in self.unacked.items() if deadline <= now]
            for k in expired:
                due.append(self.unacked.pop(k)[1])
        return due

    def next_wakeup(self) -> float | None:
        times = [at for at, _m in self.nacked] + [d for d, _m in self.unacked.values()]
        return min(times) if times else None

    def dead_letter_topic(self, topic: str) -> str:
        assert self.dead_letter is not None
        return self.dead_letter.dead_letter_topic or f"{topic}-{self.subscription}-DLQ"

    def retry_topic(self, topic: str) -> str:
        assert self.dead_letter is not None
        return self.dead_letter.retry_letter_topic or f"{topic}-{self.subscription}-RETRY"


def dead_letter_properties(m: Message) -> dict[str, str]:
    props = dict(m.properties)
    props.setdefault(ORIGIN_MESSAGE_ID, str(m.message_id))
    props.setdefault(REAL_TOPIC, m.topic)
    return props


def _message_future(core: ProducerCore) -> MessageFuture:
    """The completion of a message sent through ``add`` for ``add_plain``."""
    return MessageFuture(core.batch_state(), len(core))


def wall_ms() -> int:
    return int(time.time() * 1000)

"""Face-independent producer and consumer logic, without I/O or threads.

:class:`ProducerCore` is the accumulator: it collects messages into a batch and seals it
into a :class:`PendingBatch` whose callback resolves every message's completion.
:class:`ConsumerCore` turns received entries into messages, counts what the application
consumed so permits are granted in bulk, and groups acknowledgements.  The trio, sync and
asyncio faces wrap these with their own waiting and locking.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from itertools import islice, repeat
from typing import TYPE_CHECKING, Any

from pigeon.client._chunks import CHUNK_HEADER_SLACK, ChunkAssembler
from pigeon.client._engine import PendingBatch, ReceivedEntry
from pigeon.client._future import BatchState
from pigeon.client._message import (
    EntryReceipt,
    Message,
    MessageId,
    SchemaDecoders,
    receipt_message_id,
    split_entry,
)
from pigeon.core.batch import (
    ENTRY_HEADER_SIZE,
    BatchBuilder,
    message_body_size,
    read_header,
    unpack_entry_header,
)
from pigeon.core.errors import InvalidArgument, MessageTooLarge, NotSupported, PigeonError

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "BatchCompletion",
    "ConsumerCore",
    "EntryCompletion",
    "ProducerCore",
    "arrow_module",
    "normalize_message",
    "settle_entry",
]

log = logging.getLogger(__name__)

Completion = Any  # None | concurrent.futures.Future | Callable[[MessageId|None, exc|None], None]


class BatchCompletion:
    """The receipt handler of one sealed batch (the trio and sync faces).

    Called as the batch's callback ``(receipt, error)`` on the engine's thread, it resolves
    every message's completion — the batch's shared :class:`BatchState` (MessageFutures),
    a ``concurrent.futures.Future`` or an application callback — and then reports the
    batch's messages done with ``done(count)`` (the producer's queue space).
    """

    __slots__ = ("completions", "done", "partition", "state")

    def __init__(
        self,
        completions: list[Completion],
        state: BatchState | None,
        partition: int,
        done: Callable[[int], None],
    ) -> None:
        self.completions = completions
        self.state = state
        self.partition = partition
        self.done = done

    def __call__(self, receipt: Any, error: BaseException | None) -> None:
        if error is None:
            self.handle_response(receipt)
        else:
            self.handle_error(error)
        self.done(len(self.completions))

    def handle_response(self, receipt: tuple[int, int, int, bool]) -> None:
        if self.state is not None:
            self.state.resolve(receipt, None)
        completions = self.completions
        if completions.count(None) == len(completions):
            return  # MessageFutures only (the state resolved them): nothing per message
        for i, c in enumerate(completions):
            if c is None:
                continue
            mid = receipt_message_id(receipt, i, self.partition)
            if isinstance(c, concurrent.futures.Future):
                if not c.done():
                    c.set_result(mid)
            else:
                _call_back(c, mid, None)

    def handle_error(self, error: BaseException) -> None:
        if self.state is not None:
            self.state.resolve(None, error)
        completions = self.completions
        if completions.count(None) == len(completions):
            return
        for c in completions:
            if c is None:
                continue
            if isinstance(c, concurrent.futures.Future):
                if not c.done():
                    c.set_exception(error)
            else:
                _call_back(c, None, error)


class EntryCompletion:
    """The receipt handler of one entry sent by ``send_arrow`` (the sync and trio faces):
    resolves :attr:`future` (a ``concurrent.futures.Future`` of an
    :class:`~pigeon.client._message.EntryReceipt`), then reports the entry's rows done
    with ``done(num_rows)``."""

    __slots__ = ("done", "future", "num_rows", "partition")

    def __init__(self, partition: int, num_rows: int, done: Callable[[int], None]) -> None:
        self.partition = partition
        self.num_rows = num_rows
        self.done = done
        self.future: concurrent.futures.Future[EntryReceipt] = concurrent.futures.Future()

    def __call__(self, receipt: Any, error: BaseException | None) -> None:
        settle_entry(self.future, receipt, error, self.num_rows, self.partition)
        self.done(self.num_rows)


def settle_entry(
    future: concurrent.futures.Future[EntryReceipt] | asyncio.Future[EntryReceipt],
    receipt: Any,
    error: BaseException | None,
    num_rows: int,
    partition: int,
) -> None:
    """Resolve the ``future`` of an entry sent by ``send_arrow`` with its
    :class:`EntryReceipt` (or fail it with ``error``) unless it is done already."""
    if not future.done():
        if error is None:
            future.set_result(EntryReceipt.of(receipt, num_rows, partition))
        else:
            future.set_exception(error)


def arrow_module() -> Any:
    """:mod:`pigeon.client._arrow`, or NotSupported naming the extra when pyarrow is not
    installed (pyarrow is optional: ``pip install 'pigeon-client[arrow]'``)."""
    try:
        from pigeon.client import _arrow
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("pyarrow"):
            raise
        raise NotSupported(
            "the Arrow API needs pyarrow: pip install 'pigeon-client[arrow]'"
        ) from None
    return _arrow


def _call_back(c: Callable[..., Any], mid: MessageId | None, error: BaseException | None) -> None:
    """Run an application's send callback; what it raises is logged, never propagated
    (it runs in the connection's reader, which must go on)."""
    try:
        c(mid, error)
    except Exception:
        log.exception("send callback %r failed", c)


#: Slack per message and per batch in the estimate of a batch's entry size: the columns a
#: message adds without using them (event time, key and property offsets, validity bits)
#: and the padding of each of the 11 columns.
SLACK_PER_MESSAGE = 24
SLACK_PER_BATCH = 11 * 8
#: what a message of a bytes value alone adds to the estimate besides the value: its
#: body's value offset (``message_body_size(b"")``) and SLACK_PER_MESSAGE
PLAIN_SLACK = 8 + SLACK_PER_MESSAGE


def normalize_message(
    value: Any, key: Any, properties: Any
) -> tuple[bytes, str | bytes | None, Mapping[str, str] | None]:
    """The value and key as immutable bytes/str and a private copy of the properties.

    What the caller changes after the call does not reach the batch.  The strings are
    checked later by :meth:`ProducerCore.message_size` (which encodes them once).
    """
    if type(value) is not bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise InvalidArgument(f"message value must be bytes, not {type(value).__name__}")
        value = bytes(value)
    if key is not None and not isinstance(key, str | bytes):
        if not isinstance(key, bytearray | memoryview):
            raise InvalidArgument(f"message key must be str or bytes, not {type(key).__name__}")
        key = bytes(key)
    if not properties:
        properties = None
    elif type(properties) is dict:
        properties = properties.copy()
    elif isinstance(properties, Mapping):
        properties = dict(properties)
    else:
        raise InvalidArgument(
            f"message properties must be a mapping of str to str, not {type(properties).__name__}"
        )
    return value, key, properties


class ProducerCore:
    """Batch accumulator of one producer (one partition)."""

    def __init__(
        self,
        *,
        producer_name: str,
        codec: Any,
        partition: int,
        max_messages: int,
        max_bytes: int,
        max_message_size: int,
        first_sequence_id: int,
        chunking: bool = False,
        schema_version: int = 0,
    ) -> None:
        """``schema_version``: the batch header's (the registry version + 1; 0: none)."""
        if max_messages < 1:
            raise InvalidArgument("batching_max_messages must be at least 1")
        self.partition = partition
        self.max_message_size = max_message_size
        #: a message over max_message_size is sent in chunks (else it is refused)
        self.chunking = chunking
        self.builder = BatchBuilder(
            producer_name=producer_name,
            codec=codec,
            max_messages=max_messages,
            max_bytes=max_bytes,
            schema_version=schema_version,
        )
        #: messages in the batch being built
        self.count = 0
        #: their completions, by index; messages without one (a MessageFuture's, which
        #: shares :attr:`state`) leave a None only before a later one that has one
        self.completions: list[Completion] = []
        self.state: BatchState | None = None
        self.next_sequence_id = first_sequence_id
        self.generation = 0
        #: when the batch being built is due to be sealed (the clock of ProducerLogic)
        self.due = 0.0
        #: bytes of an entry before its body: length prefix and header (producer name)
        self.header_bytes = self.builder.check(b"") - message_body_size(b"")
        #: estimated size of the batch being built as an entry (0 when empty)
        self.batch_bytes = 0
        #: the hot path's limits (ProducerLogic.add_plain): the largest value that needs
        #: no chunks alone, and the estimate a batch may have before a value is added
        #: (a bytes value alone adds ``len(value) + PLAIN_SLACK`` to it)
        self.plain_max = max_message_size - self.header_bytes - message_body_size(b"")
        self.plain_room = max_message_size - PLAIN_SLACK

    def batch_state(self) -> BatchState:
        """The shared outcome of the batch being built (for MessageFutures)."""
        if self.state is None:
            self.state = BatchState(self.partition)
        return self.state

    def __len__(self) -> int:
        return self.count

    def check_fits(self, body: int) -> bool:
        """Whether a message of ``body`` bytes must be sent in chunks; raise
        MessageTooLarge if it cannot be sent alone and the producer does not chunk."""
        size = self.header_bytes + body
        if size > self.max_message_size:
            if self.chunking:
                return True
            # max_message_size bounds the entry as stored, batch header included
            # (docs/messaging.md): say so, and how large a value may be
            raise MessageTooLarge(
                f"message too large: {body:,} bytes of value, key and properties plus"
                f" {self.header_bytes:,} bytes of batch header make {size:,} bytes, over"
                f" max_message_size {self.max_message_size:,}, which counts the whole"
                f" entry; a value alone may be at most {self.plain_max:,} bytes"
                " (or set chunking_enabled=True to send it in chunks)"
            )
        return False

    def chunk_size(self, overhead: int, producer_name: str) -> int:
        """Value bytes per chunk of a message whose key, properties and event time take
        ``overhead`` bytes of the body."""
        slack = self.header_bytes + overhead + len(producer_name) + 24 + CHUNK_HEADER_SLACK
        size = self.max_message_size - slack
        if size < 1:
            raise MessageTooLarge(
                f"the key and properties of a message ({overhead} bytes) leave no room for "
                f"a chunk in max_message_size {self.max_message_size}"
            )
        return size

    def seal_chunk(
        self,
        callback: Any,
        value: memoryview,
        key: str | bytes | None,
        properties: Mapping[str, str] | None,
        event_time: int,
        chunk: tuple[str, int, int, int],
        deliver_at: int,
    ) -> PendingBatch:
        """One chunk as an entry of its own (the batch being built must be empty)."""
        seq = self.next_sequence_id
        self.next_sequence_id = seq + 1
        try:
            # a view of the message's value, copied once, into the entry
            self.builder.add(value, key, properties, event_time)  # type: ignore[arg-type]
            payload = self.builder.build(
                sequence_id=seq,
                publish_time=int(time.time() * 1000),
                deliver_at=deliver_at,
                chunk=chunk,
            )
        except Exception as exc:  # the builder has reset itself
            log.exception("chunk could not be built sequence=%d", seq)
            error = (
                exc
                if isinstance(exc, PigeonError)
                else InvalidArgument(f"chunk could not be built: {exc!r}")
            )
            return PendingBatch(seq, 1, b"", callback, error=error)
        return PendingBatch(seq, 1, payload, callback)

    def would_overflow(self, body: int) -> bool:
        """Would a message of ``body`` bytes take the batch past max_message_size?"""
        return self.count > 0 and (
            self.batch_bytes + body + SLACK_PER_MESSAGE > self.max_message_size
        )

    def added(self, completion: Completion, body: int) -> None:
        """Account for a checked message of ``body`` bytes just added to :attr:`builder`
        (whose ``add`` says whether the batch is full)."""
        n = self.count
        if not n:
            self.generation += 1
        if completion is not None:
            completions = self.completions
            if len(completions) < n:
                completions.extend(repeat(None, n - len(completions)))
            completions.append(completion)
        self.count = n + 1
        if not self.batch_bytes:
            self.batch_bytes = self.header_bytes + SLACK_PER_BATCH
        self.batch_bytes += body + SLACK_PER_MESSAGE

    def seal(
        self,
        callback_for: Callable[[list[Completion], BatchState | None, int], Any],
        *,
        deliver_at: int = 0,
    ) -> PendingBatch | None:
        """The batch built so far, ready to submit; None if it is empty.

        ``callback_for(completions, state, partition)`` makes the batch's receipt handler.

        Never raises: a batch that cannot be built (which checked input cannot cause)
        comes back with ``error`` set and fails its own messages only.
        """
        n = self.count
        if n == 0:
            return None
        seq = self.next_sequence_id
        completions, self.completions = self.completions, []
        if len(completions) < n:  # one item per message (per batch: C speed)
            completions.extend(repeat(None, n - len(completions)))
        self.count = 0
        state, self.state = self.state, None
        self.batch_bytes = 0
        callback = callback_for(completions, state, self.partition)
        try:
            payload = self.builder.build(
                sequence_id=seq, publish_time=int(time.time() * 1000), deliver_at=deliver_at
            )
        except Exception as exc:  # the builder has reset itself
            log.exception("batch could not be built sequence=%d messages=%d", seq, n)
            error = (
                exc
                if isinstance(exc, PigeonError)
                else InvalidArgument(f"batch could not be built: {exc!r}")
            )
            return PendingBatch(seq, n, b"", callback, error=error)
        self.next_sequence_id = seq + n
        return PendingBatch(seq, n, payload, callback)


class ConsumerCore:
    """Entries in, messages out; permit and ack bookkeeping for one or more engines.

    A consumer of a partitioned topic (or of several topics) has one engine per partition;
    every entry remembers the engine it came through, and acknowledgements go back through
    the engine that owns the message's segment (segment ids are unique cluster-wide).
    """

    def __init__(
        self, *, codecs: Any, receiver_queue_size: int, chunks: ChunkAssembler | None = None
    ) -> None:
        self.codecs = codecs
        #: puts chunked messages back together (see :mod:`pigeon.client._chunks`)
        self.chunks = chunks if chunks is not None else ChunkAssembler()
        self.receiver_queue_size = receiver_queue_size
        self.entries: deque[ReceivedEntry] = deque()
        self.messages: deque[Message] = deque()
        self.consumed: dict[Any, int] = {}
        self.owners: dict[int, Any] = {}
        #: (segment, entry, batch index, offset) per message; a fifth item is a count:
        #: a run of consecutive messages of the entry (acknowledge_arrow)
        self.pending_acks: dict[Any, list[tuple[int, ...]]] = {}
        self.cumulative: dict[Any, tuple[int, int, int, int]] = {}
        self._grants: list[tuple[Any, int]] = []
        #: engine -> the offset after the last message split off its entries
        self.split_next: dict[Any, int] = {}
        #: the consumer schema's decoders (None: values stay bytes)
        self.decoders: SchemaDecoders | None = None

    def push(self, entries: list[ReceivedEntry]) -> None:
        self.entries.extend(entries)

    def reset(self, source: Any = None) -> int | None:
        """After a reconnect (or seek) of ``source``: the broker redelivers; drop its queue.

        Returns the offset of the first message of ``source`` the application has not
        taken (the oldest one dropped, else the one after the last taken), None when
        nothing came through it yet: where a non-durable subscription goes on."""
        if source is None:
            self.entries.clear()
            self.messages.clear()
            self.consumed.clear()
            self.split_next.clear()
            self.chunks.reset()
            return None
        resume = self.split_next.pop(source, None)
        chunked = self.chunks.reset(source)
        if chunked is not None:
            resume = chunked if resume is None else min(resume, chunked)
        kept_messages: deque[Message] = deque()
        for m in self.messages:
            if self.owners.get(m._segment) is source:
                resume = m.offset if resume is None else min(resume, m.offset)
            else:
                kept_messages.append(m)
        kept_entries: deque[ReceivedEntry] = deque()
        for e in self.entries:
            if e.source is source:
                first = unpack_entry_header(e.data).first_offset + e.taken
                resume = first if resume is None else min(resume, first)
            else:
                kept_entries.append(e)
        self.messages, self.entries = kept_messages, kept_entries
        self.consumed.pop(source, None)
        return resume

    def expand_next(self) -> bool:
        """Split the next queued entry into messages; False if no entry is queued."""
        while self.entries:
            entry = self.entries.popleft()
            src = entry.source
            self.owners[entry.segment_id] = src
            msgs = split_entry(
                entry, src.partition, src.topic, self.codecs, self.chunks, self.decoders
            )
            if msgs is None:  # a chunk of a message not complete yet
                self._consumed(src, 1)
                continue
            if msgs:
                self._consumed(src, len(msgs))
                self.messages.extend(msgs)
                self.split_next[src] = msgs[-1].offset + 1
                return True
        return False

    def take_arrow(self, max_rows: int) -> tuple[Any, Any]:
        """``(record batch, engine)`` of up to ``max_rows`` rows of the next queued entry
        (receive_arrow), ``(None, None)`` if no entry is queued. A part of an entry stays
        queued (``taken``); rows already acknowledged are left out."""
        arrow = arrow_module()
        entries = self.entries
        while entries:
            entry = entries[0]
            src = entry.source
            if read_header(memoryview(entry.data)[ENTRY_HEADER_SIZE:]).num_chunks:
                raise NotSupported(
                    "receive_arrow: the next message is chunked (too large for one entry);"
                    " receive it with receive()"
                )
            rb, nxt, n = arrow.entry_rows(
                entry,
                topic=src.topic,
                partition=src.partition,
                codecs=self.codecs,
                start=entry.taken,
                max_rows=max_rows,
                skip=entry.acked_indexes,
            )
            self.owners[entry.segment_id] = src
            if nxt >= n:
                entries.popleft()
            else:
                entry.taken = nxt
            if rb is None:
                continue
            rows = rb.num_rows
            self._consumed(src, rows)
            self.split_next[src] = rb.column(4)[rows - 1].as_py() + 1
            return rb, src
        return None, None

    def take(self, max_messages: int) -> list[Message]:
        messages = self.messages
        left = len(messages) - max_messages
        if left <= 0:
            out = list(messages)
            messages.clear()
            return out
        if left <= max_messages:  # copying the rest costs less than popping the front
            out = list(islice(messages, max_messages))
            self.messages = deque(islice(messages, max_messages, None))
            return out
        return [messages.popleft() for _ in range(max_messages)]

    def count_consumed(self, msgs: list[Message]) -> list[tuple[Any, int]]:
        """Permits to grant now: (engine, count) once half a receiver queue was taken.

        Messages are counted per entry as they are split off the queue (see
        :meth:`expand_next`), so this does no per-message work.
        """
        grants = self._grants
        if grants:
            self._grants = []
        return grants

    def _consumed(self, src: Any, n: int) -> None:
        total = self.consumed.get(src, 0) + n
        if total >= max(1, self.receiver_queue_size // 2):
            self._grants.append((src, total))
            total = 0
        self.consumed[src] = total

    def add_ack(self, message_id: MessageId) -> bool:
        owner = self.owners.get(message_id.segment_id)
        if owner is None:
            return False
        acks = self.pending_acks.setdefault(owner, [])
        acks.append(
            (message_id.segment_id, message_id.entry_id, message_id.batch_index, message_id.offset)
        )
        return len(acks) >= 1000

    def add_ack_runs(self, runs: list[tuple[int, int, int, int, int]]) -> bool:
        """Acknowledge runs ``(segment, entry, first batch index, first offset, count)``
        of consecutive messages of one entry (one position each on the wire)."""
        flush = False
        for run in runs:
            owner = self.owners.get(run[0])
            if owner is None:
                continue
            acks = self.pending_acks.setdefault(owner, [])
            acks.append(run if run[4] > 1 else run[:4])
            flush = flush or len(acks) >= 1000
        return flush

    def add_cumulative_ack(self, message_id: MessageId) -> None:
        owner = self.owners.get(message_id.segment_id)
        if owner is None:
            return
        pos = (
            message_id.segment_id,
            message_id.entry_id,
            message_id.batch_index,
            message_id.offset,
        )
        current = self.cumulative.get(owner)
        if current is None or pos[3] > current[3]:
            self.cumulative[owner] = pos

    def take_acks(
        self,
    ) -> list[tuple[Any, list[tuple[int, ...]], tuple[int, int, int, int] | None]]:
        """(engine, individual acks, cumulative ack) per engine with anything pending."""
        out = []
        for owner in set(self.pending_acks) | set(self.cumulative):
            out.append((owner, self.pending_acks.get(owner, []), self.cumulative.get(owner)))
        self.pending_acks = {}
        self.cumulative = {}
        return out


def message_id_of(m: Message | MessageId) -> MessageId:
    if isinstance(m, Message):
        return m.message_id
    if isinstance(m, MessageId):
        return m
    raise InvalidArgument(f"expected a Message or MessageId, got {type(m).__name__}")


ROUTING_MODES = ("round_robin", "single_partition", "key_hash")


def key_hash(key: str | bytes) -> int:
    """Stable hash of a message key (CRC-32 of its UTF-8 bytes), shared by all clients."""
    return zlib.crc32(key.encode() if isinstance(key, str) else key)


class Router:
    """Chooses the partition of each message of a partitioned topic.

    * ``round_robin``: messages with a key go to ``hash(key) % n``; others fill one
      partition's batch, then the next partition's (so batches stay full).
    * ``single_partition``: keyed messages by hash; the others all to one partition
      chosen at random when the producer was created.
    * ``key_hash``: ``hash(key) % n``; messages without a key round-robin.
    * a callable ``router(key, num_partitions) -> int`` overrides the mode.
    """

    def __init__(self, mode: str, partitions: int, custom: Callable[[Any, int], int] | None = None):
        if mode not in ROUTING_MODES:
            raise InvalidArgument(
                f"routing_mode must be one of {', '.join(ROUTING_MODES)}, got {mode!r}"
            )
        self.mode = mode
        self.partitions = partitions
        self.custom = custom
        self.current = random.randrange(partitions) if partitions > 1 else 0

    def choose(self, key: str | bytes | None) -> int:
        n = self.partitions
        if n <= 1:
            return 0
        if self.custom is not None:
            index = int(self.custom(key, n))
            if not 0 <= index < n:
                raise InvalidArgument(f"message router returned {index}, not in 0..{n - 1}")
            return index
        if key is not None:
            return key_hash(key) % n
        return self.current

    def batch_sealed(self, index: int) -> None:
        """A batch of partition ``index`` was sealed: round-robin moves on."""
        if self.mode != "single_partition" and index == self.current and self.partitions > 1:
            self.current = (self.current + 1) % self.partitions

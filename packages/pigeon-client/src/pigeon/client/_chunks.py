"""Chunking, as plain classes without I/O: splitting a large message on the producer and
putting it back together on the consumer (Pulsar's chunking).

A producer with ``chunking_enabled`` (and ``batching_enabled=False``) sends a message
whose entry would exceed its limit (the broker's ``max_message_size``, or the smaller
``chunk_max_message_size``) as ``n`` entries of one message each.  Chunk ``i`` holds
bytes ``[i*size, (i+1)*size)`` of the value and the header fields ``chunkUuid``,
``chunkId = i``, ``numChunks = n``, ``totalChunkSize`` (``schema/entry.capnp``); every
chunk carries the key (so key_shared sends all of them to one consumer), the first also
the properties and event time.

**Sequence ids and de-duplication.**  Chunk ``i`` of a message whose first chunk has
sequence id ``s`` has sequence id ``s + i``, and the uuid is ``<producer name>-<s>``.
Each chunk is thus an ordinary entry to the broker's de-duplication: a resend after a
reconnect (the producer's link resends every unacknowledged entry in order, under the
same sequence ids) stores exactly the chunks that were missing, never one twice, and the
resent chunks carry the same uuid, so the consumer completes the same message.  (Pulsar
gives every chunk the message's sequence id and teaches the broker to tell chunks apart;
distinct ids need no broker change.)  A message with an explicit ``sequence_id`` uses the
ids ``sequence_id .. sequence_id + n - 1``.

**Reassembly** (:class:`ChunkAssembler`): chunks of one uuid are collected in order; the
last one yields a :class:`~pigeon.client._message.ChunkedMessage` whose id names every
chunk.  At most ``max_pending_chunked_message`` messages are incomplete at a time: a new
first chunk beyond that drops the oldest incomplete one, whose chunks are acknowledged
(``auto_ack_oldest_chunked_message_on_queue_full``) or negatively acknowledged (they come
again).  An incomplete message older than ``expire_time_of_incomplete_chunked_message``
seconds (0: never) is dropped and its chunks acknowledged: what a producer that died
half-way through a message leaves behind.  A chunk that does not follow the previous one
of its uuid (its first chunk never came: dropped, or before where the consumer started)
makes the message incomplete for good; its chunks are held (without their bytes) until
they expire, or, when its first chunk comes again, negatively acknowledged (they come
again after it).  A chunk stored twice (a resend on a namespace without de-duplication)
is acknowledged and skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pigeon.client._message import ChunkedMessage, Message, MessageId
from pigeon.core.batch import BatchHeader

__all__ = ["ChunkAssembler", "ChunkReceipts", "chunk_uuid"]

#: bytes a chunk's header takes beyond an ordinary one's, besides the uuid text: the three
#: integers and the text pointer, rounded up generously (Cap'n Proto words)
CHUNK_HEADER_SLACK = 64

Receipt = tuple[Any, ...]
Handler = Callable[[Any, BaseException | None], None]


def chunk_uuid(producer_name: str, first_sequence_id: int) -> str:
    return f"{producer_name}-{first_sequence_id}"


class ChunkReceipts:
    """The receipts of one chunked message's entries.

    :meth:`part` makes the receipt handler of chunk ``i`` (not the last); :meth:`last`
    wraps the message's own handler: it gets the last chunk's receipt extended with the
    first chunk's (a :class:`~pigeon.client._message.ChunkMessageId`), or the first error
    any chunk had.  The producer's link delivers receipts in sequence order, so the first
    chunk's comes before the last's.
    """

    __slots__ = ("error", "first")

    def __init__(self) -> None:
        self.first: Receipt | None = None
        self.error: BaseException | None = None

    def part(self, index: int) -> Handler:
        def handle(receipt: Any, error: BaseException | None) -> None:
            if error is not None:
                if self.error is None:
                    self.error = error
            elif index == 0:
                self.first = receipt

        return handle

    def last(self, handler: Handler) -> Handler:
        def handle(receipt: Any, error: BaseException | None) -> None:
            error = error or self.error
            if error is not None:
                handler(None, error)
            else:
                handler((*receipt[:4], self.first or receipt[:4]), None)

        return handle


@dataclass(eq=False)
class _Partial:
    """The chunks of one message received so far."""

    source: Any
    started: float
    num_chunks: int
    chunks: list[Message] = field(default_factory=list)
    #: a chunk is missing: the message cannot complete (its chunks wait to expire)
    broken: bool = False


class ChunkAssembler:
    """Puts chunked messages back together (see the module docstring); not thread-safe
    (the consumer's lock guards it).

    Dropped chunks wait in :attr:`dropped` as ``(chunks, ack)``: the consumer acknowledges
    them (``ack``) or negatively acknowledges them.
    """

    def __init__(
        self, *, max_pending: int = 10, expire_time: float = 60.0, auto_ack_oldest: bool = False
    ) -> None:
        self.max_pending = max_pending
        self.expire_time = expire_time
        self.auto_ack_oldest = auto_ack_oldest
        #: (topic, uuid) -> partial message, oldest first
        self.pending: dict[tuple[str, str], _Partial] = {}
        self.dropped: list[tuple[list[Message], bool]] = []
        #: the time of the consumer's clock, set by its housekeeping (every 100 ms: not per
        #: message): a message whose first chunk is added is dated then
        self.now = 0.0

    def add(self, chunk: Message, header: BatchHeader, source: Any) -> Message | None:
        """Take one chunk; the whole message if it was the last one missing."""
        key = (chunk.topic, header.chunk_uuid)
        partial = self.pending.get(key)
        if header.chunk_id == 0:
            if partial is not None:
                del self.pending[key]
                held = partial.chunks[0] if partial.chunks else None
                if held is None or (held._segment, held._entry) != (chunk._segment, chunk._entry):
                    # not these chunks coming again: chunks whose start was dropped come
                    # again after it (nacked); another copy of the start (a resend stored
                    # twice) is acknowledged
                    self._drop(partial, not partial.broken)
                # else redelivered from its first chunk (a nack, redeliver_unacknowledged):
                # begin again, the chunks held so far are the ones coming again
            partial = self._open(key, source, header.num_chunks)
        elif (
            partial is not None and not partial.broken and 0 < header.chunk_id < len(partial.chunks)
        ):
            # a chunk already held: stored twice (a resend without de-duplication), that
            # copy is acknowledged; the same one again is the one held
            held = partial.chunks[header.chunk_id]
            if (held._segment, held._entry) != (chunk._segment, chunk._entry):
                chunk.value = b""
                self.dropped.append(([chunk], True))
            return None
        elif partial is None or partial.broken or header.chunk_id != len(partial.chunks):
            if partial is None:
                partial = self._open(key, source, header.num_chunks)
            partial.broken = True
            chunk.value = b""  # never reassembled: keep only where it is
            partial.chunks.append(chunk)
            return None
        partial.chunks.append(chunk)
        if len(partial.chunks) < partial.num_chunks:
            return None
        del self.pending[key]
        return _assemble(partial.chunks)

    def _open(self, key: tuple[str, str], source: Any, num_chunks: int) -> _Partial:
        while self.pending and len(self.pending) >= self.max_pending:
            oldest = next(iter(self.pending))
            self._drop(self.pending.pop(oldest), self.auto_ack_oldest)
        partial = self.pending[key] = _Partial(source, self.now, num_chunks)
        return partial

    def _drop(self, partial: _Partial, ack: bool) -> None:
        for c in partial.chunks:
            c.value = b""
        self.dropped.append((partial.chunks, ack))

    def expire(self, now: float) -> None:
        """Drop (and acknowledge) the messages incomplete for longer than the expiry."""
        if not self.pending or self.expire_time <= 0:
            return
        limit = now - self.expire_time
        for key in [k for k, p in self.pending.items() if p.started <= limit]:
            self._drop(self.pending.pop(key), True)

    def hold(self, now: float) -> None:
        """The incomplete messages' clocks start again at ``now`` (their missing chunks
        cannot arrive yet)."""
        for partial in self.pending.values():
            partial.started = now

    def take_dropped(self) -> list[tuple[list[Message], bool]]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def reset(self, source: Any = None) -> int | None:
        """Forget the incomplete messages of ``source`` (all with None): it reconnected or
        seeked and the broker sends their chunks again.  Returns the lowest offset of a
        chunk forgotten (None if none)."""
        lowest: int | None = None
        for key in [k for k, p in self.pending.items() if source is None or p.source is source]:
            partial = self.pending.pop(key)
            if partial.chunks:
                first = min(c.offset for c in partial.chunks)
                lowest = first if lowest is None else min(lowest, first)
        return lowest


def _assemble(chunks: list[Message]) -> ChunkedMessage:
    first, last = chunks[0], chunks[-1]
    value = b"".join([c.data for c in chunks])
    ids = tuple(MessageId(c._segment, c._entry, c._index, c._partition, c.offset) for c in chunks)
    return ChunkedMessage(
        value,
        first.key,
        first.properties,
        first.event_time,
        first.publish_time,
        last._segment,
        last._entry,
        last._index,
        last._partition,
        last.offset,
        last.redelivery_count,
        last.topic,
        value,
        ids,
    )

"""Face-independent producer and consumer logic, without I/O or threads.

:class:`ProducerCore` is the accumulator: it collects messages into a batch and seals it
into a :class:`PendingBatch` whose callback resolves every message's completion.
:class:`ConsumerCore` turns received entries into messages, counts what the application
consumed so permits are granted in bulk, and groups acknowledgements.  The trio, sync and
asyncio faces wrap these with their own waiting and locking.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from pigeon.client._engine import PendingBatch, ReceivedEntry
from pigeon.client._future import BatchState
from pigeon.client._message import Message, MessageId, split_entry
from pigeon.core._batch import BatchBuilder
from pigeon.core.errors import InvalidArgument, MessageTooLarge

__all__ = ["ConsumerCore", "ProducerCore", "resolve_completions"]

Completion = Any  # None | concurrent.futures.Future | Callable[[MessageId|None, exc|None], None]


def resolve_completions(
    completions: list[Completion],
    state: BatchState | None,
    result: Any,
    error: BaseException | None,
    partition: int,
) -> None:
    if state is not None:
        state.resolve(result, error)
    if error is not None:
        for c in completions:
            if c is None:
                continue
            if isinstance(c, concurrent.futures.Future):
                if not c.done():
                    c.set_exception(error)
            else:
                c(None, error)
        return
    seg, entry, offset, _duplicate = result
    for i, c in enumerate(completions):
        if c is None:
            continue
        mid = MessageId(seg, entry, i, partition, offset + i if offset >= 0 else -1)
        if isinstance(c, concurrent.futures.Future):
            if not c.done():
                c.set_result(mid)
        else:
            c(mid, None)


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
    ) -> None:
        if max_messages < 1:
            raise InvalidArgument("batching_max_messages must be at least 1")
        self.partition = partition
        self.max_message_size = max_message_size
        self.builder = BatchBuilder(
            producer_name=producer_name, codec=codec, max_messages=max_messages, max_bytes=max_bytes
        )
        self.completions: list[Completion] = []
        self.state: BatchState | None = None
        self.next_sequence_id = first_sequence_id
        self.generation = 0

    def batch_state(self) -> BatchState:
        """The shared outcome of the batch being built (for MessageFutures)."""
        if self.state is None:
            self.state = BatchState(self.partition)
        return self.state

    def __len__(self) -> int:
        return len(self.completions)

    def add(
        self,
        value: bytes,
        key: str | bytes | None,
        properties: Mapping[str, str] | None,
        event_time: int,
        completion: Completion,
    ) -> bool:
        """Add one message; True when the batch is full and should be sealed."""
        if len(value) > self.max_message_size:
            raise MessageTooLarge(
                f"message of {len(value)} bytes exceeds max_message_size {self.max_message_size}"
            )
        if not self.completions:
            self.generation += 1
        self.completions.append(completion)
        return self.builder.add(value, key, properties, event_time)

    def seal(
        self, callback_factory: Callable[[list[Completion], BatchState | None], Any]
    ) -> PendingBatch | None:
        n = len(self.completions)
        if n == 0:
            return None
        seq = self.next_sequence_id
        payload = self.builder.build(sequence_id=seq, publish_time=int(time.time() * 1000))
        self.next_sequence_id = seq + n
        completions, self.completions = self.completions, []
        state, self.state = self.state, None
        return PendingBatch(seq, n, payload, callback_factory(completions, state))


class ConsumerCore:
    """Entries in, messages out; permit and ack bookkeeping."""

    def __init__(self, *, topic: str, partition: int, codecs: Any, receiver_queue_size: int) -> None:
        self.topic = topic
        self.partition = partition
        self.codecs = codecs
        self.receiver_queue_size = receiver_queue_size
        self.entries: deque[ReceivedEntry] = deque()
        self.messages: deque[Message] = deque()
        self.consumed = 0
        self.generation = 0
        self.pending_acks: list[tuple[int, int, int, int]] = []
        self.cumulative: tuple[int, int, int, int] | None = None

    def push(self, entries: list[ReceivedEntry]) -> None:
        self.entries.extend(entries)

    def reset(self) -> None:
        """After a reconnect: the broker redelivers; drop what was queued."""
        self.entries.clear()
        self.generation += 1
        self.consumed = 0

    def expand_next(self) -> bool:
        """Split the next queued entry into messages; False if no entry is queued."""
        while self.entries:
            entry = self.entries.popleft()
            msgs = split_entry(
                entry.data,
                segment_id=entry.segment_id,
                entry_id=entry.entry_id,
                partition=self.partition,
                topic=self.topic,
                redelivery_count=entry.redelivery_count,
                acked_indexes=entry.acked_indexes,
                codecs=self.codecs,
            )
            if msgs:
                self.messages.extend(msgs)
                return True
        return False

    def take(self, max_messages: int) -> list[Message]:
        out: list[Message] = []
        messages = self.messages
        while messages and len(out) < max_messages:
            out.append(messages.popleft())
        return out

    def count_consumed(self, n: int) -> int:
        """Record n consumed messages; returns the permits to grant now (or 0)."""
        self.consumed += n
        if self.consumed >= max(1, self.receiver_queue_size // 2):
            permits, self.consumed = self.consumed, 0
            return permits
        return 0

    def add_ack(self, message_id: MessageId) -> bool:
        self.pending_acks.append(
            (message_id.segment_id, message_id.entry_id, message_id.batch_index, message_id.offset)
        )
        return len(self.pending_acks) >= 1000

    def add_cumulative_ack(self, message_id: MessageId) -> None:
        pos = (message_id.segment_id, message_id.entry_id, message_id.batch_index, message_id.offset)
        if self.cumulative is None or pos > self.cumulative:
            self.cumulative = pos

    def take_acks(self) -> tuple[list[tuple[int, int, int, int]], tuple[int, int, int, int] | None]:
        acks, self.pending_acks = self.pending_acks, []
        cumulative, self.cumulative = self.cumulative, None
        return acks, cumulative


def message_id_of(m: Message | MessageId) -> MessageId:
    if isinstance(m, Message):
        return m.message_id
    if isinstance(m, MessageId):
        return m
    raise InvalidArgument(f"expected a Message or MessageId, got {type(m).__name__}")

"""Producer state shared by the faces: the engines of one producer and its batching logic.

A *handle* owns the engines of one producer (one per partition) and the face-independent
logic.  Every method that touches shared state takes ``self.lock`` (a ``threading.Lock``
for the sync and asyncio faces, a no-op for the trio face, whose callers are all on the
engine's thread).  Methods marked *engine* run on the engine's trio thread.  Consumers have
theirs in :mod:`pigeon.client._consumer_handle`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable
from typing import Any, cast

import trio

from pigeon.client._core import BatchCompletion, ProducerCore, Router
from pigeon.client._engine import ClientEngine, PendingBatch
from pigeon.client._logic import ProducerLogic, wall_ms
from pigeon.client._options import ProducerOptions
from pigeon.client._producer_engine import ProducerEngine
from pigeon.core import PluginManager, TopicName
from pigeon.core.codecs import Codec, CodecSet
from pigeon.core.errors import InvalidArgument

__all__ = ["NOLOCK", "ProducerFace", "ProducerHandle", "codecs_of", "deliver_time", "open_producer"]

log = logging.getLogger(__name__)

#: The lock of a producer or consumer whose callers are all on the engine's thread.
NOLOCK = contextlib.nullcontext()


class ProducerHandle:
    def __init__(self, engine: ClientEngine, engines: list[ProducerEngine], lock: Any) -> None:
        self.client = engine
        self.engines = engines
        self.logic: ProducerLogic  # set by open_producer
        self.lock = lock
        self.outstanding = 0
        self.closed = False
        self.on_space: Callable[[], None] = lambda: None
        #: *engine*, after the timer sealed a batch (the lock released)
        self.on_timer_sealed: Callable[[], None] = lambda: None
        #: under the lock: the timer task is sealing, and calls ``on_timer_sealed`` right
        #: after (a face need not schedule the hand-over of what it seals)
        self.timer_sealing = False
        #: per partition, under the lock: its timer task runs (it seals the batch it was
        #: started for and every later one open when it wakes, so a batch opened while
        #: it runs starts no task and, from the sync face, crosses no thread)
        self.timer_armed: list[bool] = [False] * len(engines)
        #: the engine's clock minus the face's (``ProducerCore.due`` is the face's; a face
        #: without a clock sets it on the engine's clock when a batch opens)
        self.due_offset = 0.0

    @property
    def topic(self) -> str:
        first = self.engines[0].topic
        return TopicName.parse(first).base.full if len(self.engines) > 1 else first

    @property
    def producer_name(self) -> str:
        return self.engines[0].producer_name

    def callback_for(self, completions: list[Any], state: Any, partition: int) -> BatchCompletion:
        return BatchCompletion(completions, state, partition, self.batch_done)

    def batch_done(self, count: int) -> None:
        """*engine*: ``count`` messages got their receipt or failed: free their space."""
        with self.lock:
            self.outstanding -= count
        self.on_space()

    def start_timer(self, index: int, generation: int, deadline: float | None = None) -> None:
        """*engine*: start the batching timer of partition ``index``'s batch, due at
        ``deadline`` (trio time; None: the batching delay from now)."""
        self.client.nursery.start_soon(self.timer, index, generation, deadline)

    async def timer(self, index: int, generation: int, deadline: float | None = None) -> None:
        """*engine*: seal partition ``index``'s batch when it is due; then, while a later
        batch is open when it wakes, sleep until that one is due (see ``timer_armed``)."""
        logic = self.logic
        sleep_until = self.client.sleep_until
        while True:
            if deadline is None:
                deadline = trio.current_time() + logic.max_delay
            await sleep_until(deadline)
            again = False
            try:
                with self.lock:
                    self.timer_sealing = True
                    try:
                        logic.timer_fired(index, generation)
                    finally:
                        self.timer_sealing = False
                    core = logic.cores[index]
                    if core.count and not self.closed and not logic.held[index]:
                        again = True
                        generation = core.generation
                        deadline = None if logic.linger else core.due + self.due_offset
                    else:
                        self.timer_armed[index] = False
            except Exception:  # seal fails only the batch's own messages; this is a bug
                log.exception("batching timer failed topic=%s", self.topic)
                with self.lock:
                    self.timer_armed[index] = False
                again = False
            self.on_timer_sealed()
            if not again:
                return

    def seal_now(self, index: int) -> None:
        """*engine*: the batching timer of a producer without a batching delay
        (``logic.linger``), called soon after its batch got its first message: seal what
        the batch holds now (or hold it while a batch is in flight), as the timer task
        would, without starting a task."""
        self._seal_as_timer(self._fire_now, index)

    def _fire_now(self, index: int) -> None:
        self.timer_armed[index] = False
        self.logic.timer_fired(index, 0)

    def engine_idle(self, index: int) -> None:
        """*engine*: partition ``index`` has no batch in flight: seal the batch held for
        that (a producer without a batching delay)."""
        if self.logic.held[index]:
            self._seal_as_timer(self.logic.engine_idle, index)

    def _seal_as_timer(self, fire: Callable[[int], None], index: int) -> None:
        """*engine*: ``fire(index)`` under the lock, sealing as the timer task does."""
        try:
            with self.lock:
                self.timer_sealing = True
                try:
                    fire(index)
                finally:
                    self.timer_sealing = False
        except Exception:  # seal fails only the batch's own messages; this is a bug
            log.exception("batching timer failed topic=%s", self.topic)
        self.on_timer_sealed()

    async def flush(self) -> None:
        """*engine*: wait until every submitted batch is acknowledged."""
        for e in self.engines:
            await e.flush()

    async def close(self) -> None:
        """*engine*"""
        for e in self.engines:
            await e.close()


class ProducerFace:
    """What a Producer of every face offers the same way (its ``_handle`` set on open), and
    the lock and hooks :func:`open_producer` gives its handle.

    The defaults are those of a producer used on the engine's own thread (the trio face's):
    no lock, a sealed batch handed to its partition's engine at once, the batching timer a
    task of the engine, receipts resolved by :class:`~pigeon.client._core.BatchCompletion`.
    """

    _handle: ProducerHandle
    _lock: Any = NOLOCK
    #: the clock of ProducerLogic (None: the timer alone seals a batch that is not full)
    _clock: Callable[[], float] | None = None

    @property
    def topic(self) -> str:
        return self._handle.topic

    @property
    def last_sequence_id(self) -> int:
        """The sequence id of the last message the broker stored from this producer (over
        all its partitions): at attach, what earlier sessions of this producer name
        stored; then each acknowledged send. -1 if none (Pulsar's ``last_sequence_id``)."""
        return max(int(e.last_sequence_id) for e in self._handle.engines)

    @property
    def producer_name(self) -> str:
        return self._handle.producer_name

    # -- hooks of ProducerLogic, called with the lock held ------------------------------

    def _submit(self, engine: ProducerEngine, batch: PendingBatch) -> None:
        """Hand a sealed batch to its partition's engine."""
        engine.submit(batch)

    def _start_timer(self, index: int, generation: int) -> None:
        """Start the batching timer of partition ``index``'s batch (unless its timer task
        runs: it finds the new batch when it wakes)."""
        h = self._handle
        logic = h.logic
        core = logic.cores[index]
        if logic.clock is None:  # when it is due, on the engine's clock (once per batch)
            core.due = trio.current_time() + logic.max_delay
        if not h.timer_armed[index]:
            h.start_timer(index, generation, core.due)
            h.timer_armed[index] = True

    def _callback_for(self, completions: list[Any], state: Any, partition: int) -> Any:
        """The receipt handler of a sealed batch."""
        return self._handle.callback_for(completions, state, partition)

    def _engine_idle(self, index: int) -> None:
        """*engine*: partition ``index`` has no batch in flight (no batching delay)."""
        self._handle.engine_idle(index)

    def _space_freed(self) -> None:
        """*engine*: messages got their receipts; there is room in the queue again."""

    def _timer_sealed(self) -> None:
        """*engine*: the batching timer sealed a batch (the lock is released)."""


async def open_producer(
    client: ClientEngine, options: ProducerOptions, *, codecs: Any, face: ProducerFace
) -> ProducerHandle:
    """*engine*: look the topic up and attach one producer per partition.

    The handle takes ``face``'s lock and hooks (see :class:`ProducerFace`): ``_submit``
    runs on whatever thread seals a batch, ``_space_freed`` on the engine's.
    """
    o = options
    codec = codecs.by_name(o.compression)
    schema = o.schema
    if schema is not None and schema.schema_type == "BYTES":
        schema = None  # bytes: nothing to encode, nothing registered (as Pulsar)
    schema_info = schema.schema_info() if schema is not None else None
    names = await client.partitioned_names(o.topic)
    router = Router(o.routing_mode, len(names), o.message_router)
    engines = []
    try:
        for i, name in enumerate(names):
            pname = (
                f"{o.producer_name}-partition-{i}"
                if o.producer_name and len(names) > 1
                else o.producer_name
            )
            e = ProducerEngine(
                client,
                name,
                producer_name=pname,
                send_timeout=o.send_timeout,
                schema_info=schema_info,
                access_mode=o.access_mode,
            )
            await e.start()
            engines.append(e)
    except BaseException:
        for e in engines:
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await e.close()
        raise
    cores = [
        ProducerCore(
            producer_name=e.producer_name,
            codec=codec,
            partition=i if len(engines) > 1 else -1,
            max_messages=o.batching_max_messages if o.batching_enabled else 1,
            max_bytes=o.batching_max_bytes,
            max_message_size=(
                min(e.max_message_size, o.chunk_max_message_size)
                if o.chunking_enabled and o.chunk_max_message_size
                else e.max_message_size
            ),
            first_sequence_id=e.last_sequence_id + 1,
            chunking=o.chunking_enabled,
            schema_version=e.schema_version + 1,
        )
        for i, e in enumerate(engines)
    ]
    handle = ProducerHandle(client, engines, face._lock)
    handle.logic = ProducerLogic(
        engines,
        cores,
        router,
        max_delay=o.batching_max_delay_ms / 1000 if o.batching_enabled else 0.0,
        submit=face._submit,
        start_timer=face._start_timer,
        clock=face._clock,
        encode=schema.encode if schema is not None else None,
    )
    handle.logic.callback_for = face._callback_for
    if handle.logic.linger:
        for i, e in enumerate(engines):
            e.on_idle = functools.partial(face._engine_idle, i)
    handle.on_space = face._space_freed
    handle.on_timer_sealed = face._timer_sealed
    return handle


def codecs_of(pm: PluginManager) -> CodecSet:
    """The codecs the plugins registered."""
    return CodecSet(cast(Codec, codec) for _name, codec in pm.codecs.items())


def deliver_time(
    deliver_at: int | None, deliver_after: float | None, now_ms: int | None = None
) -> int:
    """The deliver-at time (ms since the epoch) of a send; 0 for "now".

    ``now_ms`` is the engine's trio-anchored wall clock when called on the engine thread
    (so a MockClock moves it); other threads use the system clock.
    """
    if deliver_at is not None and deliver_after is not None:
        raise InvalidArgument("give deliver_at or deliver_after, not both")
    if deliver_after is not None:
        if (
            not isinstance(deliver_after, int | float)
            or not math.isfinite(deliver_after)
            or deliver_after < 0
        ):
            raise InvalidArgument(
                f"deliver_after must be a finite, non-negative number, got {deliver_after!r}"
            )
        when = (wall_ms() if now_ms is None else now_ms) + int(deliver_after * 1000)
    else:
        if deliver_at is not None and (
            not isinstance(deliver_at, int | float) or not math.isfinite(deliver_at)
        ):
            raise InvalidArgument(f"deliver_at must be ms since the epoch, got {deliver_at!r}")
        when = int(deliver_at or 0)
    if not -(2**63) <= when < 2**63:
        raise InvalidArgument(f"deliver time {when} is out of range")
    return when

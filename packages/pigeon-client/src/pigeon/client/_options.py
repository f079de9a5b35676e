"""The options of producers, consumers and readers, with Pulsar's names in snake_case.

Each options class's constructor *is* the keyword signature of the faces'
``create_producer`` / ``subscribe`` / ``create_reader``: a face writes the method as
``method(self, options)`` under :func:`takes_options`, which gives it the class's
parameters, defaults and annotations.  What opens the producer or consumer on the engine
(:mod:`pigeon.client._handles`) reads only these objects.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from pigeon.client._message import ChunkMessageId, MessageId
from pigeon.client._schema import Schema
from pigeon.core.errors import InvalidArgument

__all__ = [
    "ArrowSendOptions",
    "ConsumerOptions",
    "DeadLetterPolicy",
    "MultiplierRedeliveryBackoff",
    "ProducerOptions",
    "QueueingProducerOptions",
    "ReaderOptions",
    "SendOptions",
    "SequencedSendOptions",
    "TimedSendOptions",
    "takes_options",
]

#: Pulsar's ProducerAccessMode names, snake_case
ACCESS_MODES = ("shared", "exclusive", "wait_for_exclusive", "exclusive_with_fencing")

_O = TypeVar("_O")
_S = TypeVar("_S")
_R = TypeVar("_R")
_P = ParamSpec("_P")


def takes_options(
    options: Callable[_P, _O],
) -> Callable[[Callable[[_S, _O], _R]], Callable[Concatenate[_S, _P], _R]]:
    """Give a face method ``method(self, options)`` the signature of the options class.

    The method is called with the options built from the caller's arguments (an ``async``
    method builds them when awaited, as a coroutine would); ``inspect.signature`` shows
    the options' parameters, so every face offers one signature, written once.
    """
    parameters = list(inspect.signature(options).parameters.values())

    def decorate(method: Callable[[_S, _O], _R]) -> Callable[Concatenate[_S, _P], _R]:
        call: Any = method
        face: Any
        if inspect.iscoroutinefunction(method):

            async def face(self: Any, *args: Any, **kwargs: Any) -> Any:
                return await call(self, options(*args, **kwargs))

        else:

            def face(self: Any, *args: Any, **kwargs: Any) -> Any:
                return call(self, options(*args, **kwargs))

        functools.update_wrapper(face, method)
        own = inspect.signature(method)
        self_parameter = next(iter(own.parameters.values()))
        face.__signature__ = own.replace(parameters=[self_parameter, *parameters])
        return cast(Callable[Concatenate[_S, _P], _R], face)

    return decorate


def check_schema(schema: object) -> None:
    if schema is not None and not isinstance(schema, Schema):
        raise InvalidArgument(
            f"schema must be a pigeon.client.schema Schema (AvroSchema(Record), ...), "
            f"got {schema!r}"
        )


@dataclass(frozen=True)
class DeadLetterPolicy:
    """Where messages go that failed too often.

    A message redelivered more than ``max_redeliver_count`` times (or reconsumed later
    that often) is published to ``dead_letter_topic`` (default ``<topic>-<sub>-DLQ``) and
    acknowledged instead of being handed to the application again.  With
    ``retry_letter_topic`` (default ``<topic>-<sub>-RETRY`` when ``enable_retry`` is set)
    ``consumer.reconsume_later(msg, delay)`` republishes a message there with a delay; the
    consumer subscribes to the retry topic too.
    """

    max_redeliver_count: int
    dead_letter_topic: str | None = None
    retry_letter_topic: str | None = None
    enable_retry: bool = False

    def __post_init__(self) -> None:
        if self.max_redeliver_count < 1:
            raise InvalidArgument("max_redeliver_count must be at least 1")


@dataclass(frozen=True)
class MultiplierRedeliveryBackoff:
    """A redelivery delay that grows with the message's redelivery count.

    A message redelivered ``n`` times (``msg.redelivery_count``) waits
    ``min(max_delay, min_delay * multiplier ** n)`` seconds before it is redelivered again.
    Pulsar's ``MultiplierRedeliveryBackoff`` takes ``minDelayMs`` / ``maxDelayMs`` (ms);
    here they are ``min_delay`` / ``max_delay`` in seconds, like every other delay option.
    """

    min_delay: float = 1.0
    max_delay: float = 60.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        for name in ("min_delay", "max_delay", "multiplier"):
            value = getattr(self, name)
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value < 0
            ):
                raise InvalidArgument(f"{name} must be a finite number >= 0, got {value!r}")
        if self.max_delay < self.min_delay:
            raise InvalidArgument(
                f"max_delay ({self.max_delay}) must not be below min_delay ({self.min_delay})"
            )
        if self.multiplier < 1:
            raise InvalidArgument(f"multiplier must be at least 1, got {self.multiplier!r}")

    def next(self, redelivery_count: int) -> float:
        """The delay (seconds) before the next redelivery of a message redelivered
        ``redelivery_count`` times so far."""
        if redelivery_count <= 0:
            return float(self.min_delay)
        try:
            delay = self.min_delay * self.multiplier**redelivery_count
        except OverflowError:
            return float(self.max_delay)
        return float(min(self.max_delay, delay))


def _check_flag(o: object, *names: str) -> None:
    """Options that are True or False (a string such as "false" would read as true)."""
    for name in names:
        value = getattr(o, name)
        if not isinstance(value, bool):
            raise InvalidArgument(f"{name} must be True or False, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_listener(name: str, fn: object) -> None:
    if fn is not None and not callable(fn):
        raise InvalidArgument(f"{name} must be a callable (consumer, message), got {fn!r}")


def _check_backoff(name: str, backoff: object) -> None:
    if backoff is not None and not isinstance(backoff, MultiplierRedeliveryBackoff):
        raise InvalidArgument(f"{name} must be a MultiplierRedeliveryBackoff, got {backoff!r}")


@dataclass(frozen=True)
class ProducerOptions:
    """A producer's options, as the trio face takes them (its ``send`` always waits for
    space in the queue)."""

    topic: str
    _: KW_ONLY
    producer_name: str = ""
    batching_max_messages: int = 1000
    batching_max_bytes: int = 128 * 1024
    batching_max_delay_ms: float = 5.0
    compression: str = "none"
    send_timeout: float = 30.0
    max_pending_messages: int = 100_000
    routing_mode: str = "round_robin"
    message_router: Callable[[Any, int], int] | None = None
    batching_enabled: bool = True
    chunking_enabled: bool = False
    chunk_max_message_size: int = 0

    #: how values are encoded (pigeon.client.schema); None: values are bytes
    schema: Schema | None = None

    #: Pulsar's ProducerAccessMode: "shared", "exclusive", "wait_for_exclusive" or
    #: "exclusive_with_fencing" (docs/messaging.md, "Producer access modes")
    access_mode: str = "shared"

    def __post_init__(self) -> None:
        check_schema(self.schema)
        if self.access_mode not in ACCESS_MODES:
            raise InvalidArgument(
                f"access_mode must be one of {', '.join(ACCESS_MODES)}, got {self.access_mode!r}"
            )
        _check_flag(self, "chunking_enabled", "batching_enabled")
        if self.chunking_enabled and self.batching_enabled:
            raise InvalidArgument(
                "chunking_enabled needs batching_enabled=False "
                "(batching and chunking cannot be enabled together)"
            )
        size = self.chunk_max_message_size
        if not _is_int(size) or size < 0:
            raise InvalidArgument(
                f"chunk_max_message_size must be a non-negative int (0: the broker's "
                f"max_message_size), got {size!r}"
            )


@dataclass(frozen=True, kw_only=True)
class QueueingProducerOptions(ProducerOptions):
    """The sync and asyncio faces' producer options: with a full queue, a send waits for
    space (at most ``send_timeout``) or, without ``block_if_queue_full``, raises
    ProducerQueueFull."""

    block_if_queue_full: bool = True


@dataclass(frozen=True)
class ConsumerOptions:
    """A consumer's options: ``topic`` is a topic, a list of topics or a ``re.Pattern``."""

    topic: str | list[str] | re.Pattern[str]
    subscription: str
    _: KW_ONLY
    subscription_type: str = "exclusive"
    initial_position: str = "latest"
    consumer_name: str = ""
    priority: int = 0
    receiver_queue_size: int = 10_000
    ack_timeout: float = 0.0
    negative_ack_redelivery_delay: float = 1.0
    dead_letter_policy: DeadLetterPolicy | None = None
    pattern_auto_discovery_period: float = 60.0
    #: ``fn(consumer, message)`` called for every message (then ``receive`` is refused)
    message_listener: Callable[[Any, Any], Any] | None = None
    negative_ack_redelivery_backoff: MultiplierRedeliveryBackoff | None = None
    ack_timeout_redelivery_backoff: MultiplierRedeliveryBackoff | None = None
    max_pending_chunked_message: int = 10
    auto_ack_oldest_chunked_message_on_queue_full: bool = False
    expire_time_of_incomplete_chunked_message: float = 60.0

    #: acknowledge returns once the broker stored the ack in the cursor (or raises
    #: AckNotPersisted); docs/messaging.md, "Acknowledgement receipts"
    ack_receipt_enabled: bool = False
    #: how values are decoded (pigeon.client.schema); None: ``msg.value`` is the bytes
    schema: Schema | None = None

    read_compacted: bool = False

    def __post_init__(self) -> None:
        check_schema(self.schema)
        _check_flag(self, "ack_receipt_enabled", "read_compacted")
        if self.read_compacted and self.subscription_type in ("shared", "key_shared"):
            raise InvalidArgument(
                "read_compacted is only allowed on exclusive and failover subscriptions,"
                f" not {self.subscription_type}"
            )
        _check_listener("message_listener", self.message_listener)
        _check_backoff("negative_ack_redelivery_backoff", self.negative_ack_redelivery_backoff)
        _check_backoff("ack_timeout_redelivery_backoff", self.ack_timeout_redelivery_backoff)
        t = self.ack_timeout
        if not isinstance(t, int | float) or isinstance(t, bool) or not t >= 0:
            raise InvalidArgument(f"ack_timeout must be seconds >= 0 (0: none), got {t!r}")
        if self.ack_timeout_redelivery_backoff is not None and not self.ack_timeout > 0:
            raise InvalidArgument("ack_timeout_redelivery_backoff needs an ack_timeout above 0")
        check_chunk_options(self)


def check_chunk_options(o: ConsumerOptions | ReaderOptions) -> None:
    """The chunk reassembly options of a consumer or reader (see pigeon.client._chunks)."""
    _check_flag(o, "auto_ack_oldest_chunked_message_on_queue_full")
    n = o.max_pending_chunked_message
    if not _is_int(n) or n < 1:
        raise InvalidArgument(f"max_pending_chunked_message must be an int >= 1, got {n!r}")
    t = o.expire_time_of_incomplete_chunked_message
    if not isinstance(t, int | float) or isinstance(t, bool) or not t >= 0:
        raise InvalidArgument(
            f"expire_time_of_incomplete_chunked_message must be seconds >= 0 (0: never), got {t!r}"
        )


@dataclass(frozen=True)
class ReaderOptions:
    """A reader's options; ``start`` is ``"earliest"``, ``"latest"`` or a MessageId.

    Checked when built, so a bad start raises before anything touches the network.
    """

    topic: str
    start: str | MessageId = "earliest"
    _: KW_ONLY
    start_message_id_inclusive: bool = False
    receiver_queue_size: int = 10_000
    #: ``fn(reader, message)`` called for every message (then ``read_next`` is refused)
    reader_listener: Callable[[Any, Any], Any] | None = None
    max_pending_chunked_message: int = 10
    auto_ack_oldest_chunked_message_on_queue_full: bool = False
    expire_time_of_incomplete_chunked_message: float = 60.0
    #: how values are decoded (pigeon.client.schema); None: ``msg.value`` is the bytes
    schema: Schema | None = None
    read_compacted: bool = False

    def __post_init__(self) -> None:
        check_chunk_options(self)
        self.start_position()
        _check_listener("reader_listener", self.reader_listener)
        check_schema(self.schema)
        _check_flag(self, "read_compacted")

    def start_position(self) -> tuple[str, int]:
        """``(initial_position, start_offset)`` of the reader's non-durable cursor."""
        start = self.start
        if isinstance(start, MessageId):
            if self.start_message_id_inclusive and isinstance(start, ChunkMessageId):
                start = start.first_chunk_message_id  # the whole chunked message
            if start.offset < 0:
                raise InvalidArgument("a reader start MessageId must carry its offset")
            return "earliest", start.offset + (0 if self.start_message_id_inclusive else 1)
        if start not in ("earliest", "latest"):
            raise InvalidArgument(
                f"start must be 'earliest', 'latest' or a MessageId, got {start!r}"
            )
        return start, -1


@dataclass(frozen=True)
class ArrowSendOptions:
    """What every face's ``send_arrow`` takes: a ``pyarrow.Table`` or ``RecordBatch`` and
    the names of its value, key, properties and event time columns (the sync face's
    ``send_arrow`` says what each may hold). Built once per call, not per row.

    ``sequence_id``: the first row's sequence id, the next rows' following it (as
    ``send_async(sequence_id=...)`` sets one message's; it must not go down); only on a
    producer of one partition. The broker stores each (producer name, sequence id) once,
    which makes a replayed table idempotent (the Spark sink's exactly-once writes)."""

    data: Any
    _: KW_ONLY
    value: str = "value"
    key: str | None = None
    properties: str | None = None
    event_time: str | None = None
    sequence_id: int | None = None


@dataclass(frozen=True)
class SendOptions:
    """One message as the trio face's ``Producer.send`` takes it.

    ``send`` is built on ``send_async``, whose signature each face writes out (it is the
    hot path: no options object is built per message there).
    """

    value: Any
    _: KW_ONLY
    key: str | bytes | None = None
    properties: Mapping[str, str] | None = None
    event_time: int = 0
    deliver_at: int | None = None
    deliver_after: float | None = None

    def send_async_keywords(self) -> dict[str, Any]:
        """The keywords of the face's ``send_async`` for this message (all but ``value``
        and ``timeout``)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("value", "timeout")
        }


@dataclass(frozen=True, kw_only=True)
class TimedSendOptions(SendOptions):
    """The asyncio face's: how long ``send`` waits for the receipt."""

    timeout: float | None = None


@dataclass(frozen=True, kw_only=True)
class SequencedSendOptions(TimedSendOptions):
    """The sync face's: with an explicit sequence id (see ``ProducerLogic.add``)."""

    sequence_id: int | None = None

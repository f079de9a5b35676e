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
import re
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from pigeon.client._message import MessageId
from pigeon.core.errors import InvalidArgument

__all__ = [
    "ConsumerOptions",
    "DeadLetterPolicy",
    "ProducerOptions",
    "QueueingProducerOptions",
    "ReaderOptions",
    "SendOptions",
    "SequencedSendOptions",
    "TimedSendOptions",
    "takes_options",
]

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
    read_compacted: bool = False

    def __post_init__(self) -> None:
        if self.read_compacted and self.subscription_type in ("shared", "key_shared"):
            raise InvalidArgument(
                "read_compacted is only allowed on exclusive and failover subscriptions,"
                f" not {self.subscription_type}"
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
    read_compacted: bool = False

    def __post_init__(self) -> None:
        self.start_position()

    def start_position(self) -> tuple[str, int]:
        """``(initial_position, start_offset)`` of the reader's non-durable cursor."""
        start = self.start
        if isinstance(start, MessageId):
            if start.offset < 0:
                raise InvalidArgument("a reader start MessageId must carry its offset")
            return "earliest", start.offset + (0 if self.start_message_id_inclusive else 1)
        if start not in ("earliest", "latest"):
            raise InvalidArgument(
                f"start must be 'earliest', 'latest' or a MessageId, got {start!r}"
            )
        return start, -1


@dataclass(frozen=True)
class SendOptions:
    """One message as the trio face's ``Producer.send`` takes it.

    ``send`` is built on ``send_async``, whose signature each face writes out (it is the
    hot path: no options object is built per message there).
    """

    value: bytes
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

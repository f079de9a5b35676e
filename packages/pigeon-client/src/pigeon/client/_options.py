"""The options of producers, consumers and readers, with Pulsar's names in snake_case.

Every face's ``create_producer`` / ``subscribe`` / ``create_reader`` keeps its keyword
signature and builds one of these in a single call; what opens the producer or consumer on
the engine (:mod:`pigeon.client._handles`) reads only these objects.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pigeon.client._message import MessageId
from pigeon.core.errors import InvalidArgument

__all__ = [
    "ConsumerOptions",
    "DeadLetterPolicy",
    "ProducerOptions",
    "ReaderOptions",
    "options_from",
]


_Options = TypeVar("_Options")


def options_from(options: type[_Options], arguments: Mapping[str, Any]) -> _Options:
    """``options`` built from a face method's arguments (its ``locals()`` on entry).

    Every field the method has a parameter for takes the argument; the others keep their
    defaults (a test checks each keyword is a field with the same default).
    """
    names = getattr(options, "__dataclass_fields__")  # noqa: B009 - a dataclass type
    return options(**{k: v for k, v in arguments.items() if k in names})


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
    """A producer's options (``block_if_queue_full`` is not offered by the trio face,
    whose ``send`` always waits for space)."""

    topic: str
    producer_name: str = ""
    batching_max_messages: int = 1000
    batching_max_bytes: int = 128 * 1024
    batching_max_delay_ms: float = 5.0
    compression: str = "none"
    send_timeout: float = 30.0
    max_pending_messages: int = 100_000
    block_if_queue_full: bool = True
    routing_mode: str = "round_robin"
    message_router: Callable[[Any, int], int] | None = None


@dataclass(frozen=True)
class ConsumerOptions:
    """A consumer's options: ``topic`` is a topic, a list of topics or a ``re.Pattern``."""

    topic: str | list[str] | re.Pattern[str]
    subscription: str
    subscription_type: str = "exclusive"
    initial_position: str = "latest"
    consumer_name: str = ""
    priority: int = 0
    receiver_queue_size: int = 10_000
    ack_timeout: float = 0.0
    negative_ack_redelivery_delay: float = 1.0
    dead_letter_policy: DeadLetterPolicy | None = None
    pattern_auto_discovery_period: float = 60.0


@dataclass(frozen=True)
class ReaderOptions:
    """A reader's options; ``start`` is ``"earliest"``, ``"latest"`` or a MessageId.

    Checked when built, so a bad start raises before anything touches the network.
    """

    topic: str
    start: str | MessageId = "earliest"
    start_message_id_inclusive: bool = False
    receiver_queue_size: int = 10_000

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

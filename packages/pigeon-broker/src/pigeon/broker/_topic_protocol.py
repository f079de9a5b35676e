"""What the broker core asks of a loaded topic, persistent or not."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pigeon.broker._dedup import Deduplication, Receipt
from pigeon.broker._ledger_state import Position
from pigeon.core import TopicName

if TYPE_CHECKING:
    from pigeon.broker._policies import NamespacePolicies
    from pigeon.broker._topic import Producer, Topic

__all__ = ["SeekTarget", "TopicProtocol"]


@dataclass(frozen=True, slots=True)
class SeekTarget:
    """Where a seek moves a cursor: to an offset, a publish time or a message (its
    entry's position and its index in the batch); exactly one is set."""

    offset: int | None = None
    timestamp: int | None = None
    position: tuple[Position, int] | None = None


class TopicProtocol(Protocol):
    """What the broker core asks of a topic, persistent (:class:`Topic`) or not
    (:class:`~pigeon.broker._nonpersistent.NonPersistentTopic`): the core calls these
    instead of branching on ``persistent``."""

    name: TopicName
    #: True for a topic with a log (``persistent://``); what the admin API reports
    persistent: bool
    #: set when the topic is unloaded or deleted here: nothing may attach to it then
    unloaded: bool
    producers: dict[str, Producer]
    subscriptions: dict[str, Any]
    dedup: Deduplication

    @property
    def msgs_in(self) -> int: ...

    @property
    def bytes_in(self) -> int: ...

    @property
    def next_offset(self) -> int: ...

    @property
    def holding(self) -> bool:
        """Sends are held (producer_request_hold): later ones must wait behind them."""
        ...

    def backlog_bytes(self) -> int: ...

    def hold(self, send: Any) -> None: ...

    def append(
        self, payload: bytes | memoryview, n: int, callback: Any, *, deliver_at: int = 0
    ) -> None: ...

    def confirm_sequence(self, segment_id: int, entry_id: int) -> None: ...

    def may_find_original(self, name: str, first: int) -> bool: ...

    async def original_receipt(self, name: str, first: int, count: int) -> Receipt | None: ...

    async def subscription(
        self, name: str, sub_type: str, initial_position: str, *, durable: bool, start_offset: int
    ) -> Any: ...

    def seek(self, sub: Any, target: SeekTarget) -> Awaitable[None]: ...

    def last_message_id(self, sub: Any) -> tuple[Position, int, int]: ...

    async def maintain(self, policies: NamespacePolicies) -> None: ...

    async def snapshot_dedup(self) -> None: ...

    def as_persistent(self) -> Topic:
        """This topic, for operations on its log and cursors; NotSupported if it has none."""
        ...

    async def find_subscription(self, name: str) -> Any:
        """The subscription ``name`` (a stored cursor loaded); SubscriptionNotFound."""
        ...

    async def load_subscriptions(self) -> None:
        """Load every stored cursor no consumer attached to since the topic loaded."""
        ...

    async def close_subscriptions(self, names: list[str] | None = None) -> None:
        """Stop the named (or all) subscriptions (persisting their cursors) and drop them."""
        ...

    async def delete_subscription(self, sub: Any, detach: Callable[[], object]) -> None:
        """Delete ``sub`` (and its cursor); ``detach()`` detaches its consumers."""
        ...

    def internal_stats(self) -> dict[str, Any]:
        """``next_offset``, ``segments``, ``cursors`` and ``cache`` in detail."""
        ...

    def storage_stats(self) -> dict[str, int]:
        """``first_offset``, ``storage_size``, ``segments`` and ``corrupt_entries``."""
        ...

    async def close(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...

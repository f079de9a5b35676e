"""The consumers and entries the Dispatcher tests hand to a
:class:`pigeon.broker._dispatch.Dispatcher`, and helpers to build one and read its
decisions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pigeon.broker import CursorState
from pigeon.broker._dispatch import Delivery, Dispatcher, Position


@dataclass(eq=False)
class FakeConsumer:
    consumer_id: int
    name: str
    priority: int = 0
    closed: bool = False
    permits: int = 0
    pending: set[Position] = field(default_factory=set)
    join_offset: int | None = None


@dataclass(frozen=True)
class FakeEntry:
    position: Position
    first_offset: int
    num_messages: int
    deliver_at: int = 0
    keys: tuple[bytes | None, ...] = ()


def keys_of(entry: FakeEntry) -> Sequence[bytes | None]:
    return entry.keys or (None,) * entry.num_messages


def dispatcher(sub_type: str, mark_delete: int = 0, partition: int = 0) -> Dispatcher:
    return Dispatcher(
        "s", sub_type, CursorState(mark_delete), partition_index=partition, keys_of=keys_of
    )


def entries(n: int, size: int = 1, start: int = 0, **kw: object) -> list[FakeEntry]:
    return [FakeEntry((1, i), start + i * size, size, **kw) for i in range(n)]  # type: ignore[arg-type]


def sent(deliveries: list[Delivery]) -> list[tuple[str, Position, list[int]]]:
    return [(d.consumer.name, d.entry.position, d.skip) for d in deliveries]


NOW = 1_000_000

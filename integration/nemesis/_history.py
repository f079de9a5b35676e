"""What a nemesis run saw: sends, deliveries, the final read, attach samples and faults.

Plain records, appended from many threads (``list.append`` is atomic), timestamps in
seconds since the run started (``time.monotonic``).  The checker (:mod:`._checker`)
only reads them, so synthetic histories test it without any process.

A message is named by :data:`MsgId` ``(topic, producer, seq)``: the workload writes
``"<producer>:<topic>:<seq>:"`` at the start of every payload, so whatever a consumer or
the final read gets can be traced to the send that made it.
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "AckReceipt",
    "Attach",
    "Delivery",
    "Event",
    "Fault",
    "History",
    "LogRecord",
    "MsgId",
    "Position",
    "Send",
    "format_payload",
    "parse_payload",
]

#: (topic key, producer, sequence number)
MsgId = tuple[str, str, int]
#: (partition, segment_id, entry_id, batch_index): where a message is stored
Position = tuple[int, int, int, int]


def format_payload(topic: str, producer: str, seq: int, size: int = 100) -> bytes:
    head = f"{producer}:{topic}:{seq}:".encode()
    return head + b"." * max(0, size - len(head))


def parse_payload(value: bytes) -> MsgId | None:
    """``(topic, producer, seq)`` of a workload payload, None for anything else."""
    parts = bytes(value[:64]).split(b":", 3)
    if len(parts) < 4:
        return None
    try:
        return (parts[1].decode(), parts[0].decode(), int(parts[2]))
    except (UnicodeDecodeError, ValueError):
        return None


@dataclass
class Send:
    """One ``send_async``: invoked, then acknowledged (with a receipt) or failed."""

    topic: str
    producer: str
    seq: int
    invoked: float
    acked: float | None = None
    #: the receipt's position; segment/entry -1 when the broker named none
    position: Position | None = None
    failed: float | None = None
    error: str | None = None

    @property
    def id(self) -> MsgId:
        return (self.topic, self.producer, self.seq)


@dataclass(frozen=True)
class Delivery:
    """A message handed to a consumer (subscription) or reader (``reader:<topic>``)."""

    t: float
    subscription: str
    consumer: str
    id: MsgId | None
    position: Position
    redelivery_count: int = 0
    raw: str = ""


@dataclass(frozen=True)
class AckReceipt:
    """An acknowledgement the broker confirmed as stored (``ack_receipt_enabled``): from
    ``t`` on, the message must never be delivered to ``subscription`` again."""

    t: float
    subscription: str
    id: MsgId


@dataclass(frozen=True)
class LogRecord:
    """One message of the final read of a topic from the earliest position."""

    topic: str
    id: MsgId | None
    position: Position
    offset: int
    index: int  # order of arrival in the final read
    raw: str = ""


@dataclass(frozen=True)
class Attach:
    """Consumers and backlog of one subscription as the admin API reported them."""

    t: float
    topic: str
    subscription: str
    consumers: int
    backlog: int
    #: consumer names attached (on every partition of a partitioned topic)
    names: tuple[str, ...] = ()


@dataclass
class Fault:
    """One fault of the schedule as it was carried out."""

    kind: str  # kill | pause | cut
    target: str  # bookie-1, broker-0, metadata
    planned_at: float
    duration: float
    started: float | None = None
    healed: float | None = None
    note: str = ""


@dataclass(frozen=True)
class Event:
    """Anything else worth a line: a node crashed by itself, a consumer error, ..."""

    t: float
    kind: str
    detail: str


@dataclass
class History:
    #: topic key -> subscription names (``<topic>/<type>``) expected to get every message
    subscriptions: dict[str, list[str]] = field(default_factory=dict)
    #: subscription -> how many consumers the workload keeps open on it
    consumers_expected: dict[str, int] = field(default_factory=dict)
    #: topic key -> reader names
    readers: dict[str, list[str]] = field(default_factory=dict)
    sends: list[Send] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    #: acknowledgements with a receipt (the subscriptions with ack_receipt_enabled)
    receipts: list[AckReceipt] = field(default_factory=list)
    final_read: list[LogRecord] = field(default_factory=list)
    attach: list[Attach] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    #: end of the nemesis (everything healed) and of production, seconds since start
    healed_at: float | None = None
    production_stopped: float | None = None
    #: when the drain ended: attach samples from then on are the end state
    drained_at: float | None = None
    #: topic key -> how its final read ended (complete, idle, or "unreadable: why")
    final_read_status: dict[str, str] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, kind: str, detail: str) -> None:
        self.events.append(Event(self.now(), kind, detail))

    def dump(self, path: Path) -> None:
        """Every record as one JSON line (gzip), for a post-mortem of a failed run."""
        with gzip.open(path, "wt", compresslevel=1) as out:
            meta = {name: getattr(self, name) for name in _META}
            out.write(json.dumps({"type": "meta", **meta}) + "\n")
            for name in _RECORDS:
                for record in getattr(self, name):
                    out.write(json.dumps({"type": name, **_plain(asdict(record))}) + "\n")

    @classmethod
    def load(cls, path: Path) -> History:
        """A history written by :meth:`dump`, to check it again."""
        h = cls(t0=0.0)
        kinds: dict[str, Any] = {
            "sends": Send,
            "deliveries": Delivery,
            "receipts": AckReceipt,
            "final_read": LogRecord,
            "attach": Attach,
            "faults": Fault,
            "events": Event,
        }
        with gzip.open(path, "rt") as lines:
            for line in lines:
                record = json.loads(line)
                kind = record.pop("type")
                if kind == "meta":
                    for name in _META:
                        setattr(h, name, record[name])
                    continue
                for key in ("position", "id", "names"):
                    if isinstance(record.get(key), list):
                        record[key] = tuple(record[key])
                getattr(h, kind).append(kinds[kind](**record))
        return h


#: History lists written one record a line
_RECORDS = ("sends", "deliveries", "receipts", "final_read", "attach", "faults", "events")

#: History fields written as the first line of a dump
_META = (
    "subscriptions",
    "consumers_expected",
    "readers",
    "healed_at",
    "production_stopped",
    "drained_at",
    "final_read_status",
)


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

"""pigeon-broker: the stateless serving node of PigeonMQ."""

from __future__ import annotations

from pigeon.broker._config import BrokerConfig
from pigeon.broker._cursor import CursorState, RangeSet
from pigeon.broker._ledger import ManagedLedger
from pigeon.broker._ledger_state import LedgerConfig
from pigeon.broker._node import BookieDirectory, run_broker, run_standalone
from pigeon.broker._offload import FileSystemOffloader, S3Offloader
from pigeon.broker._service import BrokerService

__all__ = [
    "BookieDirectory",
    "BrokerConfig",
    "BrokerService",
    "CursorState",
    "FileSystemOffloader",
    "LedgerConfig",
    "ManagedLedger",
    "RangeSet",
    "S3Offloader",
    "run_broker",
    "run_standalone",
]

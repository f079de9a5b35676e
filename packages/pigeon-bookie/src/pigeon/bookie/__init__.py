"""pigeon-bookie: the storage node of PigeonMQ (segment store + its RPC service)."""

from __future__ import annotations

from pigeon.bookie._service import BookieConfig, BookieServer
from pigeon.bookie._storage import SegmentStore

__all__ = ["BookieConfig", "BookieServer", "SegmentStore"]

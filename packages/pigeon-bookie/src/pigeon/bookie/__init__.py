"""pigeon-bookie: the storage node of PigeonMQ (segment store + its RPC service).

Public: this package's names and :mod:`pigeon.bookie.testing` (helpers that damage a
bookie's files on purpose); every ``_name`` module is private.
"""

from __future__ import annotations

from pigeon.bookie._gc import CollectorStatistics, SegmentCollector
from pigeon.bookie._inspect import InspectReport, SegmentReport, inspect_data_dir
from pigeon.bookie._journal import JournalStore
from pigeon.bookie._metrics import render_metrics
from pigeon.bookie._service import BookieConfig, BookieServer, DiskSpacePolicy
from pigeon.bookie._storage import AppendWaiter, SegmentInfo, SegmentStore, StoreStatistics

__all__ = [
    "AppendWaiter",
    "BookieConfig",
    "BookieServer",
    "CollectorStatistics",
    "DiskSpacePolicy",
    "InspectReport",
    "JournalStore",
    "SegmentCollector",
    "SegmentInfo",
    "SegmentReport",
    "SegmentStore",
    "StoreStatistics",
    "inspect_data_dir",
    "render_metrics",
]

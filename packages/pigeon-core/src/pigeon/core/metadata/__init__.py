"""Metadata stores: a versioned tree of small values with sessions and watches.

::

    store = EmbeddedMetadataStore.from_url("embedded:///var/pigeon")
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await store.create("/brokers/b1", b"127.0.0.1:6650", ephemeral=True)
        async with store.watch("/brokers", prefix=True) as events:
            async for event in events:
                ...

The contract every backend honours is documented in :mod:`pigeon.core.metadata._store`
and checked by :class:`pigeon.core.testing.MetadataStoreContract`.  Backend authors also
get the path helpers, :class:`WatchHub`, :data:`DEFAULT_WATCH_BUFFER` and
:func:`check_timeout` (the check of their timeout options) from here, and, for a
server with conditional multi-key transactions, the write planner (:class:`Planner`)
and the store base class that runs it (:class:`TransactionalMetadataStore`);
:func:`parse_server_url` reads ``scheme://host:port,.../path?option=seconds`` URLs.
"""

from __future__ import annotations

from pigeon.core.metadata._election import LeaderElection, Lock, lead_forever
from pigeon.core.metadata._embedded import EmbeddedMetadataStore, EmbeddedStoreStatistics
from pigeon.core.metadata._lifecycle import MetadataStoreStatistics, StoreLifecycle
from pigeon.core.metadata._plan import (
    Create,
    Delete,
    NeedRead,
    NodeView,
    Planner,
    Snapshot,
    StaleRead,
    WriteOp,
    first_reads,
)
from pigeon.core.metadata._store import (
    DEFAULT_WATCH_BUFFER,
    SEQUENCE_DIGITS,
    EventType,
    MetadataStore,
    Op,
    OpKind,
    Stat,
    Watcher,
    WatchEvent,
    WatchHub,
    WatchHubStatistics,
    check_timeout,
    check_value,
    join_path,
    node_name,
    parent_path,
    sequence_number,
    validate_create,
    validate_ops,
    validate_path,
    validate_sequential_prefix,
)
from pigeon.core.metadata._transactional import TransactionalMetadataStore
from pigeon.core.metadata._url import ServerURL, parse_server_url

__all__ = [
    "DEFAULT_WATCH_BUFFER",
    "Create",
    "Delete",
    "EmbeddedMetadataStore",
    "EmbeddedStoreStatistics",
    "EventType",
    "LeaderElection",
    "lead_forever",
    "Lock",
    "MetadataStore",
    "MetadataStoreStatistics",
    "NeedRead",
    "NodeView",
    "Op",
    "OpKind",
    "Planner",
    "SEQUENCE_DIGITS",
    "ServerURL",
    "Snapshot",
    "StaleRead",
    "Stat",
    "StoreLifecycle",
    "TransactionalMetadataStore",
    "WatchEvent",
    "WatchHub",
    "WatchHubStatistics",
    "Watcher",
    "WriteOp",
    "check_timeout",
    "check_value",
    "first_reads",
    "join_path",
    "node_name",
    "parent_path",
    "parse_server_url",
    "sequence_number",
    "validate_create",
    "validate_ops",
    "validate_path",
    "validate_sequential_prefix",
]

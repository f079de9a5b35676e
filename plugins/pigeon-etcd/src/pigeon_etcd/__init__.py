"""etcd metadata store for PigeonMQ: ``etcd://host:port/prefix``.

Installing this distribution registers the ``etcd`` URL scheme through the ``pigeon``
entry-point group.  :class:`EtcdMetadataStore` passes
:class:`pigeon.core.testing.MetadataStoreContract`; the key layout is described in
:mod:`pigeon_etcd._plan`, sessions (leases) and watches in :mod:`pigeon_etcd._store`.

etcd3 and gRPC are imported only when a store starts (``pigeon_etcd._grpc``), which sets
``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python`` first: etcd3 0.12's generated protobuf
modules only load with the pure-Python protobuf runtime.
"""

from __future__ import annotations

from typing import Any

import pluggy

from pigeon.core import Registry
from pigeon_etcd._store import EtcdMetadataStore, EtcdStoreStatistics

__all__ = ["EtcdMetadataStore", "EtcdStoreStatistics", "pigeon_metadata_stores"]

hookimpl = pluggy.HookimplMarker("pigeon")


@hookimpl
def pigeon_metadata_stores(registry: Registry[Any]) -> None:
    registry.register("etcd", EtcdMetadataStore.from_url)

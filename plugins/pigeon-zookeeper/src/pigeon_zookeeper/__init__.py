"""ZooKeeper metadata store for PigeonMQ: ``zk://host:port[,host:port]/chroot``.

Installing this distribution registers the ``zk`` URL scheme through the ``pigeon``
entry-point group, so ``pigeon broker --metadata zk://127.0.0.1:2181/pigeon`` works on
any node that has it.  :class:`ZooKeeperMetadataStore` passes
:class:`pigeon.core.testing.MetadataStoreContract`; how it maps the contract onto
ZooKeeper (a change log for exact watch events, an own sequential counter, sessions with
an index of their ephemeral nodes) is described in :mod:`pigeon_zookeeper._plan` and
:mod:`pigeon_zookeeper._store`.
"""

from __future__ import annotations

from typing import Any

import pluggy

from pigeon.core import Registry
from pigeon_zookeeper._store import ZooKeeperMetadataStore, ZooKeeperStoreStatistics

__all__ = ["ZooKeeperMetadataStore", "ZooKeeperStoreStatistics", "pigeon_metadata_stores"]

hookimpl = pluggy.HookimplMarker("pigeon")


@hookimpl
def pigeon_metadata_stores(registry: Registry[Any]) -> None:
    registry.register("zk", ZooKeeperMetadataStore.from_url)

"""The public names of pigeon_zookeeper: nothing private leaks, nothing public is missing."""

from __future__ import annotations

import pigeon_zookeeper

from pigeon.core.testing import check_exports


def test_public_names() -> None:
    check_exports(pigeon_zookeeper, "ZooKeeperMetadataStore", "pigeon_metadata_stores")

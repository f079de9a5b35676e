"""The public names of pigeon_etcd: nothing private leaks, nothing public is missing."""

from __future__ import annotations

import pigeon_etcd

from pigeon.core.testing import check_exports


def test_public_names() -> None:
    check_exports(pigeon_etcd, "EtcdMetadataStore", "pigeon_metadata_stores")

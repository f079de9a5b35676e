"""The public names of pigeon_etcd: nothing private leaks, nothing public is missing."""

from __future__ import annotations

import pigeon_etcd


def test_public_names() -> None:
    for name in pigeon_etcd.__all__:
        assert hasattr(pigeon_etcd, name), name
    public = {
        name
        for name, value in vars(pigeon_etcd).items()
        if not name.startswith("_") and getattr(value, "__module__", "").startswith("pigeon_etcd")
    }
    assert public <= set(pigeon_etcd.__all__)
    assert "EtcdMetadataStore" in pigeon_etcd.__all__
    assert "pigeon_metadata_stores" in pigeon_etcd.__all__

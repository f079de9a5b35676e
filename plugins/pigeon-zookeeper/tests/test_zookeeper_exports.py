"""The public names of pigeon_zookeeper: nothing private leaks, nothing public is missing."""

from __future__ import annotations

import pigeon_zookeeper


def test_public_names() -> None:
    for name in pigeon_zookeeper.__all__:
        assert hasattr(pigeon_zookeeper, name), name
    public = {
        name
        for name, value in vars(pigeon_zookeeper).items()
        if not name.startswith("_")
        and getattr(value, "__module__", "").startswith("pigeon_zookeeper")
    }
    assert public <= set(pigeon_zookeeper.__all__)
    assert "ZooKeeperMetadataStore" in pigeon_zookeeper.__all__
    assert "pigeon_metadata_stores" in pigeon_zookeeper.__all__

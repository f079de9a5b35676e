"""The metadata paths are stored state: a running cluster's nodes live under them, so they
never change (a broker or bookie of another version must find the same nodes)."""

from __future__ import annotations

from pigeon.core import TopicName, paths


def test_topic_paths_are_under_their_roots() -> None:
    topic = TopicName.parse("persistent://acme/orders/created-partition-3")
    assert paths.ledger_path(topic) == "/pigeon/ledgers/persistent/acme/orders/created-partition-3"
    assert paths.cursors_path(topic) == "/pigeon/cursors/persistent/acme/orders/created-partition-3"
    assert (
        paths.cursor_path(topic, "billing")
        == "/pigeon/cursors/persistent/acme/orders/created-partition-3/billing"
    )
    assert paths.dedup_path(topic) == "/pigeon/dedup/persistent/acme/orders/created-partition-3"
    base = TopicName.parse("persistent://acme/orders/created")
    assert (
        paths.partitioned_topic_path(base)
        == "/pigeon/partitioned-topics/persistent/acme/orders/created"
    )


def test_segment_nodes_are_named_by_16_hex_digits() -> None:
    assert paths.segment_path(42) == "/pigeon/segments/000000000000002a"
    assert paths.SEGMENT_ID_PREFIX == "/pigeon/segment-ids/s-"


def test_cluster_paths() -> None:
    assert paths.BOOKIES_PATH == "/pigeon/bookies/available"
    assert paths.BROKERS_PATH == "/pigeon/brokers/available"
    assert paths.BROKER_SESSIONS_PATH == "/pigeon/brokers/sessions"
    assert paths.OWNERSHIP_PATH == "/pigeon/ownership"
    assert paths.TENANTS_PATH == "/pigeon/tenants"
    assert paths.NAMESPACES_PATH == "/pigeon/namespaces"
    assert paths.UNLOAD_REQUESTS_PATH == "/pigeon/unload-requests"
    assert paths.AUDITOR_PATH == "/pigeon/auditor"
    assert paths.LOAD_MANAGER_PATH == "/pigeon/load-manager"
    assert paths.OFFLOAD_SWEEPER_PATH == "/pigeon/offload-sweeper"

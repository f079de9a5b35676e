"""Operations on a running broker that the admin API needs.

Everything here works on a :class:`~pigeon.broker._service.BrokerService` in its own trio
run and raises :mod:`pigeon.core.errors` classes for every expected failure (missing
object, conflict, bad value); the HTTP layer (:mod:`pigeon.broker._admin`) only maps them
to status codes.  Results are plain JSON-ready dicts.

This module gathers them: tenants, namespaces, topics and their statistics
(:mod:`pigeon.broker._admin_topics`), subscriptions
(:mod:`pigeon.broker._admin_subscriptions`), brokers, bundles, bookies and health
(:mod:`pigeon.broker._admin_cluster`).  The lifecycle operations (unload a topic or a
bundle, delete a topic) are the broker core's, in :mod:`pigeon.broker._lifecycle`.
"""

from __future__ import annotations

from pigeon.broker._admin_cluster import (
    anonymous_health,
    bookie,
    bookies,
    broker_load,
    brokers,
    bundles,
    cluster_health,
    owned_bundles,
)
from pigeon.broker._admin_subscriptions import (
    MAX_PEEK,
    POSITIONS,
    clear_backlog,
    create_subscription,
    delete_subscription,
    list_subscriptions,
    peek,
    reset_cursor,
    skip,
    subscription_stats,
)
from pigeon.broker._admin_topics import (
    compact_topic,
    compaction_status,
    create_namespace,
    create_tenant,
    create_topic,
    delete_namespace,
    delete_tenant,
    internal_stats,
    list_namespaces,
    list_topics,
    loaded_topics_stats,
    offload_status,
    offload_topic,
    parse_message_id,
    tenant_info,
    topic_metadata,
    topic_name,
    topic_stats,
    update_tenant,
)
from pigeon.broker._lifecycle import (
    FULL_BUNDLE,
    broker_id,
    delete_topic,
    unload_bundle,
    unload_topic,
)

__all__ = [
    "compact_topic",
    "compaction_status",
    "FULL_BUNDLE",
    "MAX_PEEK",
    "POSITIONS",
    "anonymous_health",
    "bookie",
    "bookies",
    "broker_id",
    "broker_load",
    "brokers",
    "bundles",
    "clear_backlog",
    "cluster_health",
    "create_namespace",
    "create_subscription",
    "create_tenant",
    "create_topic",
    "delete_namespace",
    "delete_subscription",
    "delete_tenant",
    "delete_topic",
    "internal_stats",
    "list_namespaces",
    "list_subscriptions",
    "list_topics",
    "loaded_topics_stats",
    "offload_status",
    "offload_topic",
    "owned_bundles",
    "parse_message_id",
    "peek",
    "reset_cursor",
    "skip",
    "subscription_stats",
    "tenant_info",
    "topic_metadata",
    "topic_name",
    "topic_stats",
    "unload_bundle",
    "unload_topic",
    "update_tenant",
]

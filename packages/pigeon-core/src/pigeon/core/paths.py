"""Where PigeonMQ keeps its cluster state in the metadata store: every path, in one place.

Bookies, brokers and tools read and write the same nodes, so the paths are spelled here
once.  Values are JSON documents unless said otherwise::

    /pigeon
      ledgers/<domain>/<tenant>/<namespace>/<topic>   a topic partition's managed ledger:
                                                      its segments in order (CAS-updated)
      segments/<id as 16 hex digits>                  one per segment that may hold data;
                                                      bookies delete files whose node is gone
      segment-ids/s-<n>                               sequential nodes handing out segment ids
      cursors/<domain>/<tenant>/<namespace>/<topic>/<subscription>
                                                      a durable subscription's cursor
      dedup/<domain>/<tenant>/<namespace>/<topic>     de-duplication snapshot of a topic
      producer-epochs/<domain>/<tenant>/<namespace>/<topic>
                                                      ``{"epoch": n}``: exclusive producers
      partitioned-topics/<domain>/<tenant>/<namespace>/<topic>
                                                      ``{"partitions": n}``
      schemas/<tenant>/<namespace>/<topic>            a topic's schema versions (CAS-updated;
                                                      partitioned topics by their base name)
      tenants/<tenant>                                tenant info
      namespaces/<tenant>/<namespace>                 namespace policies
      ownership/<tenant>/<namespace>/<bundle>         ephemeral: the broker owning a bundle
      brokers/available/<host:port>                   ephemeral: a live broker, its load report
      brokers/sessions/<token>                        ephemeral: one per broker session
      bookies/available/<host:port>                   ephemeral: a live bookie, its state
      unload-requests/<broker host:port>/r-<n>        a bundle the load manager asks to move
      auditor, load-manager                           leader elections (one auditor, one
                                                      load manager per cluster)

``<domain>/<tenant>/<namespace>/<topic>`` is :attr:`pigeon.core.TopicName.path`.
"""

from __future__ import annotations

from pigeon.core._topic import TopicName

__all__ = [
    "AUDITOR_PATH",
    "BOOKIES_PATH",
    "BROKERS_PATH",
    "BROKER_SESSIONS_PATH",
    "CURSORS_PATH",
    "DEDUP_PATH",
    "LEDGERS_PATH",
    "LOAD_MANAGER_PATH",
    "NAMESPACES_PATH",
    "OFFLOAD_SWEEPER_PATH",
    "OWNERSHIP_PATH",
    "PARTITIONED_TOPICS_PATH",
    "PRODUCER_EPOCHS_PATH",
    "ROOT",
    "SEGMENTS_PATH",
    "SCHEMAS_PATH",
    "SEGMENT_ID_PREFIX",
    "TENANTS_PATH",
    "UNLOAD_REQUESTS_PATH",
    "cursor_path",
    "cursors_path",
    "dedup_path",
    "ledger_path",
    "partitioned_topic_path",
    "producer_epoch_path",
    "schema_path",
    "segment_path",
]

#: the root of everything PigeonMQ stores (a ZooKeeper chroot or etcd prefix comes above it)
ROOT = "/pigeon"

LEDGERS_PATH = f"{ROOT}/ledgers"
SEGMENTS_PATH = f"{ROOT}/segments"
#: prefix of the sequential nodes that hand out segment ids
SEGMENT_ID_PREFIX = f"{ROOT}/segment-ids/s-"
CURSORS_PATH = f"{ROOT}/cursors"
DEDUP_PATH = f"{ROOT}/dedup"
PRODUCER_EPOCHS_PATH = f"{ROOT}/producer-epochs"
PARTITIONED_TOPICS_PATH = f"{ROOT}/partitioned-topics"
TENANTS_PATH = f"{ROOT}/tenants"
SCHEMAS_PATH = f"{ROOT}/schemas"
NAMESPACES_PATH = f"{ROOT}/namespaces"
OWNERSHIP_PATH = f"{ROOT}/ownership"
BROKERS_PATH = f"{ROOT}/brokers/available"
BROKER_SESSIONS_PATH = f"{ROOT}/brokers/sessions"
BOOKIES_PATH = f"{ROOT}/bookies/available"
UNLOAD_REQUESTS_PATH = f"{ROOT}/unload-requests"
AUDITOR_PATH = f"{ROOT}/auditor"
LOAD_MANAGER_PATH = f"{ROOT}/load-manager"
#: the election of the broker that sweeps orphaned offloaded objects
OFFLOAD_SWEEPER_PATH = f"{ROOT}/offload-sweeper"


def ledger_path(topic: TopicName) -> str:
    """The managed ledger of a topic partition."""
    return f"{LEDGERS_PATH}/{topic.path}"


def cursors_path(topic: TopicName) -> str:
    """The parent of a topic's subscription cursors."""
    return f"{CURSORS_PATH}/{topic.path}"


def cursor_path(topic: TopicName, subscription: str) -> str:
    """The cursor of one durable subscription."""
    return f"{CURSORS_PATH}/{topic.path}/{subscription}"


def dedup_path(topic: TopicName) -> str:
    """The de-duplication snapshot of a topic partition."""
    return f"{DEDUP_PATH}/{topic.path}"


def producer_epoch_path(topic: TopicName) -> str:
    """The producer epoch of a topic partition (exclusive access modes): ``{"epoch": n}``."""
    return f"{PRODUCER_EPOCHS_PATH}/{topic.path}"


def partitioned_topic_path(topic: TopicName) -> str:
    """The partition count of a partitioned topic."""
    return f"{PARTITIONED_TOPICS_PATH}/{topic.path}"


def segment_path(segment_id: int) -> str:
    """The node of a segment: ``/pigeon/segments/000000000000002a``."""
    return f"{SEGMENTS_PATH}/{segment_id:016x}"


def schema_path(topic: TopicName) -> str:
    """The schema versions of a topic: one node per topic as Pulsar keys schemas (no
    domain; a partition shares its partitioned topic's)."""
    base = topic.base
    return f"{SCHEMAS_PATH}/{base.tenant}/{base.namespace}/{base.local}"

"""Topic-level configs of partitioned topics (Kafka's topic configs), in the metadata store.

They live in the partitioned topic's node, next to its partition count, so they are
created with the topic in one write and deleted with it::

    /pigeon/partitioned-topics/<domain>/<tenant>/<namespace>/<topic>
        {"partitions": 3, "config": {"cleanup.policy": "compact"}}

Only configs that were set are stored (by their Kafka names, values as Kafka spells
them); an absent ``config`` is every default.  What they mean:

* ``cleanup.policy`` -- ``delete`` (default), ``compact`` or ``compact,delete``.  With
  ``compact`` the broker compacts each partition (the compaction job of
  ``_ledger_compaction``), keeps a ``__compaction`` subscription from the first load so
  nothing is trimmed before it is compacted, and Kafka fetches below the compaction
  horizon read the compacted view.
* ``min.cleanable.dirty.ratio`` -- compact when the bytes stored since the last
  compaction are at least this share of those bytes plus the compacted ledger's
  (0.5 by default; 0: at every maintenance pass that finds anything new).

Parsing and checking (:func:`check_config`, :func:`apply_changes`) do no I/O;
:class:`TopicConfigs` reads and writes the node (compare-and-set) and keeps what it
read for :data:`TOPIC_CONFIG_TTL_S`, so the maintenance pass and Kafka fetches cost no
metadata read, and a change made through another broker applies within that time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, Final

import trio

from pigeon.core import TopicName
from pigeon.core.errors import BadVersion, InvalidArgument, NoSuchNode, TopicNotFound
from pigeon.core.paths import partitioned_topic_path

__all__ = [
    "ACCEPTED_CONFIGS",
    "APPEND",
    "CLEANUP_POLICY",
    "DELETE",
    "DIRTY_RATIO",
    "SET",
    "STORED_CONFIGS",
    "SUBTRACT",
    "TOPIC_CONFIG_TTL_S",
    "TopicConfigs",
    "apply_changes",
    "check_config",
    "dirty_ratio",
    "is_compacted",
]

CLEANUP_POLICY: Final = "cleanup.policy"
DIRTY_RATIO: Final = "min.cleanable.dirty.ratio"

#: configs kept per topic and honoured: name -> default
STORED_CONFIGS: Final[dict[str, str]] = {CLEANUP_POLICY: "delete", DIRTY_RATIO: "0.5"}

#: Kafka topic configs a client may send (Kafka Streams and others do) that have no
#: per-topic meaning here: accepted and not stored.  Name -> the value DescribeConfigs
#: gives when nothing else decides it (None: described elsewhere, or not at all).
ACCEPTED_CONFIGS: Final[dict[str, str | None]] = {
    # tombstones are dropped by the compaction that reaches them
    "delete.retention.ms": "0",
    "min.compaction.lag.ms": "0",
    "max.compaction.lag.ms": "9223372036854775807",
    # there are no Kafka segments: a topic's log is compacted up to its end
    "segment.ms": None,
    "segment.bytes": None,
    "segment.jitter.ms": None,
    "segment.index.bytes": None,
    "index.interval.bytes": None,
    "file.delete.delay.ms": None,
    "flush.ms": None,
    "flush.messages": None,
    "preallocate": None,
    # the namespace's policies decide these (DescribeConfigs shows them)
    "retention.ms": None,
    "retention.bytes": None,
    "local.retention.ms": None,
    "local.retention.bytes": None,
    "remote.storage.enable": None,
    "max.message.bytes": None,
    "compression.type": None,
    "message.timestamp.type": None,
    "message.timestamp.difference.max.ms": None,
    "message.timestamp.before.max.ms": None,
    "message.timestamp.after.max.ms": None,
    "message.downconversion.enable": None,
    "min.insync.replicas": None,
    "unclean.leader.election.enable": None,
    "leader.replication.throttled.replicas": None,
    "follower.replication.throttled.replicas": None,
}

#: how long a broker keeps a topic's configs before reading them again
TOPIC_CONFIG_TTL_S: Final = 10.0

_POLICIES: Final = frozenset({"delete", "compact"})


def _cleanup_policy(value: str) -> str:
    parts = [p.strip() for p in value.split(",")]
    if not all(p in _POLICIES for p in parts) or len(set(parts)) != len(parts):
        raise InvalidArgument(
            f"cleanup.policy must be delete, compact or compact,delete, got {value!r}"
        )
    return ",".join(sorted(parts))


def _dirty_ratio(value: str) -> str:
    try:
        ratio = float(value)
    except ValueError:
        ratio = math.nan
    if not 0.0 <= ratio <= 1.0:
        raise InvalidArgument(
            f"min.cleanable.dirty.ratio must be a number from 0 to 1, got {value!r}"
        )
    return repr(ratio)


_CHECKS: Final = {CLEANUP_POLICY: _cleanup_policy, DIRTY_RATIO: _dirty_ratio}


def check_config(name: str, value: str | None) -> str | None:
    """``value`` of topic config ``name`` as stored (normalized); None: accepted and not
    stored (:data:`ACCEPTED_CONFIGS`).

    :raises InvalidArgument: an unknown name, a null or bad value (Kafka: INVALID_CONFIG).
    """
    if name in ACCEPTED_CONFIGS:
        return None
    check = _CHECKS.get(name)
    if check is None:
        raise InvalidArgument(f"unknown topic config {name!r}")
    if value is None:
        raise InvalidArgument(f"topic config {name!r} needs a value")
    return check(value)


#: IncrementalAlterConfigs operations (Kafka's AlterConfigOp.OpType)
SET, DELETE, APPEND, SUBTRACT = 0, 1, 2, 3


def apply_changes(
    current: Mapping[str, str], changes: list[tuple[str, int, str | None]]
) -> dict[str, str]:
    """``current`` after IncrementalAlterConfigs ``changes`` (name, operation, value);
    APPEND and SUBTRACT apply to ``cleanup.policy`` (a list) only.

    :raises InvalidArgument: an unknown name or operation, a bad value, a policy left
        empty.
    """
    out = dict(current)
    for name, op, value in changes:
        if op == DELETE:
            check_config(name, STORED_CONFIGS.get(name, "") or None)
            out.pop(name, None)
            continue
        if op in (APPEND, SUBTRACT):
            if name != CLEANUP_POLICY:
                raise InvalidArgument(f"topic config {name!r} is not a list: set it instead")
            if value is None:
                raise InvalidArgument(f"topic config {name!r} needs a value")
            have = out.get(name, STORED_CONFIGS[name]).split(",")
            given = [v.strip() for v in value.split(",") if v.strip()]
            if op == APPEND:
                items = have + [v for v in given if v not in have]
            else:
                items = [v for v in have if v not in given]
            if not items:
                raise InvalidArgument("cleanup.policy cannot be empty")
            value = ",".join(items)
        elif op != SET:
            raise InvalidArgument(f"unknown config operation {op}")
        stored = check_config(name, value)
        if stored is not None:
            out[name] = stored
    return out


def is_compacted(config: Mapping[str, str]) -> bool:
    """Does ``cleanup.policy`` compact the topic?"""
    return "compact" in config.get(CLEANUP_POLICY, "delete").split(",")


def dirty_ratio(config: Mapping[str, str]) -> float:
    return float(config.get(DIRTY_RATIO, STORED_CONFIGS[DIRTY_RATIO]))


def _decode(doc: dict[str, Any]) -> dict[str, str]:
    config = doc.get("config") or {}
    return {str(k): str(v) for k, v in config.items()}


class TopicConfigs:
    """Reads and writes topics' configs; caches them for the hot paths (see module doc)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        #: partitioned topic (full name) -> (when read, its configs)
        self._cache: dict[str, tuple[float, dict[str, str]]] = {}

    async def get(self, name: TopicName) -> dict[str, str]:
        """The configs of ``name`` (a partitioned topic or one of its partitions; a
        plain topic has none), at most :data:`TOPIC_CONFIG_TTL_S` old."""
        if name.partition_index >= 0:
            name = name.base
        now = trio.current_time()
        found = self._cache.get(name.full)
        if found is not None and now - found[0] < TOPIC_CONFIG_TTL_S:
            return found[1]
        stat = await self.store.get(partitioned_topic_path(name))
        config = _decode(json.loads(stat.value)) if stat is not None else {}
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[name.full] = (now, config)
        return config

    async def update(
        self,
        name: TopicName,
        change: Callable[[dict[str, str]], dict[str, str]],
        *,
        validate_only: bool = False,
    ) -> dict[str, str]:
        """Replace the configs of the partitioned topic ``name`` by ``change(current)``
        (compare-and-set: ``change`` may run again on a concurrent edit; it raises to
        refuse); ``validate_only``: nothing written.  Returns the new configs.

        :raises TopicNotFound: it is not a partitioned topic.
        """
        path = partitioned_topic_path(name)
        for _attempt in range(10):
            stat = await self.store.get(path)
            if stat is None:
                raise TopicNotFound(f"topic {name} does not exist")
            doc = json.loads(stat.value)
            config = change(_decode(doc))
            if validate_only:
                return config
            if config:
                doc["config"] = dict(sorted(config.items()))
            else:
                doc.pop("config", None)
            try:
                await self.store.set(path, json.dumps(doc).encode(), version=stat.version)
            except BadVersion:
                continue
            except NoSuchNode:
                raise TopicNotFound(f"topic {name} does not exist") from None
            self._cache[name.full] = (trio.current_time(), config)
            return config
        raise InvalidArgument(f"topic {name} is being changed concurrently; try again")

    def forget(self, name: TopicName) -> None:
        self._cache.pop(name.full, None)

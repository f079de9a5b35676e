"""pigeon-core: what every PigeonMQ node and plugin shares.

Wire schemas and framing, the RPC layer, the columnar batch format, the error tree,
configuration, hook specifications and the plugin manager, and the built-in plugins
(embedded metadata store, quorum replication, ``none``/``gzip`` codecs).

Here: the plugin manager and its :class:`Registry`, :class:`TopicName` and the name
rules (:func:`check_name`, :func:`check_subscription_name`, :data:`MAX_NAME_LENGTH`), the classes
the hook specifications (:mod:`pigeon.core.hookspecs`) ask plugins for —
:class:`MetadataStore`, :class:`ReplicationPolicy` (with its :class:`SegmentWriter`) and
:class:`Codec`.  The rest of the public API is in its modules: :mod:`~pigeon.core.batch`,
:mod:`~pigeon.core.codecs`, :mod:`~pigeon.core.config`, :mod:`~pigeon.core.errors`,
:mod:`~pigeon.core.metadata`, :mod:`~pigeon.core.paths`, :mod:`~pigeon.core.replication`,
:mod:`~pigeon.core.rpc`, :mod:`~pigeon.core.runtime` and :mod:`~pigeon.core.testing`.
Every other module (``_name``) is private.
"""

from __future__ import annotations

from pigeon.core import errors
from pigeon.core._codecs import Codec
from pigeon.core._plugins import PluginManager, Registry
from pigeon.core._policy import ReplicationPolicy, SegmentWriter
from pigeon.core._topic import MAX_NAME_LENGTH, TopicName, check_name, check_subscription_name
from pigeon.core.config import load_config
from pigeon.core.metadata import MetadataStore

__all__ = [
    "MAX_NAME_LENGTH",
    "Codec",
    "MetadataStore",
    "PluginManager",
    "Registry",
    "ReplicationPolicy",
    "SegmentWriter",
    "TopicName",
    "check_name",
    "check_subscription_name",
    "errors",
    "load_config",
]

"""pigeon-core: what every PigeonMQ node and plugin shares.

Wire schemas and framing, the RPC layer, the columnar batch format, the error tree,
configuration, hook specifications and the plugin manager, and the built-in plugins
(embedded metadata store, quorum replication, ``none``/``gzip`` codecs).
"""

from __future__ import annotations

from pigeon.core import errors
from pigeon.core._plugins import PluginManager, Registry
from pigeon.core._topic import TopicName
from pigeon.core.config import load_config

__all__ = [
    "PluginManager",
    "Registry",
    "TopicName",
    "errors",
    "load_config",
]

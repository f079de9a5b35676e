"""Compression codecs: the :class:`Codec` record a plugin registers, the built-in
``none`` and ``gzip``, and :class:`CodecSet`, the lookup by name or wire id a node builds
from what its plugins registered (``CodecSet.from_registry(plugins.codecs)``).

Wire ids 0-3 are reserved (:data:`RESERVED_IDS`); the id table and the contract every
codec keeps are in :mod:`pigeon.core._codecs`, and
:class:`pigeon.core.testing.CodecContract` checks a codec against it.
"""

from __future__ import annotations

from pigeon.core._codecs import GZIP, NONE, RESERVED_IDS, Codec, CodecSet

__all__ = ["GZIP", "NONE", "RESERVED_IDS", "Codec", "CodecSet"]

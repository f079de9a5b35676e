"""Compression codecs: the :class:`Codec` record a plugin registers, the built-in
``none`` and ``gzip``, and :class:`CodecSet`, the lookup by name or wire id a node builds
from what its plugins registered (``CodecSet.from_registry(plugins.codecs)``).

Wire ids 0-3 are reserved (:data:`RESERVED_IDS`); the id table and the contract every
codec keeps are in :mod:`pigeon.core._codecs`, and
:class:`pigeon.core.testing.CodecContract` checks a codec against it.  A codec plugin
builds its ``decompress`` with :func:`checked_decompress`, which keeps the library's
errors and a wrong output size inside that contract.
"""

from __future__ import annotations

from pigeon.core._codecs import GZIP, NONE, RESERVED_IDS, Codec, CodecSet, checked_decompress

__all__ = ["GZIP", "NONE", "RESERVED_IDS", "Codec", "CodecSet", "checked_decompress"]

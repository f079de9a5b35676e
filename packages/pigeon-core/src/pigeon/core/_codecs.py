"""Compression codecs: the :class:`Codec` record, the built-in ``none`` and ``gzip``, and
:class:`CodecSet`, the lookup a node builds from what its plugins registered.

A codec compresses the body of a batch as a whole (see :mod:`pigeon.core._batch`). Its
numeric ``id`` is what travels in the batch header, so ids are part of the wire format:

====  ======  =====================================================================
id    name    format
====  ======  =====================================================================
0     none    the body as is
1     gzip    RFC 1952 gzip member (zlib, level 1), like Kafka's ``gzip`` (id 1)
2     lz4     LZ4 frame format with content checksum (plugin ``pigeon-lz4``)
3     zstd    Zstandard frame with checksum (plugin ``pigeon-zstd``)
====  ======  =====================================================================

Ids 0-3 are reserved for these names; ids 4-127 are free for other plugins, 128-255 are
meant for private (site-specific) codecs.

The contract every codec keeps (checked by :class:`pigeon.core.testing.CodecContract`):

* ``compress(data)`` accepts ``bytes`` or a byte ``memoryview`` and returns ``bytes``;
* ``decompress(data, uncompressed_size)`` returns exactly ``uncompressed_size`` bytes or
  raises :class:`~pigeon.core.errors.CodecError`; it never allocates much more than
  ``uncompressed_size`` and never raises another exception type on bad input.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pigeon.core.errors import CodecError, InvalidArgument, PluginError, UnknownCodec

__all__ = [
    "GZIP",
    "GZIP_LEVEL",
    "NONE",
    "RESERVED_IDS",
    "Codec",
    "CodecSet",
    "checked_decompress",
]

#: Wire ids reserved for the codecs PigeonMQ knows by name.
RESERVED_IDS: dict[str, int] = {"none": 0, "gzip": 1, "lz4": 2, "zstd": 3}

#: zlib level used by the ``gzip`` codec: 1 (fastest). On typical text-like payloads it
#: compresses within a few percent of the default level 6 at several times the speed;
#: a producer that wants a better ratio should pick ``zstd``.
GZIP_LEVEL = 1

_GZIP_WBITS = 31  # 16 + 15: gzip header and trailer (CRC-32 + size), 32 KiB window


@dataclass(frozen=True)
class Codec:
    """A compression codec as registered through the ``pigeon_codecs`` hook.

    :param name: registry name, lowercase (``"none"``, ``"gzip"``, ``"lz4"``, ``"zstd"``).
    :param id: wire id carried in the batch header, 0-255 (see the module docstring).
    :param compress: ``compress(data) -> bytes``.
    :param decompress: ``decompress(data, uncompressed_size) -> bytes``; returns exactly
        ``uncompressed_size`` bytes or raises :class:`~pigeon.core.errors.CodecError`.
    """

    name: str
    id: int
    compress: Callable[[bytes | memoryview], bytes]
    decompress: Callable[[bytes | memoryview, int], bytes]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.lower():
            raise InvalidArgument(f"codec name must be a lowercase str, got {self.name!r}")
        if not isinstance(self.id, int) or not 0 <= self.id <= 255:
            raise InvalidArgument(f"codec {self.name!r}: id must be in 0..255, got {self.id!r}")
        reserved = RESERVED_IDS.get(self.name)
        if reserved is not None and reserved != self.id:
            raise InvalidArgument(
                f"codec {self.name!r} must use its reserved wire id {reserved}, not {self.id}"
            )
        for owner, rid in RESERVED_IDS.items():
            if rid == self.id and owner != self.name:
                raise InvalidArgument(
                    f"codec {self.name!r}: wire id {self.id} is reserved for {owner!r}"
                )

    def __repr__(self) -> str:
        return f"Codec(name={self.name!r}, id={self.id})"


def checked_decompress(
    name: str,
    inflate: Callable[[bytes | memoryview, int], bytes],
    errors: tuple[type[Exception], ...],
) -> Callable[[bytes | memoryview, int], bytes]:
    """The ``decompress`` of codec ``name`` around ``inflate(data, uncompressed_size)``,
    kept to the contract: an exception of ``errors`` (what the compression library raises
    on bad input) becomes ``CodecError("<name>: corrupt data (...)")``, and a result that
    is not exactly ``uncompressed_size`` bytes is a :class:`~pigeon.core.errors.CodecError`
    too.  ``inflate`` may raise CodecError itself (a frame that declares another size)."""

    def decompress(data: bytes | memoryview, uncompressed_size: int) -> bytes:
        try:
            out = inflate(data, uncompressed_size)
        except errors as exc:
            raise CodecError(f"{name}: corrupt data ({exc})") from None
        if not isinstance(out, bytes) or len(out) != uncompressed_size:
            raise CodecError(f"{name}: decompressed {len(out)} bytes, expected {uncompressed_size}")
        return out

    return decompress


# -- none --------------------------------------------------------------------------------


def _none_compress(data: bytes | memoryview) -> bytes:
    return bytes(data)  # no copy when ``data`` is already bytes


def _none_decompress(data: bytes | memoryview, uncompressed_size: int) -> bytes:
    if len(data) != uncompressed_size:
        raise CodecError(f"none: body is {len(data)} bytes, expected {uncompressed_size}")
    return bytes(data)


NONE = Codec("none", 0, _none_compress, _none_decompress)


# -- gzip --------------------------------------------------------------------------------


def _gzip_compress(data: bytes | memoryview) -> bytes:
    # mtime 0, no file name: the output depends on the data only.
    return zlib.compress(data, GZIP_LEVEL, wbits=_GZIP_WBITS)


def _gzip_inflate(data: bytes | memoryview, uncompressed_size: int) -> bytes:
    d = zlib.decompressobj(wbits=_GZIP_WBITS)
    # One byte more than expected: a longer stream shows up as a size mismatch instead of
    # an unbounded allocation.
    out = d.decompress(data, uncompressed_size + 1)
    if not d.eof:
        raise CodecError("gzip: truncated data or longer than the declared size")
    if d.unused_data:
        raise CodecError(f"gzip: {len(d.unused_data)} bytes of trailing data")
    return out


GZIP = Codec("gzip", 1, _gzip_compress, checked_decompress("gzip", _gzip_inflate, (zlib.error,)))


# -- lookup ------------------------------------------------------------------------------


class CodecSet:
    """The codecs a node can use, looked up by name (producers) or wire id (readers).

    Build it from a plugin manager with :meth:`from_registry` (``pm.codecs``) or from any
    iterable of :class:`Codec`. Two codecs with the same name or the same id are a
    :class:`~pigeon.core.errors.PluginError`.
    """

    __slots__ = ("_by_id", "_by_name")

    def __init__(self, codecs: Iterable[Codec]) -> None:
        self._by_name: dict[str, Codec] = {}
        self._by_id: dict[int, Codec] = {}
        for codec in codecs:
            if not isinstance(codec, Codec):
                raise PluginError(f"not a Codec: {codec!r}")
            other = self._by_name.get(codec.name) or self._by_id.get(codec.id)
            if other is not None:
                raise PluginError(f"codecs {other!r} and {codec!r} clash (same name or wire id)")
            self._by_name[codec.name] = codec
            self._by_id[codec.id] = codec

    @classmethod
    def from_registry(cls, registry: Any) -> CodecSet:
        """Build from a :class:`pigeon.core._plugins.Registry` (e.g. ``pm.codecs``)."""
        return cls(codec for _, codec in registry.items())

    def _known(self) -> str:
        return ", ".join(f"{c.name} ({c.id})" for c in self) or "none"

    def by_name(self, name: str) -> Codec:
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise UnknownCodec(
                f"codec {name!r} is not registered (registered: {self._known()}); "
                "install its plugin (e.g. pigeon-zstd, pigeon-lz4)"
            ) from None

    def by_id(self, id: int) -> Codec:
        try:
            return self._by_id[id]
        except (KeyError, TypeError):
            hint = next((n for n, i in RESERVED_IDS.items() if i == id), None)
            named = f" ({hint!r})" if hint else ""
            raise UnknownCodec(
                f"codec id {id}{named} is not registered (registered: {self._known()})"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Codec]:
        return iter(sorted(self._by_id.values(), key=lambda c: c.id))

    def __len__(self) -> int:
        return len(self._by_id)

    def __repr__(self) -> str:
        return f"CodecSet([{self._known()}])"

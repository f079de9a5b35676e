"""Codec contract suite: what every compression codec must do, run by each backend.

Subclass :class:`CodecContract` in a test module and provide a ``codec`` fixture::

    import pytest
    from pigeon.core.testing import CodecContract
    from pigeon_zstd import ZSTD

    class TestZstd(CodecContract):
        @pytest.fixture
        def codec(self):
            return ZSTD

The suite checks round trips (empty, small, 1 MiB random and compressible data,
``memoryview`` input), that ``decompress`` returns exactly ``uncompressed_size`` bytes or
raises :class:`~pigeon.core.errors.CodecError`, that corrupt input raises
:class:`~pigeon.core.errors.CodecError` and nothing else, name/id sanity, and that the
codec is registered by a real :class:`~pigeon.core._plugins.PluginManager`.

Corrupt input must raise ``CodecError`` or decode to the original data (a flipped bit in
a field the format ignores, such as gzip's mtime, is harmless); it must never decode to
other bytes. A codec without an integrity check (``none``) cannot keep that promise; such
a subclass sets ``detects_corruption = False`` and the suite then only requires a
``CodecError`` or exactly ``uncompressed_size`` bytes.
"""

from __future__ import annotations

import random
from typing import ClassVar

import pytest

from pigeon.core._codecs import RESERVED_IDS, Codec, CodecSet
from pigeon.core._plugins import PluginManager
from pigeon.core.errors import CodecError

__all__ = ["CodecContract"]

MiB = 1024 * 1024


def _compressible(size: int, seed: int = 7) -> bytes:
    """Text-like data: words from a small vocabulary (compresses ~3-5x)."""
    rnd = random.Random(seed)
    words = [rnd.randbytes(rnd.randint(2, 9)).hex().encode() for _ in range(300)]
    out = bytearray()
    while len(out) < size:
        out += b" ".join(rnd.choices(words, k=64)) + b"\n"
    return bytes(out[:size])


_PAYLOADS = {
    "empty": b"",
    "one-byte": b"x",
    "small": b"hello, pigeon",
    "zeros-64k": bytes(64 * 1024),
    "compressible-1MiB": _compressible(MiB),
    "random-1MiB": random.Random(1).randbytes(MiB),
    "mixed-100k": _compressible(50_000) + random.Random(2).randbytes(50_000),
}

#: Seeds of the randomised tests (seeded, so a failure names its seed and replays; the
#: suite needs no hypothesis so that plugin authors only need pytest).
_SEEDS = range(64)


class CodecContract:
    """Contract tests for a :class:`~pigeon.core._codecs.Codec`; see the module docstring."""

    #: False for codecs without an integrity check (``none``): a flipped byte may then
    #: decode to other bytes of the right length instead of raising CodecError, and
    #: random garbage need not be rejected.
    detects_corruption: ClassVar[bool] = True

    @pytest.fixture
    def codec(self) -> Codec:
        raise NotImplementedError("a CodecContract subclass must provide a `codec` fixture")

    @pytest.fixture
    def codec_plugin_manager(self) -> PluginManager:
        """The plugin manager the registration test inspects (entry points loaded)."""
        return PluginManager()

    # -- identity ------------------------------------------------------------------------

    def test_is_codec_with_sane_name_and_id(self, codec: Codec) -> None:
        assert isinstance(codec, Codec)
        assert codec.name and codec.name == codec.name.lower() and codec.name.isprintable()
        assert 0 <= codec.id <= 255
        if codec.name in RESERVED_IDS:
            assert codec.id == RESERVED_IDS[codec.name]
        else:
            assert codec.id not in RESERVED_IDS.values()
        assert callable(codec.compress) and callable(codec.decompress)

    def test_registered_through_plugin_manager(
        self, codec: Codec, codec_plugin_manager: PluginManager
    ) -> None:
        pm = codec_plugin_manager
        assert codec.name in pm.codecs
        assert pm.codecs.get(codec.name) == codec
        # All registered codecs coexist: names and wire ids are unique.
        codecs = CodecSet.from_registry(pm.codecs)
        assert codecs.by_id(codec.id) == codec
        assert codecs.by_name(codec.name) == codec

    # -- round trips ---------------------------------------------------------------------

    @pytest.mark.parametrize("name", sorted(_PAYLOADS))
    def test_round_trip(self, codec: Codec, name: str) -> None:
        data = _PAYLOADS[name]
        packed = codec.compress(data)
        assert isinstance(packed, bytes)
        out = codec.decompress(packed, len(data))
        assert isinstance(out, bytes)
        assert out == data

    def test_compresses_compressible_data(self, codec: Codec) -> None:
        data = _PAYLOADS["compressible-1MiB"]
        packed = codec.compress(data)
        if codec.id == RESERVED_IDS["none"]:
            assert packed == data
        else:
            assert len(packed) < len(data) * 0.8

    def test_memoryview_input(self, codec: Codec) -> None:
        data = _PAYLOADS["mixed-100k"]
        # A view into the middle of a larger buffer, as a receive buffer would give.
        buf = bytearray(b"\xaa" * 13 + data + b"\x55" * 7)
        view = memoryview(buf)[13 : 13 + len(data)]
        packed = codec.compress(view)
        assert isinstance(packed, bytes)
        assert codec.decompress(packed, len(data)) == data
        wrapped = memoryview(b"\x00" * 5 + packed)[5:]
        out = codec.decompress(wrapped, len(data))
        assert isinstance(out, bytes)
        assert out == data

    def test_round_trip_random(self, codec: Codec) -> None:
        for seed in _SEEDS:
            rnd = random.Random(seed)
            size = rnd.choice([0, 1, 2, 7, 100, 4096, rnd.randrange(70_000)])
            data = rnd.randbytes(size) if seed % 2 else _compressible(size, seed)
            assert codec.decompress(codec.compress(data), size) == data, f"seed {seed}"

    # -- sizes ---------------------------------------------------------------------------

    @pytest.mark.parametrize("name", ["small", "compressible-1MiB", "random-1MiB"])
    @pytest.mark.parametrize("delta", [-1, 1, 1000])
    def test_wrong_uncompressed_size_is_codec_error(
        self, codec: Codec, name: str, delta: int
    ) -> None:
        data = _PAYLOADS[name]
        packed = codec.compress(data)
        with pytest.raises(CodecError):
            codec.decompress(packed, len(data) + delta)

    def test_empty_data_with_nonzero_size_is_codec_error(self, codec: Codec) -> None:
        packed = codec.compress(b"")
        with pytest.raises(CodecError):
            codec.decompress(packed, 10)

    def test_declared_size_bounds_output(self, codec: Codec) -> None:
        """A body that inflates past the declared size is refused, not returned."""
        packed = codec.compress(bytes(MiB))
        with pytest.raises(CodecError):
            codec.decompress(packed, 100)

    # -- corruption ----------------------------------------------------------------------

    @pytest.mark.parametrize("name", ["small", "compressible-1MiB", "random-1MiB"])
    def test_truncated_is_codec_error(self, codec: Codec, name: str) -> None:
        data = _PAYLOADS[name]
        packed = codec.compress(data)
        for cut in sorted({0, 1, len(packed) // 2, len(packed) - 1}):
            if cut >= len(packed):
                continue
            with pytest.raises(CodecError):
                codec.decompress(packed[:cut], len(data))

    @pytest.mark.parametrize("name", ["small", "mixed-100k", "zeros-64k"])
    def test_flipped_byte(self, codec: Codec, name: str) -> None:
        data = _PAYLOADS[name]
        packed = codec.compress(data)
        if not packed:
            return
        for seed in _SEEDS:
            rnd = random.Random(seed)
            corrupt = bytearray(packed)
            # The first and last bytes (headers, checksums) and random places in between.
            where = [0, len(corrupt) - 1, len(corrupt) // 2][seed] if seed < 3 else None
            corrupt[rnd.randrange(len(corrupt)) if where is None else where] ^= rnd.randint(1, 255)
            try:
                out = codec.decompress(bytes(corrupt), len(data))
            except CodecError:
                continue
            assert isinstance(out, bytes) and len(out) == len(data), f"seed {seed}"
            if self.detects_corruption:
                # Only bytes the format ignores may change unnoticed (e.g. gzip's mtime).
                assert out == data, f"seed {seed}: corruption decoded to wrong data"

    def test_garbage_is_codec_error_or_exact_size(self, codec: Codec) -> None:
        for seed in _SEEDS:
            rnd = random.Random(seed)
            garbage = rnd.randbytes(rnd.choice([0, 1, 4, 16, rnd.randrange(2048)]))
            size = rnd.choice([0, 1, len(garbage), rnd.randrange(1 << 20)])
            try:
                out = codec.decompress(garbage, size)
            except CodecError:
                continue
            assert isinstance(out, bytes) and len(out) == size, f"seed {seed}"

    def test_random_garbage_is_rejected(self, codec: Codec) -> None:
        if not self.detects_corruption:
            pytest.skip("codec has no integrity check")
        for seed in range(20):
            garbage = random.Random(seed).randbytes(1 + seed * 97)
            with pytest.raises(CodecError):
                codec.decompress(garbage, 4096)

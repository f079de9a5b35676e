"""The built-in codecs (through the contract suite) and CodecSet lookups."""

from __future__ import annotations

import zlib
from typing import ClassVar

import pytest

from pigeon.core._codecs import (
    GZIP,
    GZIP_LEVEL,
    NONE,
    RESERVED_IDS,
    Codec,
    CodecSet,
    checked_decompress,
)
from pigeon.core._plugins import PluginManager
from pigeon.core.errors import CodecError, InvalidArgument, PluginError, UnknownCodec
from pigeon.core.testing import CodecContract


class TestNoneCodec(CodecContract):
    detects_corruption: ClassVar[bool] = False

    @pytest.fixture
    def codec(self) -> Codec:
        return NONE


class TestGzipCodec(CodecContract):
    @pytest.fixture
    def codec(self) -> Codec:
        return GZIP


def test_wire_ids_are_the_reserved_ones() -> None:
    assert (NONE.name, NONE.id) == ("none", 0)
    assert (GZIP.name, GZIP.id) == ("gzip", 1)
    assert RESERVED_IDS == {"none": 0, "gzip": 1, "lz4": 2, "zstd": 3}


def test_gzip_is_real_gzip() -> None:
    """Named gzip, so it is RFC 1952 (what Kafka's gzip id 1 carries), not a raw zlib stream."""
    data = b"pigeon " * 1000
    packed = GZIP.compress(data)
    assert packed[:2] == b"\x1f\x8b"
    import gzip

    assert gzip.decompress(packed) == data
    assert GZIP.decompress(gzip.compress(data, compresslevel=9), len(data)) == data
    assert GZIP_LEVEL == 1
    assert packed == zlib.compress(data, 1, wbits=31)


def test_gzip_refuses_trailing_data() -> None:
    packed = GZIP.compress(b"abc")
    with pytest.raises(CodecError, match="trailing"):
        GZIP.decompress(packed + b"junk", 3)


def test_checked_decompress_keeps_a_library_to_the_contract() -> None:
    def inflate(data: bytes | memoryview, size: int) -> bytes:
        if data == b"lib":
            raise ValueError("bad magic")
        if data == b"own":
            raise CodecError("odd: frame declares 7 bytes")
        return bytes(data)

    decompress = checked_decompress("odd", inflate, (ValueError,))
    assert decompress(b"abc", 3) == b"abc"
    with pytest.raises(CodecError, match=r"odd: corrupt data \(bad magic\)"):
        decompress(b"lib", 3)
    with pytest.raises(CodecError, match="frame declares 7 bytes"):
        decompress(b"own", 3)
    with pytest.raises(CodecError, match="odd: decompressed 3 bytes, expected 4"):
        decompress(b"abc", 4)
    with pytest.raises(TypeError):  # not a library error: a bug, not bad input
        checked_decompress("odd", inflate, (ValueError,))(None, 0)  # type: ignore[arg-type]


def test_none_compress_does_not_copy_bytes() -> None:
    data = b"x" * 100
    assert NONE.compress(data) is data


def test_codec_validates_name_and_id() -> None:
    def fn(data: bytes | memoryview, size: int = 0) -> bytes:
        return bytes(data)

    with pytest.raises(InvalidArgument, match="lowercase"):
        Codec("Snappy", 9, fn, fn)
    with pytest.raises(InvalidArgument, match=r"0\.\.255"):
        Codec("big", 256, fn, fn)
    with pytest.raises(InvalidArgument, match="reserved wire id 3"):
        Codec("zstd", 9, fn, fn)
    with pytest.raises(InvalidArgument, match="reserved for 'lz4'"):
        Codec("snappy", 2, fn, fn)
    assert Codec("snappy", 4, fn, fn).id == 4


class TestCodecSet:
    def test_lookups(self) -> None:
        codecs = CodecSet([GZIP, NONE])
        assert codecs.by_name("gzip") is GZIP
        assert codecs.by_id(0) is NONE
        assert list(codecs) == [NONE, GZIP]
        assert "gzip" in codecs and "zstd" not in codecs
        assert len(codecs) == 2
        assert codecs.names() == ["gzip", "none"]

    def test_unknown_name_names_it_and_the_registered_ones(self) -> None:
        codecs = CodecSet([NONE, GZIP])
        with pytest.raises(UnknownCodec) as exc_info:
            codecs.by_name("zstd")
        message = str(exc_info.value)
        assert "'zstd'" in message and "none (0)" in message and "gzip (1)" in message

    def test_unknown_id_names_the_reserved_codec(self) -> None:
        codecs = CodecSet([NONE])
        with pytest.raises(UnknownCodec, match=r"codec id 3 \('zstd'\).*none \(0\)"):
            codecs.by_id(3)
        with pytest.raises(UnknownCodec, match="codec id 77 is not registered"):
            codecs.by_id(77)

    def test_unknown_codec_is_a_codec_error(self) -> None:
        with pytest.raises(CodecError):
            CodecSet([]).by_id(0)

    def test_clashing_ids_are_refused(self) -> None:
        other = Codec("other", 1 + 200, GZIP.compress, GZIP.decompress)
        CodecSet([GZIP, other])
        clash = Codec("other", 0 + 201, GZIP.compress, GZIP.decompress)
        with pytest.raises(PluginError, match="clash"):
            CodecSet([other, clash])
        with pytest.raises(PluginError, match="not a Codec"):
            CodecSet([object()])  # type: ignore[list-item]

    def test_from_plugin_manager(self) -> None:
        codecs = CodecSet.from_registry(PluginManager(load_entry_points=False).codecs)
        assert codecs.names() == ["gzip", "none"]

"""pigeon-lz4 against the codec contract, plus lz4 specifics."""

from __future__ import annotations

import lz4.frame
import pytest

from pigeon.core._codecs import Codec
from pigeon.core.errors import CodecError
from pigeon.core.testing import CodecContract
from pigeon_lz4 import LZ4


class TestLz4Codec(CodecContract):
    @pytest.fixture
    def codec(self) -> Codec:
        return LZ4


def test_frame_has_checksum_and_content_size() -> None:
    info = lz4.frame.get_frame_info(LZ4.compress(b"a" * 1000))
    assert info["content_checksum"]
    assert info["content_size"] == 1000


def test_frame_without_content_size_is_refused() -> None:
    data = b"hello lz4 " * 100
    packed = lz4.frame.compress(data, store_size=False)
    with pytest.raises(CodecError, match="content size"):
        LZ4.decompress(packed, len(data))


def test_standard_lz4_frames_are_read() -> None:
    data = b"hello lz4 " * 100
    packed = lz4.frame.compress(data, compression_level=9, store_size=True)
    assert LZ4.decompress(packed, len(data)) == data

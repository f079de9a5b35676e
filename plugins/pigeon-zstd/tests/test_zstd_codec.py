"""pigeon-zstd against the codec contract, plus zstd specifics."""

from __future__ import annotations

import threading

import pytest
import zstandard

from pigeon.core._codecs import Codec
from pigeon.core.errors import CodecError
from pigeon.core.testing import CodecContract
from pigeon_zstd import LEVEL, ZSTD


class TestZstdCodec(CodecContract):
    @pytest.fixture
    def codec(self) -> Codec:
        return ZSTD


def test_frame_has_checksum_and_content_size() -> None:
    packed = ZSTD.compress(b"a" * 1000)
    params = zstandard.get_frame_parameters(packed)
    assert params.has_checksum
    assert params.content_size == 1000
    assert LEVEL == 3


def test_frame_without_content_size_is_read_up_to_the_declared_size() -> None:
    data = b"hello zstd " * 100
    packed = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    assert ZSTD.decompress(packed, len(data)) == data
    with pytest.raises(CodecError):
        ZSTD.decompress(packed, len(data) - 1)


def test_threads_do_not_share_a_context() -> None:
    data = [bytes([i]) * 50_000 + bytes(range(256)) * i for i in range(8)]
    errors: list[BaseException] = []

    def work(chunk: bytes) -> None:
        try:
            for _ in range(50):
                assert ZSTD.decompress(ZSTD.compress(chunk), len(chunk)) == chunk
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(d,)) for d in data]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

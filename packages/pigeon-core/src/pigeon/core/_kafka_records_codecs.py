"""Compression of the records section of a Kafka RecordBatch v2, as Kafka clients write
it (codec ids of the batch's ``attributes``). No I/O.

====  ======  ===========================================================================
id    name    format
====  ======  ===========================================================================
0     none    the records as they are
1     gzip    RFC 1952 gzip member (stdlib zlib)
2     snappy  Java clients: xerial framing (``\\x82SNAPPY\\x00``, version and compat
              int32, then big-endian int32 length + raw snappy block, 32 KiB of input per
              block); librdkafka: one raw snappy block. Both are read.
3     lz4     LZ4 frame format
4     zstd    Zstandard frame
====  ======  ===========================================================================

Decompression is bounded: never more than ``limit`` bytes come out or are allocated
(snappy blocks declare their size; gzip is inflated with a maximum length; LZ4 and zstd
frames need not declare theirs, so they are inflated into a buffer that grows up to
``limit``). Bad data is a :class:`~pigeon.core.errors.CorruptRecordBatch`, more than
``limit`` bytes a :class:`~pigeon.core.errors.MessageTooLarge`.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import Final

import cramjam

from pigeon.core.errors import CorruptRecordBatch, MessageTooLarge, UnsupportedRecordFormat

__all__ = ["compress_records", "decompress_records"]

_CODEC_NAMES: Final = ("none", "gzip", "snappy", "lz4", "zstd")
_XERIAL_MAGIC: Final = b"\x82SNAPPY\x00"
_XERIAL_HEADER: Final = _XERIAL_MAGIC + struct.pack(">ii", 1, 1)
_XERIAL_BLOCK: Final = 32 * 1024
_BE32: Final = struct.Struct(">i")


def compress_records(codec: int, data: bytes | memoryview) -> bytes:
    """The records section compressed as Kafka clients do: gzip member, snappy in the
    xerial framing of the Java client, LZ4 frame, zstd frame (codec ids as in
    ``attributes``)."""
    if codec == 0:
        return bytes(data)
    if codec == 1:
        return zlib.compress(data, 1, wbits=31)
    if codec == 2:
        mv = memoryview(data)
        parts = [_XERIAL_HEADER]
        for i in range(0, len(mv), _XERIAL_BLOCK):
            block = bytes(cramjam.snappy.compress_raw(mv[i : i + _XERIAL_BLOCK]))
            parts += (_BE32.pack(len(block)), block)
        return b"".join(parts)
    if codec == 3:
        return bytes(cramjam.lz4.compress(data))
    if codec == 4:
        return bytes(cramjam.zstd.compress(data))
    raise UnsupportedRecordFormat(f"record batch compression id {codec} unknown")


def _too_large(limit: int) -> MessageTooLarge:
    return MessageTooLarge(f"record batch decompresses to more than {limit} bytes")


def _gunzip(data: memoryview, limit: int) -> bytes:
    d = zlib.decompressobj(wbits=31)
    out = d.decompress(data, limit + 1)
    if len(out) > limit:
        raise _too_large(limit)
    if not d.eof or d.unused_data:
        raise CorruptRecordBatch("gzip records truncated or followed by garbage")
    return out


def _unsnappy(data: memoryview, limit: int) -> bytes:
    raw = cramjam.snappy
    if bytes(data[:8]) != _XERIAL_MAGIC:  # librdkafka: one raw snappy block
        if raw.decompress_raw_len(data) > limit:
            raise _too_large(limit)
        return bytes(raw.decompress_raw(data))
    if len(data) < 16:
        raise CorruptRecordBatch("snappy records: xerial header truncated")
    blocks = []
    total = 0
    pos, end = 16, len(data)
    while pos < end:
        if end - pos < 4:
            raise CorruptRecordBatch("snappy records: xerial block length truncated")
        length = _BE32.unpack_from(data, pos)[0]
        pos += 4
        if length < 0 or pos + length > end:
            raise CorruptRecordBatch(f"snappy records: xerial block of {length} bytes overruns")
        block = data[pos : pos + length]
        pos += length
        total += raw.decompress_raw_len(block)
        if total > limit:
            raise _too_large(limit)
        blocks.append(bytes(raw.decompress_raw(block)))
    return b"".join(blocks)


def _bounded(decompress_into: Callable[..., int]) -> Callable[[memoryview, int], bytes]:
    """Decompression into a buffer that grows up to ``limit`` (a frame need not declare
    its size): never more than ``limit`` bytes allocated."""

    def inflate(data: memoryview, limit: int) -> bytes:
        size = min(limit, max(64 * 1024, 8 * len(data)))
        while True:
            out = bytearray(size)
            try:
                n = decompress_into(data, out)
            except cramjam.DecompressionError as exc:
                if "whole buffer" not in str(exc):
                    raise
                if size >= limit:
                    raise _too_large(limit) from None
                size = min(limit, 4 * size)
                continue
            del out[n:]
            return bytes(out)

    return inflate


_INFLATE: Final[dict[int, Callable[[memoryview, int], bytes]]] = {
    1: _gunzip,
    2: _unsnappy,
    3: _bounded(cramjam.lz4.decompress_into),
    4: _bounded(cramjam.zstd.decompress_into),
}


def decompress_records(codec: int, data: bytes | memoryview, limit: int) -> bytes:
    """The records section of a batch compressed with ``codec``, at most ``limit`` bytes.

    :raises CorruptRecordBatch: the data does not decompress.
    :raises MessageTooLarge: it decompresses to more than ``limit`` bytes.
    """
    if codec == 0:
        if len(data) > limit:
            raise _too_large(limit)
        return bytes(data)
    inflate = _INFLATE.get(codec)
    if inflate is None:
        raise UnsupportedRecordFormat(f"record batch compression id {codec} unknown")
    try:
        return inflate(memoryview(data), limit)
    except (CorruptRecordBatch, MessageTooLarge):
        raise
    except (zlib.error, cramjam.DecompressionError, ValueError, OverflowError) as exc:
        raise CorruptRecordBatch(
            f"{_CODEC_NAMES[codec]} records do not decompress: {exc}"
        ) from None

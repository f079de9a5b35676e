"""Decoding and splitting a batch (:mod:`pigeon.core._batch_decode`), and what damage
it catches."""

from __future__ import annotations

import struct

import pytest
from batch_helpers import (
    ALL_CODECS,
    CODEC_NAMES,
    DECODE_ERRORS,
    decode_everything,
    encode,
    rich_entry,
    with_header,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pigeon.core._batch import read_header
from pigeon.core._batch_decode import decode_batch
from pigeon.core._codecs import GZIP, NONE, Codec, CodecSet
from pigeon.core.errors import (
    CodecError,
    CorruptFrame,
    InvalidArgument,
    MessageTooLarge,
    UnknownCodec,
)


def test_decode_from_bytearray_and_sliced_memoryview() -> None:
    data = encode([b"x", b"yy"], keys=["a", None])
    framed = bytearray(b"\x00" * 24 + data)
    for view in (memoryview(framed)[24:], bytearray(data), memoryview(b"hdr" + data)[3:]):
        batch = decode_batch(view, ALL_CODECS)
        assert batch.values() == [b"x", b"yy"]
        assert all(type(v) is bytes for v in batch.values())
        assert batch.value(1) == b"yy" and type(batch.value(1)) is bytes
        assert batch.keys() == [b"a", None]


def test_index_out_of_range() -> None:
    batch = decode_batch(encode([b"x"]), ALL_CODECS)
    for accessor in (batch.value, batch.key, batch.properties, batch.event_time):
        with pytest.raises(IndexError):
            accessor(1)
        with pytest.raises(IndexError):
            accessor(-1)


def test_non_contiguous_buffer_is_invalid_argument() -> None:
    data = encode([b"x"])
    with pytest.raises(InvalidArgument, match="contiguous"):
        decode_batch(memoryview(data + data)[::2], ALL_CODECS)


# -- corrupt bodies ---------------------------------------------------------------------


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_every_single_byte_flip_is_caught_or_harmless(codec_name: str) -> None:
    """Flip each byte of the prefix, header and (for codec none) the offsets: decoding
    raises CorruptFrame / CodecError, or succeeds, but never raises anything else."""
    data = rich_entry(ALL_CODECS.by_name(codec_name))
    h = read_header(data)
    starts, _ = h.layout()
    end = h.body_offset + (starts[7] if h.codec == 0 else min(64, h.body_length))
    for pos in range(end):
        for xor in (0x01, 0x80, 0xFF):
            corrupt = bytearray(data)
            corrupt[pos] ^= xor
            try:
                decode_everything(bytes(corrupt))
            except DECODE_ERRORS:
                pass


@settings(max_examples=300, deadline=None)
@given(
    codec_name=st.sampled_from(CODEC_NAMES),
    flips=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4
    ),
)
def test_random_corruption_never_raises_another_type(
    codec_name: str, flips: list[tuple[float, int]]
) -> None:
    data = bytearray(rich_entry(ALL_CODECS.by_name(codec_name)))
    for where, xor in flips:
        data[int(where * len(data))] ^= xor
    try:
        decode_everything(bytes(data))
    except DECODE_ERRORS:
        pass


@settings(max_examples=200, deadline=None)
@given(garbage=st.binary(min_size=0, max_size=300))
def test_garbage_after_a_valid_header_is_caught(garbage: bytes) -> None:
    """A well-formed header whose lengths point at random bytes."""
    h = read_header(rich_entry(NONE))
    prefix = rich_entry(NONE)[: h.body_offset]
    assume(len(garbage) != h.body_length)
    with pytest.raises(CorruptFrame):
        decode_batch(prefix + garbage, ALL_CODECS)


def _patch_body(data: bytes, column: int, new: bytes, offset: int = 0) -> bytes:
    """Overwrite bytes of one column of an uncompressed entry."""
    h = read_header(data)
    starts, _ = h.layout()
    pos = h.body_offset + starts[column] + offset
    return data[:pos] + new + data[pos + len(new) :]


VALUE_OFFSETS, KEY_OFFSETS, PROPERTY_OFFSETS, PROPERTY_KEY_OFFSETS = 1, 2, 4, 5


@pytest.mark.parametrize(
    ("column", "offset", "value", "match"),
    [
        (VALUE_OFFSETS, 0, 1, "value offsets run from 1"),
        (VALUE_OFFSETS, 4 * 20, 10**6, "value offsets run from 0 to 1000000"),
        (VALUE_OFFSETS, 4 * 3, 10**6, "value offsets decrease"),
        (VALUE_OFFSETS, 4 * 3, -5, "value offsets decrease"),
        (KEY_OFFSETS, 4 * 5, -1, "key offsets decrease"),
        (PROPERTY_OFFSETS, 4 * 20, 7, "property offsets run from 0 to 7"),
        (PROPERTY_KEY_OFFSETS, 4, 2**31 - 1, "property name offsets decrease"),
    ],
)
def test_bad_offsets_are_corrupt_frame(column: int, offset: int, value: int, match: str) -> None:
    data = _patch_body(rich_entry(NONE), column, struct.pack("<i", value), offset)
    with pytest.raises(CorruptFrame, match=match):
        decode_batch(data, ALL_CODECS)


def test_invalid_utf8_property_is_corrupt_frame() -> None:
    data = encode([b"x"], properties=[{"ab": "cd"}])
    h = read_header(data)
    starts, _ = h.layout()
    pos = h.body_offset + starts[9]  # property names
    data = data[:pos] + b"\xff" + data[pos + 1 :]
    batch = decode_batch(data, ALL_CODECS)  # strings are checked when read
    with pytest.raises(CorruptFrame, match="UTF-8"):
        batch.properties(0)
    with pytest.raises(CorruptFrame, match="UTF-8"):
        batch.all_properties()


# -- codecs -----------------------------------------------------------------------------


def test_unknown_codec_names_it() -> None:
    data = encode([b"x"], GZIP)
    with pytest.raises(UnknownCodec, match=r"codec id 1 \('gzip'\) is not registered"):
        decode_batch(data, CodecSet([NONE]))
    with pytest.raises(UnknownCodec, match="codec id 200 is not registered"):
        decode_batch(with_header(data, codec=200), ALL_CODECS)


def test_codec_body_mismatch_is_codec_error() -> None:
    # A gzip body labelled as another compressing codec, and a bad gzip body.
    data = encode([b"x" * 100], GZIP)
    h = read_header(data)
    broken = data[: h.body_offset + 10] + bytes(h.body_length - 10)
    with pytest.raises(CodecError):
        decode_batch(broken, ALL_CODECS)


def test_misbehaving_third_party_codec_is_contained() -> None:
    def bad_decompress(data: bytes | memoryview, size: int) -> bytes:
        raise ValueError("boom")

    def short_decompress(data: bytes | memoryview, size: int) -> bytes:
        return b"short"

    data = with_header(encode([b"x" * 100], NONE), codec=99)
    for fn, match in ((bad_decompress, "boom"), (short_decompress, "returned 5 bytes")):
        codecs = CodecSet([NONE, Codec("odd", 99, GZIP.compress, fn)])
        with pytest.raises(CodecError, match=match):
            decode_batch(data, codecs)


def test_max_uncompressed_size() -> None:
    data = encode([b"x" * 1000], GZIP)
    assert decode_batch(data, ALL_CODECS, max_uncompressed_size=2000).values() == [b"x" * 1000]
    with pytest.raises(MessageTooLarge):
        decode_batch(data, ALL_CODECS, max_uncompressed_size=1000)

"""The batch format (:mod:`pigeon.core._batch`): the header and the column layout, and
the checks ``read_header`` makes."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from batch_helpers import ALL_CODECS, CODEC_NAMES, encode, rich_entry, with_header
from hypothesis import given, settings
from hypothesis import strategies as st

from pigeon.core._batch import FORMAT_VERSION, BatchHeader, read_header
from pigeon.core._batch_decode import decode_batch
from pigeon.core._batch_encode import encode_batch
from pigeon.core._codecs import NONE
from pigeon.core.errors import CorruptFrame


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_header_fields_round_trip(codec_name: str) -> None:
    codec = ALL_CODECS.by_name(codec_name)
    values = [b"a", b"", b"ccc"]
    data = encode_batch(
        values,
        keys=["k", None, b"\xff"],
        properties=[{"x": "y"}, None, {"é": "ü", "z": ""}],
        event_times=[5, 0, -7],
        producer_name="prod-ü-1",
        sequence_id=2**64 - 3,
        publish_time=-(2**63),
        deliver_at=2**63 - 1,
        schema_version=2**32 - 1,
        codec=codec,
    )
    h = read_header(data)
    assert isinstance(h, BatchHeader)
    assert h.format_version == FORMAT_VERSION
    assert h.producer_name == "prod-ü-1"
    assert h.sequence_id == 2**64 - 3
    assert h.last_sequence_id == 2**64 - 1
    assert h.num_messages == 3
    assert h.codec == codec.id
    assert h.publish_time == -(2**63)
    assert h.deliver_at == 2**63 - 1
    assert h.schema_version == 2**32 - 1
    assert (h.has_keys, h.has_properties, h.has_event_times) == (True, True, True)
    assert h.values_length == 4
    assert h.keys_length == 2
    assert (h.property_entries, h.property_keys_length, h.property_values_length) == (3, 4, 3)
    assert h.entry_length == len(data)
    assert h.body_offset == 4 + h.header_len
    assert struct.unpack_from("<I", data)[0] == h.header_len
    assert read_header(memoryview(data)) == h
    assert read_header(bytearray(data)) == h
    assert decode_batch(data, ALL_CODECS).header == h
    batch = decode_batch(data, ALL_CODECS)
    assert [batch.sequence_id(i) for i in range(3)] == [2**64 - 3, 2**64 - 2, 2**64 - 1]


def test_defaults_and_minimal_batch() -> None:
    data = encode([b"only"])
    h = read_header(data)
    assert (h.deliver_at, h.schema_version, h.has_keys, h.has_properties) == (0, 0, False, False)
    assert not h.has_event_times
    # 8-byte value offsets, then the value: the smallest possible body.
    assert h.uncompressed_size == 8 + 4
    assert data[-4:] == b"only"


# -- layout: Arrow-compatible columns ---------------------------------------------------


def test_columns_are_aligned_and_arrow_shaped() -> None:
    values = [b"a", b"bb", b"", b"dddd", b"e"] * 3  # 15 messages: a partial bitmap byte
    keys: list[str | bytes | None] = [None, "k1", b"", "kkk", None] * 3
    props = [None, {"a": "1"}, {}, {"b": "2", "c": "3"}, None] * 3
    data = encode(values, keys=keys, properties=props, event_times=list(range(15)))
    batch = decode_batch(data, ALL_CODECS)
    body = memoryview(data)[batch.header.body_offset :]
    base = body.obj  # the batch refers to `data` itself (codec none: zero-copy)
    assert base is data
    columns = [
        batch.event_times,
        batch.values_offsets,
        batch.keys_offsets,
        batch.keys_validity,
        batch.properties_offsets,
        batch.property_keys_offsets,
        batch.property_values_offsets,
        batch.values_data,
        batch.keys_data,
        batch.property_keys_data,
        batch.property_values_data,
    ]
    starts, total = batch.header.layout()
    assert total == batch.header.uncompressed_size == len(body)
    for column, start in zip(columns, starts, strict=True):
        assert column is not None
        assert start % 8 == 0
        assert column.obj is data  # a view, not a copy
        assert column.tobytes() == body[start : start + column.nbytes].tobytes()
    assert batch.values_offsets is not None and batch.values_offsets.format == "i"
    assert batch.values_offsets.tolist()[0] == 0
    assert batch.values_offsets.tolist()[-1] == len(batch.values_data)
    assert batch.event_times is not None and batch.event_times.format == "q"
    assert batch.event_times.tolist() == list(range(15))
    assert batch.keys_validity is not None and batch.keys_offsets is not None
    assert batch.properties_offsets is not None
    assert batch.property_keys_data is not None and batch.property_values_data is not None
    # Validity: LSB first; messages 0 and 4 of every 5 have no key.
    bits = [(batch.keys_validity[i // 8] >> (i % 8)) & 1 for i in range(15)]
    assert bits == [0, 1, 1, 1, 0] * 3
    assert len(batch.keys_validity) == 2
    # A message without a key has an empty key range.
    ko = batch.keys_offsets.tolist()
    assert all(ko[i] == ko[i + 1] for i in range(15) if not bits[i])
    assert batch.properties_offsets.tolist() == [0, 0, 1, 1, 3, 3, 3, 4, 4, 6, 6, 6, 7, 7, 9, 9]
    assert batch.property_keys_data.tobytes() == b"abc" * 3
    assert batch.property_values_data.tobytes() == b"123" * 3


def test_columns_map_onto_arrow_without_copies() -> None:
    pa = pytest.importorskip("pyarrow")
    values = [b"v0", b"", b"value-2"]
    keys = [None, "k", b"key"]
    props = [{"a": "1"}, None, {"b": "2", "c": "é"}]
    batch = decode_batch(encode(values, keys=keys, properties=props), ALL_CODECS)
    n = batch.num_messages
    varr = pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(batch.values_offsets), pa.py_buffer(batch.values_data)]
    )
    assert varr.to_pylist() == values
    karr = pa.Array.from_buffers(
        pa.binary(),
        n,
        [
            pa.py_buffer(batch.keys_validity),
            pa.py_buffer(batch.keys_offsets),
            pa.py_buffer(batch.keys_data),
        ],
    )
    assert karr.to_pylist() == [None, b"k", b"key"]
    pkeys = pa.Array.from_buffers(
        pa.string(),
        batch.header.property_entries,
        [None, pa.py_buffer(batch.property_keys_offsets), pa.py_buffer(batch.property_keys_data)],
    )
    pvals = pa.Array.from_buffers(
        pa.string(),
        batch.header.property_entries,
        [
            None,
            pa.py_buffer(batch.property_values_offsets),
            pa.py_buffer(batch.property_values_data),
        ],
    )
    parr = pa.MapArray.from_arrays(
        pa.Array.from_buffers(pa.int32(), n + 1, [None, pa.py_buffer(batch.properties_offsets)]),
        pkeys,
        pvals,
    )
    assert [dict(m) for m in parr.to_pylist()] == [{"a": "1"}, {}, {"b": "2", "c": "é"}]


def test_no_optional_columns_when_unused() -> None:
    data = encode([b"a", b"b"], keys=[None, None], properties=[None, {}], event_times=[0, 0])
    h = read_header(data)
    assert (h.has_keys, h.has_properties, h.has_event_times) == (False, False, False)
    assert h.uncompressed_size == 12 + 4 + 2  # value offsets, padding to 8, values
    batch = decode_batch(data, ALL_CODECS)
    assert batch.keys() == [None, None]
    assert batch.all_properties() == [{}, {}]
    assert batch.key(1) is None and batch.properties(1) == {} and batch.event_time(1) == 0


# -- corrupt headers --------------------------------------------------------------------


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_every_truncation_is_corrupt_frame(codec_name: str) -> None:
    data = rich_entry(ALL_CODECS.by_name(codec_name))
    for cut in range(len(data)):
        with pytest.raises(CorruptFrame):
            read_header(data[:cut])
        with pytest.raises(CorruptFrame):
            decode_batch(data[:cut], ALL_CODECS)


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_trailing_bytes_are_corrupt_frame(codec_name: str) -> None:
    data = rich_entry(ALL_CODECS.by_name(codec_name))
    with pytest.raises(CorruptFrame, match="entry is"):
        decode_batch(data + b"\x00", ALL_CODECS)


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=400))
def test_garbage_is_corrupt_frame(garbage: bytes) -> None:
    with pytest.raises(CorruptFrame):
        read_header(garbage)
    with pytest.raises(CorruptFrame):
        decode_batch(garbage, ALL_CODECS)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"format_version": 3}, "format version 3"),
        ({"format_version": 2}, "Kafka-format entry"),
        ({"num_messages": 0}, "no message"),
        ({"num_messages": 21}, "add up"),
        ({"uncompressed_size": 1}, "add up"),
        ({"body_length": 5}, "entry is"),
        ({"values_length": 10**9}, "add up"),
        ({"has_keys": False}, "key bytes but no key column"),
        ({"keys_length": 2**31}, "int32"),
    ],
)
def test_inconsistent_header_is_corrupt_frame(changes: dict[str, Any], match: str) -> None:
    data = with_header(rich_entry(NONE), **changes)
    with pytest.raises(CorruptFrame, match=match):
        decode_batch(data, ALL_CODECS)


def test_header_length_prefix_checks() -> None:
    data = rich_entry(NONE)
    h = read_header(data)
    for bad in (0, 8, h.header_len + 4, 2**20, len(data)):
        with pytest.raises(CorruptFrame):
            read_header(struct.pack("<I", bad) + data[4:])


def test_chunk_fields_round_trip_and_are_checked():
    from pigeon.core.errors import InvalidArgument

    def chunk(info: tuple[str, int, int, int], values: list[bytes]) -> bytes:
        return encode_batch(
            values, producer_name="p", sequence_id=4, publish_time=1, codec=NONE, chunk=info
        )

    h = read_header(chunk(("p-3", 1, 3, 10), [memoryview(b"abcdef")[1:4]]))
    assert (h.chunk_uuid, h.chunk_id, h.num_chunks, h.total_chunk_size) == ("p-3", 1, 3, 10)
    assert (
        read_header(
            encode_batch([b"x"], producer_name="p", sequence_id=0, publish_time=1, codec=NONE)
        ).num_chunks
        == 0
    )
    with pytest.raises(InvalidArgument, match="bad chunk"):
        chunk(("p-3", 3, 3, 10), [b"abc"])
    with pytest.raises(InvalidArgument, match="bad chunk"):
        chunk(("p-3", 0, 3, 10), [b"a", b"b"])
    bad = bytearray(chunk(("p-3", 0, 3, 2), [b"a"]))
    # a chunk holding more than the whole message: patch totalChunkSize 2 -> 0 in place
    i = bytes(bad).rindex((2).to_bytes(4, "little"))
    bad[i] = 0
    with pytest.raises(CorruptFrame, match="chunk 0 of 3"):
        read_header(bytes(bad))

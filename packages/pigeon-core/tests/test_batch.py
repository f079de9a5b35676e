"""The columnar batch (entry) format: build, read the header, decode, split."""

from __future__ import annotations

import random
import struct
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pigeon.core import _batch
from pigeon.core._batch import (
    FORMAT_VERSION,
    BatchBuilder,
    BatchHeader,
    DecodedBatch,
    decode_batch,
    encode_batch,
    read_header,
)
from pigeon.core._codecs import GZIP, NONE, Codec, CodecSet
from pigeon.core._plugins import PluginManager
from pigeon.core.errors import (
    CodecError,
    CorruptFrame,
    InvalidArgument,
    MessageTooLarge,
    UnknownCodec,
)

#: Every codec registered in this environment (none and gzip, plus installed plugins).
ALL_CODECS = CodecSet.from_registry(PluginManager().codecs)
CODEC_NAMES = ALL_CODECS.names()


def encode(values: list[bytes], codec: Codec = NONE, **kwargs: Any) -> bytes:
    kwargs.setdefault("producer_name", "producer-1")
    kwargs.setdefault("sequence_id", 100)
    kwargs.setdefault("publish_time", 1_700_000_000_000)
    return encode_batch(values, codec=codec, **kwargs)


def decode_everything(data: bytes | memoryview, codecs: CodecSet = ALL_CODECS) -> list[Any]:
    """Decode and read every message through every accessor."""
    batch = decode_batch(data, codecs)
    n = batch.num_messages
    return [
        batch.header,
        batch.values(),
        batch.keys(),
        batch.all_properties(),
        [batch.value(i) for i in range(n)],
        [batch.key(i) for i in range(n)],
        [batch.properties(i) for i in range(n)],
        [batch.event_time(i) for i in range(n)],
    ]


# -- strategies -------------------------------------------------------------------------

text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)  # UTF-8 encodable
values_st = st.binary(max_size=300)
keys_st = st.one_of(st.none(), text, st.binary(max_size=20))
props_st = st.one_of(st.none(), st.dictionaries(text, text, max_size=4))
event_time_st = st.one_of(st.just(0), st.integers(min_value=-(2**63), max_value=2**63 - 1))


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(min_value=1, max_value=40))
    values = draw(st.lists(values_st, min_size=n, max_size=n))
    out: dict[str, Any] = {"values": values}
    if draw(st.booleans()):
        out["keys"] = draw(st.lists(keys_st, min_size=n, max_size=n))
    if draw(st.booleans()):
        out["properties"] = draw(st.lists(props_st, min_size=n, max_size=n))
    if draw(st.booleans()):
        out["event_times"] = draw(st.lists(event_time_st, min_size=n, max_size=n))
    return out


def expected_key(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


def check_decoded(batch: DecodedBatch, spec: dict[str, Any]) -> None:
    values = spec["values"]
    n = len(values)
    keys = spec.get("keys") or [None] * n
    props = [p or {} for p in spec.get("properties") or [None] * n]
    times = spec.get("event_times") or [0] * n
    assert batch.num_messages == len(batch) == n
    assert batch.values() == values
    assert [batch.value(i) for i in range(n)] == values
    assert batch.keys() == [expected_key(k) for k in keys]
    assert [batch.key(i) for i in range(n)] == [expected_key(k) for k in keys]
    assert batch.all_properties() == props
    assert [batch.properties(i) for i in range(n)] == props
    for i in range(n):  # same order as given, not only equal
        assert list(batch.properties(i).items()) == list(props[i].items())
    assert [batch.event_time(i) for i in range(n)] == times
    # Optional columns are present exactly when some message uses them.
    assert batch.has_keys == any(k is not None for k in keys)
    assert batch.has_properties == any(props)
    assert batch.has_event_times == any(times)
    assert (batch.keys_offsets is None) != batch.has_keys
    assert (batch.properties_offsets is None) != batch.has_properties
    assert (batch.event_times is None) != batch.has_event_times


# -- round trips ------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batches(), codec_name=st.sampled_from(CODEC_NAMES))
def test_round_trip_encode_batch(spec: dict[str, Any], codec_name: str) -> None:
    codec = ALL_CODECS.by_name(codec_name)
    data = encode(codec=codec, **spec)
    batch = decode_batch(data, ALL_CODECS)
    check_decoded(batch, spec)
    assert batch.header.codec == codec.id
    # A memoryview over the same bytes decodes the same.
    check_decoded(decode_batch(memoryview(data), ALL_CODECS), spec)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=batches(),
    codec_name=st.sampled_from(CODEC_NAMES),
    split=st.integers(min_value=0, max_value=40),
)
def test_round_trip_builder(spec: dict[str, Any], codec_name: str, split: int) -> None:
    """add() for the first messages, add_many() for the rest: same batch as encode_batch."""
    codec = ALL_CODECS.by_name(codec_name)
    values = spec["values"]
    n = len(values)
    split = min(split, n)
    keys = spec.get("keys") or [None] * n
    props = spec.get("properties") or [None] * n
    times = spec.get("event_times") or [0] * n
    builder = BatchBuilder(producer_name="p", codec=codec, max_messages=10_000, max_bytes=2**30)
    for i in range(split):
        builder.add(values[i], keys[i], props[i], times[i])
    builder.add_many(
        values[split:],
        keys=keys[split:] if "keys" in spec else None,
        properties=props[split:] if "properties" in spec else None,
        event_times=times[split:] if "event_times" in spec else None,
    )
    assert len(builder) == n
    data = builder.build(sequence_id=7, publish_time=99)
    assert len(builder) == 0 and builder.nbytes == 0
    check_decoded(decode_batch(data, ALL_CODECS), spec)
    assert data == encode(codec=codec, producer_name="p", sequence_id=7, publish_time=99, **spec)


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


def test_builder_schema_version_and_deliver_at() -> None:
    b = BatchBuilder(producer_name="p", codec=GZIP, schema_version=4)
    b.add(b"x")
    h = read_header(b.build(sequence_id=0, publish_time=1, deliver_at=123))
    assert (h.schema_version, h.deliver_at, h.codec) == (4, 123, GZIP.id)


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


def test_all_values_empty() -> None:
    data = encode([b""] * 9, keys=[b""] * 9)
    batch = decode_batch(data, ALL_CODECS)
    assert batch.values() == [b""] * 9
    assert batch.keys() == [b""] * 9  # empty keys are keys, not None


def test_many_messages_and_big_values() -> None:
    rnd = random.Random(5)
    values = [rnd.randbytes(rnd.randrange(3000)) for _ in range(2000)]
    keys = [None if i % 3 else str(i) for i in range(2000)]
    for codec_name in CODEC_NAMES:
        data = encode(values, ALL_CODECS.by_name(codec_name), keys=keys)
        batch = decode_batch(data, ALL_CODECS)
        assert batch.values() == values
        assert batch.keys() == [expected_key(k) for k in keys]


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


# -- builder ----------------------------------------------------------------------------


def test_add_reports_full_at_max_messages() -> None:
    b = BatchBuilder(producer_name="p", codec=NONE, max_messages=3)
    assert [b.add(b"x"), b.add(b"x"), b.add(b"x")] == [False, False, True]
    assert len(b) == 3 and b.is_full


def test_add_reports_full_at_max_bytes() -> None:
    b = BatchBuilder(producer_name="p", codec=NONE, max_bytes=10)
    assert b.add(b"12345") is False
    assert b.nbytes == 5
    assert b.add(b"1234", key="k") is True  # 5 + 4 value bytes + 1 key byte
    assert b.nbytes == 10


def test_nbytes_counts_keys_and_properties() -> None:
    b = BatchBuilder(producer_name="p", codec=NONE)
    b.add(b"abc", key=b"kk", properties={"name": "value"})
    assert b.nbytes == 3 + 2 + 4 + 5
    b.add_many([b"12", b"3"], keys=["x", None], properties=[None, {"a": "bc"}])
    assert b.nbytes == 14 + 3 + 1 + 3
    assert len(b) == 3


def test_oversized_single_message_fills_the_batch() -> None:
    b = BatchBuilder(producer_name="p", codec=NONE, max_bytes=100)
    assert b.add(b"x" * 1000) is True
    assert decode_batch(b.build(sequence_id=0, publish_time=0), ALL_CODECS).values() == [
        b"x" * 1000
    ]


def test_optional_columns_start_late_and_builder_resets() -> None:
    b = BatchBuilder(producer_name="p", codec=NONE)
    b.add(b"0")
    b.add(b"1")
    b.add(b"2", key="k2", event_time=22)
    b.add(b"3", properties={"p": "3"})
    b.add(b"4")
    batch = decode_batch(b.build(sequence_id=10, publish_time=0), ALL_CODECS)
    assert batch.keys() == [None, None, b"k2", None, None]
    assert [batch.event_time(i) for i in range(5)] == [0, 0, 22, 0, 0]
    assert batch.all_properties() == [{}, {}, {}, {"p": "3"}, {}]
    # The next batch starts from scratch: no key column left over.
    b.add(b"5")
    h = read_header(b.build(sequence_id=15, publish_time=0))
    assert (h.num_messages, h.sequence_id, h.has_keys, h.has_properties) == (1, 15, False, False)


def test_build_empty_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="at least one message"):
        BatchBuilder(producer_name="p", codec=NONE).build(sequence_id=0, publish_time=0)
    with pytest.raises(InvalidArgument):
        encode([])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"values": ["text"]}, "bytes-like"),
        ({"values": [b"a", 5]}, "bytes-like"),
        ({"values": [memoryview(b"abcd").cast("i")]}, "byte memoryviews"),
        ({"keys": [5]}, "keys must be"),
        ({"keys": ["\ud800"]}, "UTF-8"),
        ({"values": [b"a", b"b"], "keys": ["a", 1.5]}, "keys must be"),
        ({"properties": [{"a": 1}]}, "property values must be str"),
        ({"properties": [{1: "a"}]}, "property names must be str"),
        ({"properties": [{"\udfff": "a"}]}, "UTF-8"),
        ({"properties": [["a"]]}, "properties must be"),
        ({"event_times": [1.5]}, "event times"),
        ({"event_times": [2**63]}, "event times"),
        ({"keys": ["a", "b"]}, "2 items for 1 values"),
        ({"sequence_id": -1}, "sequence_id"),
        ({"sequence_id": 2**64}, "sequence_id"),
        ({"publish_time": 2**63}, "publish_time"),
        ({"deliver_at": "soon"}, "deliver_at"),
        ({"schema_version": -1}, "schema_version"),
        ({"producer_name": b"p"}, "producer_name"),
        ({"codec": "gzip"}, "codec must be a Codec"),
    ],
)
def test_invalid_input_is_invalid_argument(kwargs: dict[str, Any], match: str) -> None:
    values = kwargs.pop("values", [b"v"])
    with pytest.raises(InvalidArgument, match=match):
        encode(values, **kwargs)


def test_builder_resets_after_a_failed_build() -> None:
    b = BatchBuilder(producer_name="p", codec=NONE)
    b.add("not bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        b.build(sequence_id=0, publish_time=0)
    assert len(b) == 0
    b.add(b"ok")
    assert decode_batch(b.build(sequence_id=0, publish_time=0), ALL_CODECS).values() == [b"ok"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((5,), "value must be bytes-like"),
        ((b"v", 5), "key must be str or bytes"),
        ((b"v", None, ["a"]), "mapping of str to str"),
        ((b"v", None, {"a": 1}), "mapping of str to str"),
        ((b"v", None, None, 1.5), "event_time must be an int"),
    ],
)
def test_add_refuses_wrong_types_and_adds_nothing(args: tuple[Any, ...], match: str) -> None:
    b = BatchBuilder(producer_name="p", codec=NONE)
    b.add(b"first", "k")
    with pytest.raises(InvalidArgument, match=match):
        b.add(*args)
    assert len(b) == 1 and b.nbytes == 6
    b.add(b"second")
    batch = decode_batch(b.build(sequence_id=0, publish_time=0), ALL_CODECS)
    assert batch.values() == [b"first", b"second"]
    assert batch.keys() == [b"k", None]


def test_builder_validates_options() -> None:
    with pytest.raises(InvalidArgument):
        BatchBuilder(producer_name="p", codec=NONE, max_messages=0)
    with pytest.raises(InvalidArgument):
        BatchBuilder(producer_name="p", codec="none")  # type: ignore[arg-type]
    b = BatchBuilder(producer_name="p", codec=NONE)
    with pytest.raises(InvalidArgument, match="2 items for 1 values"):
        b.add_many([b"x"], keys=["a", "b"])


def test_too_large_for_int32_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_batch, "_INT32_MAX", 100)
    with pytest.raises(MessageTooLarge):
        encode([b"x" * 60, b"y" * 60])
    with pytest.raises(MessageTooLarge):
        encode([b"x"], keys=[b"k" * 101])


# -- corruption -------------------------------------------------------------------------

DECODE_ERRORS = (CorruptFrame, CodecError)


def rich_entry(codec: Codec) -> bytes:
    return encode(
        [b"value-%d" % i * (i % 4) for i in range(20)],
        codec,
        keys=[None if i % 3 == 0 else f"key-{i}" for i in range(20)],
        properties=[{"i": str(i), "é": "x"} if i % 2 else None for i in range(20)],
        event_times=[i * 1000 for i in range(20)],
    )


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


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=400))
def test_garbage_is_corrupt_frame(garbage: bytes) -> None:
    with pytest.raises(CorruptFrame):
        read_header(garbage)
    with pytest.raises(CorruptFrame):
        decode_batch(garbage, ALL_CODECS)


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


def _with_header(data: bytes, **changes: Any) -> bytes:
    """Re-encode the header of ``data`` with some fields changed (body untouched)."""
    h = read_header(data)
    names = {
        "format_version": "formatVersion",
        "num_messages": "numMessages",
        "codec": "codec",
        "uncompressed_size": "uncompressedSize",
        "body_length": "bodyLength",
        "values_length": "valuesLength",
        "keys_length": "keysLength",
        "has_keys": "hasKeys",
        "property_entries": "propertyEntries",
    }
    raw = data[4 : h.body_offset]
    with _batch._BatchHeaderSchema.from_bytes(raw) as reader:
        msg = reader.as_builder()
    for key, value in changes.items():
        setattr(msg, names[key], value)
    new: bytes = msg.to_bytes()
    return struct.pack("<I", len(new)) + new + data[h.body_offset :]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"format_version": 2}, "format version 2"),
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
    data = _with_header(rich_entry(NONE), **changes)
    with pytest.raises(CorruptFrame, match=match):
        decode_batch(data, ALL_CODECS)


def test_header_length_prefix_checks() -> None:
    data = rich_entry(NONE)
    h = read_header(data)
    for bad in (0, 8, h.header_len + 4, 2**20, len(data)):
        with pytest.raises(CorruptFrame):
            read_header(struct.pack("<I", bad) + data[4:])


def test_unknown_codec_names_it() -> None:
    data = encode([b"x"], GZIP)
    with pytest.raises(UnknownCodec, match=r"codec id 1 \('gzip'\) is not registered"):
        decode_batch(data, CodecSet([NONE]))
    with pytest.raises(UnknownCodec, match="codec id 200 is not registered"):
        decode_batch(_with_header(data, codec=200), ALL_CODECS)


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

    data = _with_header(encode([b"x" * 100], NONE), codec=99)
    for fn, match in ((bad_decompress, "boom"), (short_decompress, "returned 5 bytes")):
        codecs = CodecSet([NONE, Codec("odd", 99, GZIP.compress, fn)])
        with pytest.raises(CodecError, match=match):
            decode_batch(data, codecs)


def test_max_uncompressed_size() -> None:
    data = encode([b"x" * 1000], GZIP)
    assert decode_batch(data, ALL_CODECS, max_uncompressed_size=2000).values() == [b"x" * 1000]
    with pytest.raises(MessageTooLarge):
        decode_batch(data, ALL_CODECS, max_uncompressed_size=1000)


def test_properties_mapping_types() -> None:
    class Props(Mapping[str, str]):
        def __init__(self, d: dict[str, str]) -> None:
            self._d = d

        def __getitem__(self, k: str) -> str:
            return self._d[k]

        def __iter__(self) -> Any:
            return iter(self._d)

        def __len__(self) -> int:
            return len(self._d)

    data = encode([b"a", b"b"], properties=[Props({"x": "1", "y": "2"}), Props({})])
    assert decode_batch(data, ALL_CODECS).all_properties() == [{"x": "1", "y": "2"}, {}]


def test_non_contiguous_buffer_is_invalid_argument() -> None:
    data = encode([b"x"])
    with pytest.raises(InvalidArgument, match="contiguous"):
        decode_batch(memoryview(data + data)[::2], ALL_CODECS)

"""The producer's batch accumulator (:mod:`pigeon.core._batch_builder`)."""

from __future__ import annotations

from typing import Any

import pytest
from batch_helpers import ALL_CODECS, CODEC_NAMES, batches, check_decoded, encode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pigeon.core._batch import read_header
from pigeon.core._batch_builder import BatchBuilder, message_body_size
from pigeon.core._batch_decode import decode_batch
from pigeon.core._codecs import GZIP, NONE
from pigeon.core.errors import InvalidArgument


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


def test_builder_schema_version_and_deliver_at() -> None:
    b = BatchBuilder(producer_name="p", codec=GZIP, schema_version=4)
    b.add(b"x")
    h = read_header(b.build(sequence_id=0, publish_time=1, deliver_at=123))
    assert (h.schema_version, h.deliver_at, h.codec) == (4, 123, GZIP.id)


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


# -- the one-message check --------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        (b"",),
        (b"value",),
        (b"v", "ключ"),
        (b"v", b"key", {"name": "välue", "b": ""}),
        (memoryview(b"abc"), None, None, -1),
        (bytearray(b"abc"), "k", {"p": "q"}, 2**63 - 1),
    ],
)
def test_message_body_size_is_the_body_of_a_one_message_entry(message: tuple[Any, ...]) -> None:
    builder = BatchBuilder(producer_name="producer-ü", codec=NONE)
    builder.add(*message)
    entry = builder.build(sequence_id=0, publish_time=0)
    h = read_header(entry)
    assert message_body_size(*message) == h.uncompressed_size == h.body_length
    assert builder.check(*message) == len(entry)


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (("text",), "bytes, bytearray or a byte memoryview"),
        ((memoryview(b"abcd").cast("i"),), "byte memoryview"),
        ((b"v", 5), "str or bytes"),
        ((b"v", "\ud800"), "UTF-8"),
        ((b"v", None, {"a": 1}), "mapping of str to str"),
        ((b"v", None, {"\udfff": "a"}), "UTF-8"),
        ((b"v", None, None, 1.5), "event_time must be an int"),
        ((b"v", None, None, 2**63), "int64"),
    ],
)
def test_message_body_size_refuses_what_build_would(message: tuple[Any, ...], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        message_body_size(*message)
    builder = BatchBuilder(producer_name="p", codec=NONE)
    with pytest.raises(InvalidArgument):
        builder.add(*message)
        builder.build(sequence_id=0, publish_time=0)

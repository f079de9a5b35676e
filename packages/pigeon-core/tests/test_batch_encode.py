"""Encoding a batch (:mod:`pigeon.core._batch_encode`): round trips and refused input."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import pytest
from batch_helpers import ALL_CODECS, CODEC_NAMES, batches, check_decoded, encode, expected_key
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pigeon.core import _batch_encode
from pigeon.core._batch_builder import BatchBuilder
from pigeon.core._batch_decode import decode_batch
from pigeon.core._codecs import NONE
from pigeon.core.errors import InvalidArgument, MessageTooLarge


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


def test_too_large_for_int32_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_batch_encode, "_INT32_MAX", 100)
    with pytest.raises(MessageTooLarge):
        encode([b"x" * 60, b"y" * 60])
    with pytest.raises(MessageTooLarge):
        encode([b"x"], keys=[b"k" * 101])

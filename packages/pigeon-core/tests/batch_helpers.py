"""What the tests of the batch modules share: every codec of this environment, an
encoder with defaults, hypothesis strategies for whole batches, a check that a decoded
batch holds what was encoded, and a rich entry to damage."""

from __future__ import annotations

import struct
from typing import Any

from hypothesis import strategies as st

from pigeon.core import _batch
from pigeon.core._batch import read_header
from pigeon.core._codecs import NONE, Codec, CodecSet
from pigeon.core._plugins import PluginManager
from pigeon.core.batch import DecodedBatch, decode_batch, encode_batch
from pigeon.core.errors import CodecError, CorruptFrame

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


# -- entries to damage ------------------------------------------------------------------

DECODE_ERRORS = (CorruptFrame, CodecError)


def rich_entry(codec: Codec) -> bytes:
    return encode(
        [b"value-%d" % i * (i % 4) for i in range(20)],
        codec,
        keys=[None if i % 3 == 0 else f"key-{i}" for i in range(20)],
        properties=[{"i": str(i), "é": "x"} if i % 2 else None for i in range(20)],
        event_times=[i * 1000 for i in range(20)],
    )


def with_header(data: bytes, **changes: Any) -> bytes:
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

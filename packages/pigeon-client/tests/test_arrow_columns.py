"""Arrow record batches to entries and back, without a broker (pigeon.client._arrow), and
pyarrow as an optional extra."""

from __future__ import annotations

import subprocess
import sys
import zlib
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pigeon.client import MessageId
from pigeon.client._arrow import (
    ack_runs,
    encode_entry,
    entry_rows,
    key_partitions,
    plan_rows,
    split_points,
)
from pigeon.client._handles import codecs_of
from pigeon.core import PluginManager
from pigeon.core.batch import decode_batch, pack_entry_header
from pigeon.core.errors import InvalidArgument, MessageTooLarge

CODECS = codecs_of(PluginManager())
PROPS = pa.map_(pa.string(), pa.string())


def entries_of(rb: pa.RecordBatch, *, codec: str = "none", **split: int) -> list[bytes]:
    names = rb.schema.names
    rows = plan_rows(
        rb,
        value="v",
        key="k" if "k" in names else None,
        properties="p" if "p" in names else None,
        event_time="t" if "t" in names else None,
    )
    limits = {"max_messages": 1000, "max_bytes": 1 << 20, "max_entry": 5 << 20, **split}
    return [
        encode_entry(rows, s, e, producer_name="p", sequence_id=s, codec=CODECS.by_name(codec))
        for s, e in split_points(rows, **limits)
    ]


def decoded(entries: list[bytes]) -> list[tuple[object, ...]]:
    out = []
    for data in entries:
        b = decode_batch(data, CODECS)
        keys = b.keys() if b.has_keys else [None] * b.num_messages
        props = b.all_properties() if b.has_properties else [{}] * b.num_messages
        times = b.event_times if b.has_event_times else [0] * b.num_messages
        out.extend(zip(b.values(), keys, props, times, strict=True))
    return out


def sample(n: int, value_type: pa.DataType, key_type: pa.DataType) -> pa.RecordBatch:
    as_value = (
        (lambda i: f"v{i}" * (i % 4))
        if pa.types.is_string(value_type) or pa.types.is_large_string(value_type)
        else (lambda i: f"v{i}".encode() * (i % 4))
    )
    return pa.record_batch(
        {
            "v": pa.array([as_value(i) for i in range(n)], value_type),
            "k": pa.array(
                [
                    None if i % 3 else (f"k{i}" if "string" in str(key_type) else f"k{i}".encode())
                    for i in range(n)
                ],
                key_type,
            ),
            "p": pa.array([None if i % 2 else {"a": f"{i}", "ü": "x"} for i in range(n)], PROPS),
            "t": pa.array([i * 7 for i in range(n)], pa.int64()),
        }
    )


def want(rb: pa.RecordBatch) -> list[tuple[object, ...]]:
    def raw(x: object) -> object:
        return x.encode() if isinstance(x, str) else x

    return [(raw(r["v"]), raw(r["k"]), dict(r["p"] or []), r["t"]) for r in rb.to_pylist()]


@pytest.mark.parametrize(
    "value_type", [pa.binary(), pa.large_binary(), pa.string(), pa.large_string()]
)
@pytest.mark.parametrize("key_type", [pa.binary(), pa.string(), pa.large_string()])
def test_every_column_type_round_trips_sliced_and_split(value_type, key_type):
    rb = sample(45, value_type, key_type)
    for part in (rb, rb.slice(5, 33), rb.slice(9, 1)):
        entries = entries_of(part, max_messages=8)
        assert len(entries) == -(-part.num_rows // 8)
        assert decoded(entries) == want(part)


def test_compressed_entries_and_all_null_columns():
    rb = pa.record_batch(
        {
            "v": pa.array([b"x" * 50] * 20),
            "k": pa.array([None] * 20, pa.binary()),
            "p": pa.array([{}] * 20, PROPS),
            "t": pa.array([None] * 20, pa.timestamp("ms")),
        }
    )
    (entry,) = entries_of(rb, codec="zlib" if "zlib" in CODECS.names() else "gzip")
    header = decode_batch(entry, CODECS).header
    assert not (header.has_keys or header.has_properties or header.has_event_times)
    assert decoded([entry]) == [(b"x" * 50, None, {}, 0)] * 20


@pytest.mark.parametrize(("unit", "scale"), [("s", 1000), ("ms", 1), ("us", 0.001), ("ns", 1e-6)])
def test_event_time_units_become_milliseconds(unit, scale):
    raw = [0, 1_700_000_000, None]
    if unit in ("us", "ns"):
        raw = [0, 1_700_000_000_000_000, None]
    rb = pa.record_batch({"v": [b"a", b"b", b"c"], "t": pa.array(raw, pa.timestamp(unit))})
    rows = plan_rows(rb, value="v", key=None, properties=None, event_time="t")
    assert rows.event_times is not None
    assert rows.event_times.to_pylist() == [0, int(raw[1] * scale), 0]


def test_split_points_follow_the_per_message_rules():
    rb = pa.record_batch({"v": [b"x" * 10] * 100})
    rows = plan_rows(rb, value="v", key=None, properties=None, event_time=None)
    # full with the row that takes the payload to max_bytes, or at max_messages
    assert list(split_points(rows, max_messages=7, max_bytes=35, max_entry=10**6))[:2] == [
        (0, 4),
        (4, 8),
    ]
    assert list(split_points(rows, max_messages=7, max_bytes=10**6, max_entry=10**6))[:2] == [
        (0, 7),
        (7, 14),
    ]
    # never over the entry limit (10 bytes + 24 of slack a row)
    assert next(split_points(rows, max_messages=100, max_bytes=10**6, max_entry=100)) == (0, 2)
    with pytest.raises(MessageTooLarge, match="does not chunk"):
        list(split_points(rows, max_messages=100, max_bytes=10**6, max_entry=20))


def test_key_partitions_match_the_per_message_hash():
    keys = pa.array(["a", None, "", "hello world", "ü" * 20, "k" * 70])
    expected = [None if k is None else zlib.crc32(k.encode()) % 5 for k in keys.to_pylist()]
    assert key_partitions(keys, 5).to_pylist() == expected
    assert key_partitions(keys.slice(2), 5).to_pylist() == expected[2:]


def test_received_rows_skip_acknowledged_indexes_and_ack_runs():
    rb = pa.record_batch({"v": [f"m{i}".encode() for i in range(10)]})
    (batch,) = entries_of(rb)
    stored = pack_entry_header(10, 100, 5) + batch
    entry = SimpleNamespace(segment_id=3, entry_id=9, data=stored)
    got, nxt, n = entry_rows(
        entry, topic="t", partition=-1, codecs=CODECS, start=2, max_rows=5, skip=[3, 4]
    )
    assert got is not None and (nxt, n) == (9, 10)
    assert got["offset"].to_pylist() == [102, 105, 106, 107, 108]
    assert MessageId.deserialize(got["message_id"][0].as_py()) == MessageId(3, 9, 2, -1, 102)
    assert len(got["message_id"][0].as_py()) == 40  # the binary layout, not text
    assert ack_runs(got) == [(3, 9, 2, 102, 1), (3, 9, 5, 105, 4)]
    full, _, _ = entry_rows(entry, topic="t", partition=-1, codecs=CODECS)
    assert (
        full is not None
        and full.column("value").buffers()[2].address >= pa.py_buffer(stored).address
    )


def test_message_ids_are_binary_columns_acked_from_slices():
    rb = pa.record_batch({"v": [b"x"] * 3000})
    (batch,) = entries_of(rb, max_messages=3000)
    entry = SimpleNamespace(
        segment_id=2**40, entry_id=5, data=pack_entry_header(3000, 7, 1) + batch
    )
    got, _, _ = entry_rows(entry, topic="t", partition=12, codecs=CODECS)
    assert got is not None
    ids = got["message_id"]
    assert ids.type == pa.binary() and set(pc.binary_length(ids).to_pylist()) == {40}
    assert MessageId.deserialize(ids[2999].as_py()) == MessageId(2**40, 5, 2999, 12, 3006)
    assert MessageId.deserialize(ids[2999].as_py()).offset == 3006
    # a slice of the batch (its column starts past the first row) acks its own rows
    assert ack_runs(got.slice(1000, 5)) == [(2**40, 5, 1000, 1007, 5)]
    foreign = got.set_column(5, "message_id", pa.array([b"3:9:2:-1:102"] * 3000))
    with pytest.raises(InvalidArgument, match="not the one receive_arrow returned"):
        ack_runs(foreign)


def test_bad_columns_are_refused():
    with pytest.raises(InvalidArgument, match="event_time must be a timestamp or int64"):
        plan_rows(
            pa.record_batch({"v": [b"a"], "t": [1.5]}),
            value="v",
            key=None,
            properties=None,
            event_time="t",
        )
    with pytest.raises(InvalidArgument, match="null values"):
        plan_rows(
            pa.record_batch({"v": [b"a"], "p": pa.array([[("a", None)]], PROPS)}),
            value="v",
            key=None,
            properties="p",
            event_time=None,
        )


def test_pigeon_client_imports_without_pyarrow_and_names_the_extra():
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "import pigeon.client, pigeon.client.trio, pigeon.client.asyncio\n"
        "from pigeon.client import Producer\n"
        "from pigeon.core.errors import NotSupported\n"
        "try:\n"
        "    Producer.send_arrow(object.__new__(Producer), None)\n"
        "except NotSupported as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'pigeon-client[arrow]'" in out.stdout

"""Stored entries to Arrow record batches, without Spark or a broker."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

pa = pytest.importorskip("pyarrow")

from pigeon.client import MessageId  # noqa: E402
from pigeon.core import PluginManager  # noqa: E402
from pigeon.core._codecs import CodecSet  # noqa: E402
from pigeon.core._entry import pack_entry_header  # noqa: E402
from pigeon.core.batch import encode_batch  # noqa: E402
from pigeon.spark._arrow import arrow_schema, record_batches  # noqa: E402

CODECS = CodecSet(codec for _name, codec in PluginManager().codecs.items())
TOPIC = "persistent://public/default/t"


@dataclass
class Entry:
    segment_id: int
    entry_id: int
    data: bytes


def entry(
    first: int,
    values: list[bytes],
    *,
    publish: int = 1_700_000_000_000,
    codec: str = "none",
    **cols: object,
) -> bytes:
    batch = encode_batch(
        values,
        producer_name="p",
        sequence_id=first,
        publish_time=publish,
        codec=CODECS.by_name(codec),
        **cols,  # type: ignore[arg-type]
    )
    return pack_entry_header(len(values), first, publish) + batch


def read(entries: list[Entry], start: int, end: int, *, props: bool = True, **kw: int) -> pa.Table:
    batches = list(
        record_batches(
            entries,
            topic=TOPIC,
            partition=3,
            start=start,
            end=end,
            codecs=CODECS,
            include_properties=props,
            **kw,
        )
    )
    return pa.Table.from_batches(batches, schema=arrow_schema(props))


def test_columns_of_mixed_entries() -> None:
    entries = [
        Entry(
            7,
            0,
            entry(
                0,
                [b"a", b"bb", b""],
                keys=[None, "k1", b"k2"],
                event_times=[0, 5, 6],
                properties=[{"x": "1"}, None, {"y": "2", "z": "é"}],
            ),
        ),
        Entry(7, 1, entry(3, [b"c"], publish=1_700_000_000_123)),
        Entry(9, 0, entry(4, [b"d", b"e"], keys=["k", "k"], codec="gzip")),
    ]
    table = read(entries, 0, 6)
    assert table.column("value").to_pylist() == [b"a", b"bb", b"", b"c", b"d", b"e"]
    assert table.column("key").to_pylist() == [None, b"k1", b"k2", None, b"k", b"k"]
    assert table.column("offset").to_pylist() == list(range(6))
    assert table.column("partition").to_pylist() == [3] * 6
    assert table.column("topic").to_pylist() == [TOPIC] * 6
    ids = [MessageId.deserialize(m) for m in table.column("message_id").to_pylist()]
    assert ids == [
        MessageId(7, 0, 0, 3),
        MessageId(7, 0, 1, 3),
        MessageId(7, 0, 2, 3),
        MessageId(7, 1, 0, 3),
        MessageId(9, 0, 0, 3),
        MessageId(9, 0, 1, 3),
    ]
    assert [m.offset for m in ids] == list(range(6))
    t0 = datetime.fromtimestamp(1_700_000_000, UTC)
    assert table.column("publish_time").to_pylist()[2:4] == [
        t0,
        datetime.fromtimestamp(1_700_000_000.123, UTC),
    ]
    events = table.column("event_time").to_pylist()
    assert events[0] is None and events[3:] == [None] * 3
    assert events[1] == datetime.fromtimestamp(0.005, UTC)
    props = [dict(p) for p in table.column("properties").to_pylist()]
    assert props == [{"x": "1"}, {}, {"y": "2", "z": "é"}, {}, {}, {}]


def test_trims_rows_outside_the_range_and_splits_batches() -> None:
    entries = [
        Entry(1, i, entry(10 * i, [b"%d" % (10 * i + j) for j in range(10)])) for i in range(5)
    ]
    table = read(entries, 13, 37, props=False, max_rows=15)
    assert table.column("offset").to_pylist() == list(range(13, 37))
    assert table.column("value").to_pylist() == [b"%d" % i for i in range(13, 37)]
    assert "properties" not in table.column_names
    # nothing in range: no batch at all
    assert read(entries[:1], 10, 20, props=False).num_rows == 0


def test_schema_is_what_pyspark_expects() -> None:
    arrow_types = pytest.importorskip("pyspark.sql.pandas.types")
    from pigeon.spark import source_schema

    for props in (False, True):
        expected = arrow_types.to_arrow_schema(source_schema(props), timezone="UTC")
        assert expected.equals(arrow_schema(props))

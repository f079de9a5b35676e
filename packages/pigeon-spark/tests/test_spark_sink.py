"""Sink input handling that needs neither Spark's JVM nor a broker."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

pa = pytest.importorskip("pyarrow")
types = pytest.importorskip("pyspark.sql.types")

from pigeon.spark._options import OptionError, SinkOptions  # noqa: E402
from pigeon.spark._sink import _check_input, _event_times, _sorted  # noqa: E402


def test_sorted_gives_one_order_for_any_input_order() -> None:
    rows = [
        {
            "key": None if i % 5 == 0 else b"k%d" % (i % 3),
            "value": b"v%d" % (i % 7),
            "event_time": i % 4,
        }
        for i in range(60)
    ]
    outputs = []
    for seed in range(3):
        shuffled = rows[:]
        random.Random(seed).shuffle(shuffled)
        batches = [pa.RecordBatch.from_pylist(shuffled[i : i + 13]) for i in range(0, 60, 13)]
        outputs.append(pa.Table.from_batches(list(_sorted(iter(batches)))).to_pylist())
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0]) == 60
    assert list(_sorted(iter([]))) == []


def test_event_times_in_ms() -> None:
    ts = pa.array([datetime(2024, 1, 1, tzinfo=UTC), None], pa.timestamp("us", tz="UTC"))
    assert _event_times(ts, 2) == [1_704_067_200_000, 0]
    assert _event_times(pa.array([5, None], pa.int64()), 2) == [5, 0]
    assert _event_times(None, 2) == [0, 0]


def test_input_columns_are_checked() -> None:
    T = types
    opts = SinkOptions("pigeon://127.0.0.1:6650")
    good = T.StructType(
        [
            T.StructField("value", T.StringType()),
            T.StructField("topic", T.StringType()),
            T.StructField("extra", T.IntegerType()),
        ]
    )
    _check_input(good, opts)
    bad = T.StructType(
        [
            T.StructField("value", T.IntegerType()),
            T.StructField("properties", T.MapType(T.StringType(), T.IntegerType())),
        ]
    )
    with pytest.raises(OptionError) as info:
        _check_input(bad, opts)
    text = str(info.value)
    assert "column 'value' must be binary or string, not int" in text
    assert "'properties' must be map<string,string>" in text
    assert "set the 'topic' option" in text

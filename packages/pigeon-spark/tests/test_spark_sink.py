"""Sink input handling that needs neither Spark's JVM nor a broker."""

from __future__ import annotations

import random
import zlib

import pytest

pa = pytest.importorskip("pyarrow")
types = pytest.importorskip("pyspark.sql.types")

from pigeon.spark._options import OptionError, SinkOptions  # noqa: E402
from pigeon.spark._sink import (  # noqa: E402
    UNKEYED_RUN,
    _check_input,
    _partition_of_rows,
    _sorted,
)


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


def test_rows_are_routed_as_the_per_row_rule_did() -> None:
    # keyed rows by crc32(key) % partitions; the task's i-th unkeyed row to partition
    # (task + i // UNKEYED_RUN) % partitions, counting across record batches
    keys = [None if i % 3 else b"k%d" % i for i in range(3000)]
    got = _partition_of_rows(pa.array(keys, pa.binary()), 4, 1, 500).to_pylist()
    unkeyed = 500
    for key, part in zip(keys, got, strict=True):
        if key is None:
            assert part == (1 + unkeyed // UNKEYED_RUN) % 4
            unkeyed += 1
        else:
            assert part == zlib.crc32(key) % 4
    assert _partition_of_rows(pa.nulls(3, pa.binary()), 2, 0, 999).to_pylist() == [0, 1, 1]


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

"""AVRO and JSON schema values decoded into Arrow columns, without Spark or a broker."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("fastavro")

from test_spark_arrow import CODECS, TOPIC, Entry, entry  # noqa: E402

from pigeon.client.schema import (  # noqa: E402
    Array,
    AvroSchema,
    Boolean,
    Bytes,
    Double,
    Float,
    Integer,
    JsonSchema,
    Long,
    Map,
    Record,
    String,
)
from pigeon.spark._arrow import record_batches  # noqa: E402
from pigeon.spark._avro import (  # noqa: E402
    UnsupportedSchema,
    ValueDecoder,
    ValueSchema,
    arrow_type,
)


class Address(Record):
    city = String()
    zip = Integer()


class UserV1(Record):
    name = String(required=True)
    age = Integer()


class UserV2(Record):
    """V1 + fields of every kind (the added ones with defaults, so V1 data resolves)."""

    _avro_namespace = None
    name = String(required=True)
    age = Integer()
    score = Double(default=1.5, required_default=True)
    ratio = Float()
    big = Long()
    ok = Boolean()
    raw = Bytes()
    tags = Array(String())
    counts = Map(Long())
    home = Address()
    past = Array(Address())


UserV2.__name__ = "UserV1"  # the same record, evolved


def v2(**kw: Any) -> UserV2:
    return UserV2(**kw)


FULL = v2(
    name="ada",
    age=36,
    score=2.5,
    ratio=0.5,
    big=2**40,
    ok=True,
    raw=b"\x00\xff",
    tags=["a", "b"],
    counts={"x": 1},
    home=Address(city="London", zip=1),
    past=[Address(city="Paris", zip=None)],
)
FULL_ROW = {
    "age": 36,
    "big": 2**40,
    "counts": [("x", 1)],
    "home": {"city": "London", "zip": 1},
    "name": "ada",
    "ok": True,
    "past": [{"city": "Paris", "zip": None}],
    "ratio": 0.5,
    "raw": b"\x00\xff",
    "score": 2.5,
    "tags": ["a", "b"],
}


ADDRESS = pa.struct([("city", pa.string()), ("zip", pa.int32())])


def versions(*vs: int) -> Any:
    return pa.array(list(vs), pa.int32())


def test_arrow_type_of_a_pigeon_record() -> None:
    t = arrow_type(UserV2.schema())
    assert t == pa.struct(
        [
            ("age", pa.int32()),
            ("big", pa.int64()),
            ("counts", pa.map_(pa.string(), pa.int64())),
            ("home", ADDRESS),
            ("name", pa.string()),
            ("ok", pa.bool_()),
            (
                "past",
                pa.list_(
                    pa.field("element", pa.struct([("city", pa.string()), ("zip", pa.int32())]))
                ),
            ),
            ("ratio", pa.float32()),
            ("raw", pa.binary()),
            ("score", pa.float64()),
            ("tags", pa.list_(pa.field("element", pa.string()))),
        ]
    )


def test_arrow_type_of_other_avro_types() -> None:
    schema = {
        "type": "record",
        "name": "R",
        "namespace": "n",
        "fields": [
            {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}},
            {"name": "e2", "type": ["null", "E"]},
            {"name": "f", "type": {"type": "fixed", "name": "F", "size": 2}},
            {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
            {"name": "d", "type": {"type": "int", "logicalType": "date"}},
            {"name": "u", "type": {"type": "string", "logicalType": "uuid"}},
        ],
    }
    assert arrow_type(schema) == pa.struct(
        [
            ("e", pa.string()),
            ("e2", pa.string()),
            ("f", pa.binary()),
            ("ts", pa.timestamp("us", tz="UTC")),
            ("d", pa.date32()),
            ("u", pa.string()),
        ]
    )


@pytest.mark.parametrize(
    ("field_type", "message"),
    [
        (["null", "int", "string"], "2 non-null types"),
        ("R", "recursive"),
        ("Nope", "unknown Avro type"),
    ],
)
def test_types_without_a_spark_column_are_refused(field_type: Any, message: str) -> None:
    schema = {"type": "record", "name": "R", "fields": [{"name": "x", "type": field_type}]}
    with pytest.raises(UnsupportedSchema, match=message):
        arrow_type(schema)


def test_avro_values_of_two_versions_decode_to_the_latest() -> None:
    old, new = AvroSchema(UserV1), AvroSchema(UserV2)
    decoder = ValueDecoder(ValueSchema("AVRO", new.definition()))
    writers = {1: ("AVRO", old.definition()), 2: ("AVRO", new.definition())}
    values = pa.array(
        [old.encode(UserV1(name="bob", age=7)), new.encode(FULL), b"\x03garbage", b""],
        pa.binary(),
    )
    out, report = decoder.decode(values, versions(1, 2, 2, 1), writers.get)
    rows = out.to_pylist()
    assert rows[0]["name"] == "bob" and rows[0]["age"] == 7
    assert rows[0]["score"] == 1.5  # the added field's default
    assert rows[0]["tags"] is None
    assert rows[1] == FULL_ROW
    assert rows[2:] == [None, None]
    assert report.failed == 2
    assert out.type == decoder.type


def test_avro_version_zero_is_read_with_the_reader_schema() -> None:
    new = AvroSchema(UserV2)
    decoder = ValueDecoder(ValueSchema("AVRO", new.definition()))
    values = pa.array([new.encode(FULL)], pa.binary())

    def no_lookup(version: int) -> None:
        raise AssertionError("version 0 has no writer to look up")

    out, report = decoder.decode(values, versions(0), no_lookup)
    assert out.to_pylist() == [FULL_ROW] and report.failed == 0


def test_json_values_of_two_versions_and_bad_ones() -> None:
    old, new = JsonSchema(UserV1), JsonSchema(UserV2)
    decoder = ValueDecoder(ValueSchema("JSON", new.definition()))
    writers = {1: ("JSON", old.definition()), 2: ("JSON", new.definition())}
    bad = [
        b"not json",
        b"[1, 2]",
        json.dumps({"name": "x", "age": "seven"}).encode(),
        json.dumps({"name": "x", "age": 2**40}).encode(),
        json.dumps({"name": "x", "tags": "abc"}).encode(),
        json.dumps({"name": "x", "ratio": 1e300}).encode(),
    ]
    values = pa.array([old.encode(UserV1(name="bob", age=7)), new.encode(FULL), *bad], pa.binary())
    out, report = decoder.decode(values, versions(1, 2, *[2] * len(bad)), writers.get)
    rows = out.to_pylist()
    assert rows[0]["name"] == "bob" and rows[0]["score"] == 1.5 and rows[0]["home"] is None
    assert rows[1] == FULL_ROW
    assert report.failed == len(bad) - 1  # 1e300 fits a float32 column as inf
    assert rows[2:7] == [None] * 5


def test_json_logical_types_and_enums() -> None:
    schema = {
        "type": "record",
        "name": "R",
        "fields": [
            {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}},
            {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
            {"name": "d", "type": {"type": "int", "logicalType": "date"}},
        ],
    }
    decoder = ValueDecoder(ValueSchema("JSON", json.dumps(schema)))
    values = pa.array(
        [b'{"e": "B", "ts": 1000, "d": 1}', b'{"e": "C", "ts": 0, "d": 0}'], pa.binary()
    )
    out, report = decoder.decode(values, versions(0, 0), lambda v: None)
    assert out.to_pylist() == [
        {"e": "B", "ts": datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC), "d": date(1970, 1, 2)},
        None,
    ]
    assert report.failed == 1


def test_record_batches_decode_value_and_keep_the_bytes_in_data() -> None:
    old, new = AvroSchema(UserV1), AvroSchema(UserV2)
    value_schema = ValueSchema("AVRO", new.definition())
    decoder = ValueDecoder(value_schema)
    writers = {1: ("AVRO", old.definition()), 2: ("AVRO", new.definition())}
    first = [old.encode(UserV1(name=f"u{i}", age=i)) for i in range(3)]
    second = [new.encode(v2(name=f"w{i}", age=i)) for i in range(3)]
    entries = [
        Entry(1, 0, entry(0, first, schema_version=1)),
        Entry(1, 1, entry(3, second, schema_version=2)),
    ]

    def decode(values: Any, vs: Any) -> Any:
        return decoder.decode(values, vs, writers.get)[0]

    batches = list(
        record_batches(
            entries,
            topic=TOPIC,
            partition=0,
            start=1,
            end=5,
            codecs=CODECS,
            include_properties=False,
            decode=decode,
            value_type=decoder.type,
        )
    )
    table = pa.Table.from_batches(batches)
    assert table.column_names[-1] == "data" and table.column_names[1] == "value"
    assert [v["name"] for v in table.column("value").to_pylist()] == ["u1", "u2", "w0", "w1"]
    assert table.column("data").to_pylist() == [*first[1:], *second[:2]]
    assert table.column("offset").to_pylist() == [1, 2, 3, 4]


def test_load_refuses_topics_with_different_or_unmappable_schemas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("pyspark")
    from pigeon.spark import OptionError, _source
    from pigeon.spark._options import parse_source_options

    registry: dict[str, tuple[int, str, str] | None] = {}
    monkeypatch.setattr(_source, "topic_schema", lambda client, topic: registry[topic])
    a, b = "persistent://public/default/a", "persistent://public/default/b"
    opts = parse_source_options({"service_url": "pigeon://h:1", "topics": f"{a},{b}"})
    v1 = AvroSchema(UserV1).definition()

    registry.update({a: (0, "AVRO", v1), b: None})
    value = _source._value_schema(None, opts)  # type: ignore[arg-type]
    assert value == ValueSchema("AVRO", v1)
    spark_schema = _source.source_schema(False, value)
    assert _source._value_schema_of(spark_schema) == value
    assert spark_schema.simpleString().startswith(
        "struct<key:binary,value:struct<age:int,name:string>,topic:string,"
    )
    assert spark_schema.simpleString().endswith(",data:binary>")

    registry[b] = (3, "AVRO", AvroSchema(UserV2).definition())
    with pytest.raises(OptionError, match=r"different schemas .*decodeSchema=false"):
        _source._value_schema(None, opts)  # type: ignore[arg-type]

    union = {"type": "record", "name": "R", "fields": [{"name": "x", "type": ["int", "string"]}]}
    registry.update({a: (0, "JSON", json.dumps(union)), b: (0, "STRING", "")})
    with pytest.raises(OptionError, match=r"no Spark column type: .*non-null types"):
        _source._value_schema(None, opts)  # type: ignore[arg-type]

    registry.update({a: (0, "STRING", ""), b: None})
    assert _source._value_schema(None, opts) is None  # type: ignore[arg-type]
    off = parse_source_options(
        {"service_url": "pigeon://h:1", "topics": f"{a},{b}", "decodeSchema": "false"}
    )
    registry[a] = (0, "AVRO", v1)
    assert _source._value_schema(None, off) is None  # type: ignore[arg-type]

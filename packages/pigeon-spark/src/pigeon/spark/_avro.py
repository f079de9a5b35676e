"""Message values of AVRO and JSON schema topics as Arrow struct arrays. No I/O, no Spark.

Both schema types are defined by an Avro record schema (see :mod:`pigeon.client._schema`).
The record becomes an Arrow struct (Spark ``struct``), field by field:

===================================  =================================================
Avro                                 Arrow (Spark)
===================================  =================================================
boolean, int, long                   bool, int32, int64 (boolean, int, bigint)
float, double                        float32, float64 (float, double)
string, enum                         string (string)
bytes, fixed                         binary (binary)
array, map                           list, map<string, T> (array, map)
record                               struct (struct)
``["null", T]`` (either order)       T, null when null
timestamp-millis/-micros, date       timestamp[us, UTC], date32 (timestamp, date)
other logical types                  their underlying type
===================================  =================================================

Unions of two or more non-null types and recursive records have no Spark column type:
:class:`UnsupportedSchema` (read with ``decodeSchema=false``).

Decoding (:meth:`ValueDecoder.decode`) goes one run of values per writer version: Avro
values through fastavro's ``schemaless_reader`` with the writer's and the reader's
(latest) schema, so a value written with an older version is projected onto the latest
(added fields take their defaults, or null when nullable without one; removed ones are
dropped); JSON values through
``json.loads`` and a converter compiled once from the reader schema (missing fields take
their defaults, Avro's JSON mapping of bytes: ISO-8859-1 text, every value type-checked).
The rows then become one Arrow array in one ``pyarrow.array`` call. A value that does not
decode is a null row, reported back to the caller (which logs once per task).
"""

from __future__ import annotations

import datetime
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "DECODED_TYPES",
    "DecodeReport",
    "UnsupportedSchema",
    "ValueDecoder",
    "ValueSchema",
    "arrow_type",
]

#: Schema types whose values are decoded into columns.
DECODED_TYPES = ("AVRO", "JSON")

_PRIMITIVE: dict[str, pa.DataType] = {
    "null": pa.null(),
    "boolean": pa.bool_(),
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "bytes": pa.binary(),
    "string": pa.string(),
}
#: Logical types kept (fastavro turns them into datetime/date); others are dropped to
#: their underlying type before fastavro sees the schema.
_LOGICAL: dict[tuple[str, str], pa.DataType] = {
    ("long", "timestamp-millis"): pa.timestamp("us", tz="UTC"),
    ("long", "timestamp-micros"): pa.timestamp("us", tz="UTC"),
    ("int", "date"): pa.date32(),
}
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_EPOCH_DAY = datetime.date(1970, 1, 1)


class UnsupportedSchema(ValueError):
    """The topic's Avro schema has a type with no Spark column type."""


@dataclass(frozen=True)
class ValueSchema:
    """The schema values are decoded to: the topic's latest ``(type, definition)`` when
    the read was planned (kept in the ``value`` column's metadata)."""

    type: str
    definition: str

    def arrow_type(self) -> pa.StructType:
        return arrow_type(json.loads(self.definition))


# ------------------------------------------------------------------------------ types


class _Names:
    """Named Avro types (records, enums, fixed) seen so far, by full name."""

    def __init__(self) -> None:
        self.types: dict[str, Any] = {}
        self.open: set[str] = set()  # records being defined (a reference back: recursion)

    @staticmethod
    def full(schema: dict[str, Any], namespace: str | None) -> tuple[str, str | None]:
        name = str(schema["name"])
        ns = schema.get("namespace", namespace)
        if "." in name:
            return name, name.rsplit(".", 1)[0]
        return (f"{ns}.{name}" if ns else name), ns

    def lookup(self, name: str, namespace: str | None) -> Any:
        for candidate in (f"{namespace}.{name}" if namespace else name, name):
            if candidate in self.open:
                raise UnsupportedSchema(f"record {candidate} is recursive")
            if candidate in self.types:
                return self.types[candidate]
        raise UnsupportedSchema(f"unknown Avro type {name!r}")


def _nullable_branch(union: list[Any]) -> Any:
    others = [t for t in union if t != "null"]
    if len(others) != 1:
        raise UnsupportedSchema(
            f"union {json.dumps(union)} has {len(others)} non-null types "
            '(only ["null", T] maps to a Spark column)'
        )
    return others[0]


def _arrow(schema: Any, names: _Names, namespace: str | None) -> pa.DataType:
    if isinstance(schema, list):
        return _arrow(_nullable_branch(schema), names, namespace)
    if isinstance(schema, str):
        if schema in _PRIMITIVE:
            return _PRIMITIVE[schema]
        t: pa.DataType = names.lookup(schema, namespace)
        return t
    if not isinstance(schema, dict) or "type" not in schema:
        raise UnsupportedSchema(f"not an Avro type: {json.dumps(schema)[:80]}")
    kind = schema["type"]
    logical = _LOGICAL.get((kind, schema.get("logicalType", ""))) if isinstance(kind, str) else None
    if logical is not None:
        return logical
    if kind == "record":
        full, ns = names.full(schema, namespace)
        names.open.add(full)
        fields = [pa.field(str(f["name"]), _arrow(f["type"], names, ns)) for f in schema["fields"]]
        names.open.discard(full)
        t = pa.struct(fields)
    elif kind in ("enum", "fixed"):
        full, _ = names.full(schema, namespace)
        t = pa.string() if kind == "enum" else pa.binary()
    elif kind == "array":
        return pa.list_(pa.field("element", _arrow(schema["items"], names, namespace)))
    elif kind == "map":
        return pa.map_(pa.string(), _arrow(schema["values"], names, namespace))
    else:
        return _arrow(kind, names, namespace)  # {"type": "string"} and the like
    names.types[full] = t
    return t


def arrow_type(schema: Any) -> pa.StructType:
    """The Arrow struct type of an Avro record schema (a parsed JSON document)."""
    if not isinstance(schema, dict) or schema.get("type") != "record":
        raise UnsupportedSchema("the schema is not an Avro record")
    t = _arrow(schema, _Names(), None)
    assert isinstance(t, pa.StructType)
    return t


def _field(f: dict[str, Any], reader: bool) -> dict[str, Any]:
    out = {**f, "type": _plain(f["type"], reader)}
    t = f["type"]
    if reader and "default" not in f and isinstance(t, list) and t and t[0] == "null":
        out["default"] = None  # a nullable field the writer did not have reads as null
    return out


def _plain(schema: Any, reader: bool = False) -> Any:
    """``schema`` for fastavro: without the logical types this module does not keep
    (fastavro would turn decimals and uuids into objects Arrow does not take); as the
    ``reader`` schema, nullable fields without a default get null as theirs (as JSON
    values read: a field an older version did not have is null)."""
    if isinstance(schema, list):
        return [_plain(s, reader) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: _plain(v, reader) if k in ("type", "items", "values") else v for k, v in schema.items()
    }
    if "fields" in schema:
        out["fields"] = [_field(f, reader) for f in schema["fields"]]
    kind = out.get("type")
    if "logicalType" in out and (kind, out["logicalType"]) not in _LOGICAL:
        del out["logicalType"]
    return out


# ------------------------------------------------------------------------------ JSON


class _Bad(ValueError):
    @classmethod
    def expected(cls, what: str, value: Any) -> _Bad:
        """``expected WHAT, got VALUE`` (VALUE as JSON, cut at 40 characters)."""
        return cls(f"expected {what}, got {json.dumps(value)[:40]}")


def _typed(v: Any, t: type, what: str) -> Any:
    """``v``, which must be of type ``t`` exactly (a bool is no int here)."""
    if type(v) is not t:
        raise _Bad.expected(what, v)
    return v


Convert = Callable[[Any], Any]


def _check(ok: Callable[[Any], bool], what: str) -> Convert:
    def convert(v: Any) -> Any:
        if not ok(v):
            raise _Bad.expected(what, v)
        return v

    return convert


def _int_range(bits: int) -> Callable[[Any], bool]:
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    return lambda v: type(v) is int and lo <= v < hi


def _number(v: Any) -> Any:
    if type(v) is float or type(v) is int:
        return v
    raise _Bad.expected("a number", v)


def _latin1(v: Any) -> Any:
    try:
        return _typed(v, str, "bytes as ISO-8859-1 text").encode("latin-1")
    except UnicodeEncodeError as exc:
        raise _Bad(f"bytes text is not ISO-8859-1: {exc}") from None


def _millis(v: Any) -> Any:
    return _EPOCH + datetime.timedelta(milliseconds=_typed(v, int, "milliseconds since the epoch"))


def _micros(v: Any) -> Any:
    return _EPOCH + datetime.timedelta(microseconds=_typed(v, int, "microseconds since the epoch"))


def _days(v: Any) -> Any:
    return _EPOCH_DAY + datetime.timedelta(days=_typed(v, int, "days since the epoch"))


_JSON_PRIMITIVE: dict[str, Convert] = {
    "null": _check(lambda v: v is None, "null"),
    "boolean": _check(lambda v: type(v) is bool, "a boolean"),
    "int": _check(_int_range(32), "an int"),
    "long": _check(_int_range(64), "a long"),
    "float": _number,
    "double": _number,
    "bytes": _latin1,
    "string": _check(lambda v: type(v) is str, "a string"),
}
_JSON_LOGICAL: dict[tuple[str, str], Convert] = {
    ("long", "timestamp-millis"): _millis,
    ("long", "timestamp-micros"): _micros,
    ("int", "date"): _days,
}


def _json(schema: Any, names: dict[str, Convert], namespace: str | None) -> Convert:
    """A converter of one JSON value of Avro type ``schema`` to what Arrow takes."""
    if isinstance(schema, list):
        inner = _json(_nullable_branch(schema), names, namespace)
        return lambda v: None if v is None else inner(v)
    if isinstance(schema, str):
        if schema in _JSON_PRIMITIVE:
            return _JSON_PRIMITIVE[schema]
        for candidate in (f"{namespace}.{schema}" if namespace else schema, schema):
            if candidate in names:
                return names[candidate]
        raise UnsupportedSchema(f"unknown Avro type {schema!r}")
    kind = schema["type"]
    logical = (
        _JSON_LOGICAL.get((kind, schema.get("logicalType", ""))) if isinstance(kind, str) else None
    )
    if logical is not None:
        return logical
    if kind == "record":
        full, ns = _Names.full(schema, namespace)
        fields: list[tuple[str, Convert, Any]] = []
        for f in schema["fields"]:
            convert = _json(f["type"], names, ns)
            default = f.get("default")
            if default is not None:
                try:
                    default = convert(default)
                except _Bad:
                    default = None
            fields.append((str(f["name"]), convert, default))

        def record(v: Any) -> Any:
            v = _typed(v, dict, "an object")
            return {
                name: convert(v[name]) if name in v else default
                for name, convert, default in fields
            }

        names[full] = record
        return record
    if kind == "enum":
        full, _ = _Names.full(schema, namespace)
        symbols = frozenset(schema.get("symbols", ()))
        names[full] = _check(lambda v: type(v) is str and v in symbols, f"one of {sorted(symbols)}")
        return names[full]
    if kind == "fixed":
        full, _ = _Names.full(schema, namespace)
        names[full] = _latin1
        return _latin1
    if kind == "array":
        item = _json(schema["items"], names, namespace)
        return lambda v: [item(x) for x in _typed(v, list, "an array")]
    if kind == "map":
        value = _json(schema["values"], names, namespace)
        return lambda v: {k: value(x) for k, x in _typed(v, dict, "an object (map)").items()}
    return _json(kind, names, namespace)


# ------------------------------------------------------------------------------ decoding


@dataclass
class DecodeReport:
    """Values that did not decode in one :meth:`ValueDecoder.decode` call."""

    failed: int = 0
    #: (row index in the input, schema version, error) of the first failure
    first: tuple[int, int, str] | None = None

    def add(self, row: int, version: int, error: BaseException) -> None:
        self.failed += 1
        if self.first is None:
            self.first = (row, version, f"{type(error).__name__}: {error}")


#: ``writer(header_version)``: the (type, definition) values with that batch-header
#: schema version were written with; None when unknown (decoded with the reader's).
WriterLookup = Callable[[int], "tuple[str, str] | None"]


@dataclass
class ValueDecoder:
    """Decodes binary values into :attr:`type` (a struct), per writer schema version."""

    schema: ValueSchema
    type: pa.StructType = field(init=False)
    _reader: Any = field(init=False, default=None)
    _json_convert: Convert | None = field(init=False, default=None)
    _decoders: dict[int, Callable[[list[Any], list[Any], int, int, DecodeReport], None]] = field(
        init=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        self.type = self.schema.arrow_type()

    def _avro_reader(self) -> Any:
        if self._reader is None:
            import fastavro

            self._reader = fastavro.parse_schema(
                _plain(json.loads(self.schema.definition), reader=True)
            )
        return self._reader

    def _json(self) -> Convert:
        if self._json_convert is None:
            self._json_convert = _json(json.loads(self.schema.definition), {}, None)
        return self._json_convert

    def _decoder_for(
        self, version: int, writer: WriterLookup
    ) -> Callable[[list[Any], list[Any], int, int, DecodeReport], None]:
        found = self._decoders.get(version)
        if found is not None:
            return found
        written = writer(version) if version > 0 else None
        kind, definition = written or (self.schema.type, self.schema.definition)
        if kind == "AVRO":
            from fastavro import parse_schema, schemaless_reader

            reader = self._avro_reader()
            writer_schema = (
                reader
                if definition == self.schema.definition
                else parse_schema(_plain(json.loads(definition)))
            )
            resolve = None if writer_schema is reader else reader

            def avro(raw: list[Any], out: list[Any], lo: int, v: int, report: DecodeReport) -> None:
                for i, data in enumerate(raw):
                    try:
                        buf = io.BytesIO(data)
                        row = schemaless_reader(buf, writer_schema, resolve)
                        if buf.tell() != len(data):
                            raise ValueError(f"{len(data) - buf.tell()} bytes left over")
                    except Exception as exc:
                        report.add(lo + i, v, exc)
                        row = None
                    out.append(row)

            self._decoders[version] = avro
            return avro
        convert = self._json()

        def from_json(
            raw: list[Any], out: list[Any], lo: int, v: int, report: DecodeReport
        ) -> None:
            loads = json.loads
            for i, data in enumerate(raw):
                try:
                    row = convert(loads(data))
                except (ValueError, _Bad, RecursionError) as exc:
                    report.add(lo + i, v, exc)
                    row = None
                out.append(row)

        self._decoders[version] = from_json
        return from_json

    def decode(
        self, values: pa.Array, versions: pa.Array, writer: WriterLookup
    ) -> tuple[pa.StructArray, DecodeReport]:
        """``values`` (binary) written with batch-header schema ``versions`` (int32, one
        per value) as a struct array of the reader type; null rows where a value does
        not decode."""
        report = DecodeReport()
        n = len(values)
        if n == 0:
            return pa.array([], self.type), report
        rows: list[Any] = []
        runs = pc.run_end_encode(versions)
        ends = runs.run_ends.to_pylist()
        kinds = runs.values.to_pylist()
        lo = 0
        for end, version in zip(ends, kinds, strict=True):
            raw = values.slice(lo, end - lo).to_pylist()
            self._decoder_for(version, writer)(raw, rows, lo, version, report)
            lo = end
        return self._to_arrow(rows, versions, report), report

    def _to_arrow(self, rows: list[Any], versions: pa.Array, report: DecodeReport) -> Any:
        try:
            return pa.array(rows, self.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            pass
        # some row does not fit the type (a JSON number out of float range...): find it
        vs = versions.to_pylist()
        for i, row in enumerate(rows):
            if row is None:
                continue
            try:
                pa.array([row], self.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
                report.add(i, vs[i], exc)
                rows[i] = None
        return pa.array(rows, self.type)

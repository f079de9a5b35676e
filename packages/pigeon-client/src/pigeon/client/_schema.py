"""Schemas as ``pulsar.schema`` defines them: Record classes, field types, and the schemas
that encode and decode message values.

A :class:`Record` subclass declares its fields as class attributes::

    class User(Record):
        name = String(required=True)
        age = Integer()
        tags = Array(String())

As Pulsar's Python client does, a field is nullable (Avro ``["null", T]``) unless
``required=True``; its Python default is ``default`` (None unless given); the Avro schema
carries that default only with ``required_default=True`` (needed for a field added or
removed under BACKWARD/FORWARD compatibility).  Fields are listed in the schema sorted by
name; the record's Avro name is the class name (``_avro_namespace`` sets a namespace).

:class:`JsonSchema` and :class:`AvroSchema` are both defined by the record's Avro schema
(as in Pulsar): JSON values are the record as a JSON object, Avro values Avro's binary
encoding (fastavro, the parsed schema kept per schema object, so nothing is parsed per
message).  A consumer decodes each message with the version it was written with: Avro
resolves the writer's schema to the consumer's record (added fields take their
defaults, removed ones are dropped).
"""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Callable
from typing import Any, ClassVar

from pigeon.core.errors import InvalidArgument, SchemaSerializationError

__all__ = [
    "Array",
    "AvroSchema",
    "Boolean",
    "Bytes",
    "BytesSchema",
    "Double",
    "Field",
    "Float",
    "Integer",
    "JsonSchema",
    "Long",
    "Map",
    "Record",
    "Schema",
    "String",
    "StringSchema",
]

_MISSING = object()


class Field:
    """One field of a Record: an Avro type with Pulsar's ``default``, ``required`` and
    ``required_default``."""

    avro_type: str = ""
    python_types: tuple[type, ...] = ()

    def __init__(
        self, default: Any = None, required: bool = False, required_default: bool = False
    ) -> None:
        self._default = default
        self._required = required
        self._required_default = required_default
        if default is not None:
            self.validate(default, "default")

    def default(self) -> Any:
        d = self._default
        # a list, dict or record of its own for each record (never shared between them)
        return copy.deepcopy(d) if isinstance(d, list | dict | Record) else d

    def required_default(self) -> bool:
        return self._required_default

    def type_schema(self, names: set[str]) -> Any:
        """The Avro type of the field's values (without the null of a nullable field)."""
        return self.avro_type

    def schema(self, names: set[str]) -> Any:
        t = self.type_schema(names)
        if self._required:
            return t
        # Avro takes a union's default from its first branch.
        return [t, "null"] if self._required_default and self._default is not None else ["null", t]

    def validate(self, value: Any, name: str) -> Any:
        """``value`` as the field holds it; SchemaSerializationError if it cannot."""
        if value is None:
            if self._required:
                raise SchemaSerializationError(f"field {name!r} is required")
            return None
        if not isinstance(value, self.python_types) or (
            isinstance(value, bool) and bool not in self.python_types
        ):
            raise SchemaSerializationError(
                f"field {name!r} must be {self.avro_type}, got {type(value).__name__}"
            )
        return value

    # Values as JSON carries them (Avro's JSON mapping for bytes: ISO-8859-1 text).
    def to_json(self, value: Any) -> Any:
        return value

    def from_json(self, value: Any) -> Any:
        return value

    def from_avro(self, value: Any) -> Any:
        return value


class Boolean(Field):
    avro_type = "boolean"
    python_types = (bool,)


class Integer(Field):
    avro_type = "int"
    python_types = (int,)

    def validate(self, value: Any, name: str) -> Any:
        value = super().validate(value, name)
        if value is not None and not -(2**31) <= value < 2**31:
            raise SchemaSerializationError(f"field {name!r}: {value} does not fit an int")
        return value


class Long(Field):
    avro_type = "long"
    python_types = (int,)

    def validate(self, value: Any, name: str) -> Any:
        value = super().validate(value, name)
        if value is not None and not -(2**63) <= value < 2**63:
            raise SchemaSerializationError(f"field {name!r}: {value} does not fit a long")
        return value


class Float(Field):
    avro_type = "float"
    python_types = (float, int)


class Double(Field):
    avro_type = "double"
    python_types = (float, int)


class String(Field):
    avro_type = "string"
    python_types = (str,)


class Bytes(Field):
    avro_type = "bytes"
    python_types = (bytes,)

    def to_json(self, value: Any) -> Any:
        return None if value is None else value.decode("latin-1")

    def from_json(self, value: Any) -> Any:
        return None if value is None else value.encode("latin-1")


class Array(Field):
    """A list of ``array_type`` (a Field or a Record)."""

    avro_type = "array"
    python_types = (list,)

    def __init__(
        self,
        array_type: Field | Record,
        default: Any = None,
        required: bool = False,
        required_default: bool = False,
    ) -> None:
        self.array_type = _as_field(array_type)
        super().__init__(default, required, required_default)

    def type_schema(self, names: set[str]) -> Any:
        return {"type": "array", "items": self.array_type.type_schema(names)}

    def validate(self, value: Any, name: str) -> Any:
        value = super().validate(value, name)
        if value is None:
            return None
        item = self.array_type
        return [item.validate(v, f"{name}[]") for v in value]

    def to_json(self, value: Any) -> Any:
        return None if value is None else [self.array_type.to_json(v) for v in value]

    def from_json(self, value: Any) -> Any:
        return None if value is None else [self.array_type.from_json(v) for v in value]

    def from_avro(self, value: Any) -> Any:
        return None if value is None else [self.array_type.from_avro(v) for v in value]


class Map(Field):
    """A dict of str to ``value_type`` (a Field or a Record)."""

    avro_type = "map"
    python_types = (dict,)

    def __init__(
        self,
        value_type: Field | Record,
        default: Any = None,
        required: bool = False,
        required_default: bool = False,
    ) -> None:
        self.value_type = _as_field(value_type)
        super().__init__(default, required, required_default)

    def type_schema(self, names: set[str]) -> Any:
        return {"type": "map", "values": self.value_type.type_schema(names)}

    def validate(self, value: Any, name: str) -> Any:
        value = super().validate(value, name)
        if value is None:
            return None
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise SchemaSerializationError(f"field {name!r}: map keys must be str")
            out[k] = self.value_type.validate(v, f"{name}[{k!r}]")
        return out

    def to_json(self, value: Any) -> Any:
        return None if value is None else {k: self.value_type.to_json(v) for k, v in value.items()}

    def from_json(self, value: Any) -> Any:
        if value is None:
            return None
        return {k: self.value_type.from_json(v) for k, v in value.items()}

    def from_avro(self, value: Any) -> Any:
        if value is None:
            return None
        return {k: self.value_type.from_avro(v) for k, v in value.items()}


class _RecordField(Field):
    """A field whose values are records of ``record_class``."""

    def __init__(self, record_class: type[Record], required: bool, default: Any) -> None:
        self.record_class = record_class
        self.python_types = (record_class,)
        self.avro_type = record_class.__name__
        super().__init__(default, required, False)

    def type_schema(self, names: set[str]) -> Any:
        return self.record_class._avro_schema(names)

    def to_json(self, value: Any) -> Any:
        return None if value is None else value._to_json()

    def from_json(self, value: Any) -> Any:
        return None if value is None else self.record_class._from_json(value)

    def from_avro(self, value: Any) -> Any:
        return None if value is None else self.record_class._from_avro(value)


def _as_field(t: Field | Record | type[Record]) -> Field:
    if isinstance(t, Field):
        return t
    if isinstance(t, Record):
        return t.__class__._as_field(t)
    if isinstance(t, type) and issubclass(t, Record):
        return _RecordField(t, True, None)
    raise InvalidArgument(f"not a schema field type: {t!r}")


class _RecordMeta(type):
    def __new__(mcs, name: str, bases: tuple[type, ...], ns: dict[str, Any]) -> _RecordMeta:
        fields: dict[str, Field] = {}
        for base in reversed(bases):
            fields.update(getattr(base, "_fields", {}))
        for key, value in list(ns.items()):
            if key.startswith("_"):
                continue
            if isinstance(value, Field) or type(type(value)) is _RecordMeta:
                fields[key] = _as_field(value)
                del ns[key]
        ns["_fields"] = fields
        ns["_sorted"] = tuple(sorted(fields))
        return super().__new__(mcs, name, bases, ns)


class Record(metaclass=_RecordMeta):
    """Base of schema records: keyword constructor, equality and repr over the fields.

    An instance of a Record subclass used as a field declaration makes a nested record
    field (``address = Address()``, ``required`` and ``default`` as keywords).
    """

    _fields: ClassVar[dict[str, Field]]
    _sorted: ClassVar[tuple[str, ...]]
    _avro_namespace: ClassVar[str | None] = None

    def __init__(self, *args: Any, required: bool = False, default: Any = None, **kwargs: Any):
        if args:
            raise InvalidArgument(f"{type(self).__name__} takes keyword arguments only")
        unknown = sorted(set(kwargs) - set(self._fields))
        if unknown:
            raise InvalidArgument(
                f"{type(self).__name__} has no field {', '.join(map(repr, unknown))}"
            )
        self.__dict__["_declared"] = (required, default)
        for name, f in self._fields.items():
            self.__dict__[name] = kwargs[name] if name in kwargs else f.default()

    @classmethod
    def _as_field(cls, declared: Record) -> Field:
        required, default = declared.__dict__["_declared"]
        return _RecordField(cls, required, default)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self._fields)

    def __hash__(self) -> int:
        return hash(tuple(repr(getattr(self, n)) for n in self._sorted))

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._fields)
        return f"{type(self).__name__}({inner})"

    def __str__(self) -> str:
        return repr(self)

    @classmethod
    def _avro_schema(cls, names: set[str] | None = None) -> Any:
        names = set() if names is None else names
        full = f"{cls._avro_namespace}.{cls.__name__}" if cls._avro_namespace else cls.__name__
        if full in names:
            return full
        names.add(full)
        schema: dict[str, Any] = {"type": "record", "name": cls.__name__}
        if cls._avro_namespace:
            schema["namespace"] = cls._avro_namespace
        fields = []
        for name in cls._sorted:
            f = cls._fields[name]
            entry: dict[str, Any] = {"name": name, "type": f.schema(names)}
            if f.required_default():
                entry["default"] = f.to_json(f.default())
            fields.append(entry)
        schema["fields"] = fields
        return schema

    @classmethod
    def schema(cls) -> dict[str, Any]:
        """The record's Avro schema (a dict), as Pulsar's ``Record.schema()``."""
        result: dict[str, Any] = cls._avro_schema()
        return result

    def _checked(self) -> dict[str, Any]:
        """The fields as Avro (fastavro) takes them, checked against their types."""
        out = {}
        for name, f in self._fields.items():
            value = f.validate(self.__dict__.get(name), name)
            if isinstance(f, _RecordField) and value is not None:
                value = value._checked()
            elif isinstance(f, Array) and isinstance(f.array_type, _RecordField) and value:
                value = [v._checked() for v in value]
            elif isinstance(f, Map) and isinstance(f.value_type, _RecordField) and value:
                value = {k: v._checked() for k, v in value.items()}
            out[name] = value
        return out

    def _to_json(self) -> dict[str, Any]:
        return {
            name: f.to_json(f.validate(self.__dict__.get(name), name))
            for name, f in self._fields.items()
        }

    @classmethod
    def _from_json(cls, doc: dict[str, Any]) -> Record:
        record = cls.__new__(cls)
        d = record.__dict__
        for name, f in cls._fields.items():
            d[name] = f.from_json(doc[name]) if name in doc else f.default()
        return record

    @classmethod
    def _from_avro(cls, doc: dict[str, Any]) -> Record:
        record = cls.__new__(cls)
        d = record.__dict__
        for name, f in cls._fields.items():
            d[name] = f.from_avro(doc[name]) if name in doc else f.default()
        return record


# --------------------------------------------------------------------------- schemas


class Schema:
    """What a producer encodes values with and a consumer decodes them with.

    ``schema_type`` and ``definition`` are what the topic's registry stores (Pulsar's
    SchemaInfo type and schema).
    """

    schema_type: ClassVar[str] = "BYTES"

    def definition(self) -> str:
        return ""

    def encode(self, value: Any) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes) -> Any:
        raise NotImplementedError

    def decoder_for(self, writer_definition: str | None) -> Callable[[bytes], Any]:
        """The decoder of values written with ``writer_definition`` (None: this schema's
        own version)."""
        return self.decode

    @property
    def needs_writer_schema(self) -> bool:
        """True if decoding a value needs the schema it was written with (Avro)."""
        return False

    def schema_info(self) -> dict[str, str]:
        return {"type": self.schema_type, "definition": self.definition()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class BytesSchema(Schema):
    """Values are bytes, as without a schema (no schema is registered)."""

    def encode(self, value: Any) -> bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise SchemaSerializationError(f"BytesSchema takes bytes, not {type(value).__name__}")
        return bytes(value)

    def decode(self, data: bytes) -> Any:
        return data


class StringSchema(Schema):
    """Values are str, sent as UTF-8."""

    schema_type = "STRING"

    def encode(self, value: Any) -> bytes:
        if not isinstance(value, str):
            raise SchemaSerializationError(f"StringSchema takes str, not {type(value).__name__}")
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SchemaSerializationError(f"value is not valid Unicode: {exc}") from None

    def decode(self, data: bytes) -> Any:
        try:
            return bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SchemaSerializationError(f"message is not UTF-8: {exc}") from None


class _RecordSchema(Schema):
    def __init__(self, record_cls: type[Record]) -> None:
        if not (isinstance(record_cls, type) and issubclass(record_cls, Record)):
            raise InvalidArgument(
                f"{type(self).__name__} takes a Record subclass, got {record_cls!r}"
            )
        self.record_cls = record_cls
        self._schema = record_cls.schema()
        self._definition = json.dumps(self._schema, separators=(",", ":"))

    def definition(self) -> str:
        return self._definition

    def _record_of(self, value: Any) -> Record:
        if not isinstance(value, self.record_cls):
            raise SchemaSerializationError(
                f"{type(self).__name__}({self.record_cls.__name__}) takes a "
                f"{self.record_cls.__name__}, not {type(value).__name__}"
            )
        return value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.record_cls.__name__})"


class JsonSchema(_RecordSchema):
    """Values are records sent as JSON objects; the registry holds the Avro schema."""

    schema_type = "JSON"

    def encode(self, value: Any) -> bytes:
        return json.dumps(self._record_of(value)._to_json(), separators=(",", ":")).encode()

    def decode(self, data: bytes) -> Any:
        try:
            doc = json.loads(bytes(data))
        except ValueError as exc:
            raise SchemaSerializationError(f"message is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise SchemaSerializationError("message is not a JSON object")
        return self.record_cls._from_json(doc)


class AvroSchema(_RecordSchema):
    """Values are records in Avro's binary encoding (fastavro)."""

    schema_type = "AVRO"

    def __init__(self, record_cls: type[Record]) -> None:
        super().__init__(record_cls)
        import fastavro

        self._fastavro = fastavro
        self._parsed = fastavro.parse_schema(self._schema)
        self._readers: dict[str, Callable[[bytes], Any]] = {}

    @property
    def needs_writer_schema(self) -> bool:
        return True

    def encode(self, value: Any) -> bytes:
        record = self._record_of(value)._checked()
        out = io.BytesIO()
        try:
            self._fastavro.schemaless_writer(out, self._parsed, record)
        except (ValueError, TypeError) as exc:
            raise SchemaSerializationError(f"value does not fit the schema: {exc}") from None
        return out.getvalue()

    def decode(self, data: bytes) -> Any:
        return self.decoder_for(None)(data)

    def decoder_for(self, writer_definition: str | None) -> Callable[[bytes], Any]:
        key = writer_definition or ""
        decoder = self._readers.get(key)
        if decoder is None:
            fastavro = self._fastavro
            reader = self._parsed
            writer = (
                reader
                if not writer_definition or writer_definition == self._definition
                else fastavro.parse_schema(json.loads(writer_definition))
            )
            make = self.record_cls._from_avro

            def decoder(data: bytes) -> Any:
                try:
                    doc = fastavro.schemaless_reader(io.BytesIO(data), writer, reader)
                except Exception as exc:
                    raise SchemaSerializationError(f"message does not decode: {exc}") from None
                return make(doc)

            self._readers[key] = decoder
        return decoder

"""Schema compatibility: Avro reader/writer resolution and Pulsar's strategies, no I/O.

A schema is :class:`SchemaData` (Pulsar's ``SchemaInfo``): a type (``AVRO``, ``JSON``,
``STRING``, ``BYTES``...) and a definition.  AVRO and JSON schemas are both defined by an
Avro record schema (as Pulsar does), and their compatibility is Avro's *schema
resolution*: data written with schema W can be read with schema R when

* primitives are the same, or W promotes to R (int -> long, float, double; long ->
  float, double; float -> double; string <-> bytes);
* records have the same name (or R lists W's name in its aliases) and every field of R
  is in W (by name or alias; the types resolve) or has a default; W's extra fields are
  skipped;
* enums: every symbol of W is in R, unless R has a default;
* arrays and maps: their items / values resolve; fixed: same name and size;
* unions: every branch of W resolves to R (a union: some branch of it); W not a union
  and R a union: some branch of R reads W.

Strategies (Pulsar's ``SchemaCompatibilityStrategy``, snake_case): ``backward`` — the
new schema reads data of the last version; ``forward`` — the last version reads data of
the new schema; ``full`` — both; ``*_transitive`` — against every version, not only the
last; ``always_compatible`` (and Confluent's ``none``) — no check;
``always_incompatible`` — no new version at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from pigeon.core.errors import IncompatibleSchema, InvalidSchemaData

__all__ = [
    "COMPATIBILITY_STRATEGIES",
    "DEFAULT_STRATEGY",
    "SCHEMA_TYPES",
    "CompatibilityStrategy",
    "SchemaData",
    "SchemaType",
    "check_compatible",
    "check_readable",
    "parse_avro",
    "resolution_error",
]

#: Pulsar's SchemaCompatibilityStrategy values (snake_case); ``none`` is Confluent's name
#: for always_compatible, accepted as such
CompatibilityStrategy = Literal[
    "always_compatible",
    "always_incompatible",
    "backward",
    "forward",
    "full",
    "backward_transitive",
    "forward_transitive",
    "full_transitive",
    "none",
]
COMPATIBILITY_STRATEGIES: tuple[str, ...] = get_args(CompatibilityStrategy)
#: Pulsar's broker default (``schemaCompatibilityStrategy=FULL``)
DEFAULT_STRATEGY = "full"
#: the schema types a producer or consumer may declare (Pulsar's names)
SchemaType = Literal["BYTES", "STRING", "JSON", "AVRO"]
SCHEMA_TYPES: tuple[str, ...] = get_args(SchemaType)
_RECORD_TYPES = ("JSON", "AVRO")

_PRIMITIVES = frozenset(("null", "boolean", "int", "long", "float", "double", "bytes", "string"))
_PROMOTIONS = {
    "int": frozenset(("long", "float", "double")),
    "long": frozenset(("float", "double")),
    "float": frozenset(("double",)),
    "string": frozenset(("bytes",)),
    "bytes": frozenset(("string",)),
}


@dataclass(frozen=True)
class SchemaData:
    """One schema as producers, consumers and the registry exchange it."""

    type: str
    definition: str = ""
    properties: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.type not in SCHEMA_TYPES:
            raise InvalidSchemaData(
                f"schema type must be one of {', '.join(SCHEMA_TYPES)}, got {self.type!r}"
            )
        if self.type in _RECORD_TYPES:
            parse_avro(self.definition)

    @property
    def is_record(self) -> bool:
        return self.type in _RECORD_TYPES

    def same_as(self, other: SchemaData) -> bool:
        """The same schema (type and definition, JSON compared as parsed)."""
        if self.type != other.type:
            return False
        if not self.is_record:
            return True
        return bool(json.loads(self.definition) == json.loads(other.definition))


def parse_avro(definition: str) -> Any:
    """The parsed JSON of an Avro record schema; InvalidSchemaData if it is not one."""
    try:
        doc = json.loads(definition)
    except RecursionError:
        raise InvalidSchemaData(_TOO_DEEP) from None
    except ValueError as exc:
        raise InvalidSchemaData(f"schema definition is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("type") != "record":
        raise InvalidSchemaData("schema definition must be an Avro record schema")
    _Names().walk(doc, "")
    return doc


#: how deeply types may nest in a schema (the checks recurse through them)
MAX_SCHEMA_DEPTH = 100
_TOO_DEEP = f"schema definition is nested too deeply (more than {MAX_SCHEMA_DEPTH} levels)"


def _check_aliases(node: dict[str, Any], what: str) -> None:
    aliases = node.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise InvalidSchemaData(f"the aliases of {what} must be a list of names")


class _Names:
    """Named types (records, enums, fixed) of one schema by full name."""

    def __init__(self) -> None:
        self.types: dict[str, dict[str, Any]] = {}

    def walk(self, schema: Any, namespace: str, depth: int = 0) -> None:
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidSchemaData(_TOO_DEEP)
        depth += 1
        if isinstance(schema, list):
            for branch in schema:
                self.walk(branch, namespace, depth)
            return
        if isinstance(schema, str):
            if schema not in _PRIMITIVES and self.lookup(schema, namespace) is None:
                raise InvalidSchemaData(f"schema names an unknown type {schema!r}")
            return
        if not isinstance(schema, dict) or "type" not in schema:
            raise InvalidSchemaData(f"not an Avro schema: {schema!r}")
        kind = schema["type"]
        if kind in ("record", "error", "enum", "fixed"):
            name = schema.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidSchemaData(f"an Avro {kind} needs a name")
            if not isinstance(schema.get("namespace", ""), str | None):
                raise InvalidSchemaData(f"the namespace of {kind} {name!r} must be a string")
            _check_aliases(schema, f"{kind} {name!r}")
            full = _full_name(name, schema.get("namespace", namespace))
            self.types[full] = schema
            ns = full.rpartition(".")[0]
            if kind in ("record", "error"):
                fields = schema.get("fields")
                if not isinstance(fields, list):
                    raise InvalidSchemaData(f"record {name!r} needs a list of fields")
                for f in fields:
                    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                        raise InvalidSchemaData(f"record {name!r} has a field without a name")
                    _check_aliases(f, f"field {f['name']!r}")
                    self.walk(f.get("type"), ns, depth)
            elif kind == "enum" and not isinstance(schema.get("symbols"), list):
                raise InvalidSchemaData(f"enum {name!r} needs a list of symbols")
        elif kind == "array":
            self.walk(schema.get("items"), namespace, depth)
        elif kind == "map":
            self.walk(schema.get("values"), namespace, depth)
        else:
            self.walk(kind, namespace, depth)

    def lookup(self, name: str, namespace: str) -> dict[str, Any] | None:
        return self.types.get(_full_name(name, namespace)) or self.types.get(name)


def _full_name(name: str, namespace: str | None) -> str:
    if "." in name or not namespace:
        return name
    return f"{namespace}.{name}"


class _Resolver:
    """Can data written with ``writer`` be read with ``reader``?  One instance per pair."""

    def __init__(self, reader: Any, writer: Any) -> None:
        self.rnames = _Names()
        self.rnames.walk(reader, "")
        self.wnames = _Names()
        self.wnames.walk(writer, "")
        self.seen: set[tuple[str, str]] = set()

    def _deref(self, schema: Any, names: _Names, ns: str) -> tuple[Any, str]:
        """(the schema with a named reference replaced by its definition, its namespace)."""
        if isinstance(schema, str) and schema not in _PRIMITIVES:
            found = names.lookup(schema, ns)
            assert found is not None  # checked by walk
            full = _full_name(found["name"], found.get("namespace", ns))
            return found, full.rpartition(".")[0]
        if isinstance(schema, dict) and schema.get("type") in ("record", "error", "enum", "fixed"):
            full = _full_name(schema["name"], schema.get("namespace", ns))
            return schema, full.rpartition(".")[0]
        if isinstance(schema, dict) and schema.get("type") not in ("array", "map"):
            return self._deref(schema["type"], names, ns)
        return schema, ns

    def check(self, r: Any, w: Any, path: str, rns: str = "", wns: str = "") -> str | None:
        """None if ``w`` resolves to ``r``, else why not (naming ``path``)."""
        r, rns = self._deref(r, self.rnames, rns)
        w, wns = self._deref(w, self.wnames, wns)
        if isinstance(w, list):
            for branch in w:
                why = self.check(r, branch, path, rns, wns)
                if why is not None:
                    return why
            return None
        if isinstance(r, list):
            for branch in r:
                if self.check(branch, w, path, rns, wns) is None:
                    return None
            return f"{path}: no branch of the reader's union {_describe(r)} reads {_describe(w)}"
        rt, wt = _kind(r), _kind(w)
        if rt != wt:
            if isinstance(r, str) and isinstance(w, str) and r in _PROMOTIONS.get(w, ()):
                return None
            return f"{path}: type changed from {wt} to {rt}"
        if isinstance(r, str):
            return None
        if rt in ("record", "error"):
            return self._record(r, w, path, rns, wns)
        if rt == "enum":
            if not _names_match(r, w):
                return f"{path}: enum name changed from {w['name']!r} to {r['name']!r}"
            missing = [s for s in w["symbols"] if s not in r["symbols"]]
            if missing and "default" not in r:
                return f"{path}: enum symbol {missing[0]!r} removed (the reader has no default)"
            return None
        if rt == "fixed":
            if not _names_match(r, w) or r.get("size") != w.get("size"):
                return f"{path}: fixed type {w['name']!r} changed"
            return None
        if rt == "array":
            return self.check(r["items"], w["items"], f"{path}[]", rns, wns)
        if rt == "map":
            return self.check(r["values"], w["values"], f"{path}{{}}", rns, wns)
        return None

    def _record(self, r: Any, w: Any, path: str, rns: str, wns: str) -> str | None:
        if not _names_match(r, w):
            return f"{path or 'record'}: record name changed from {w['name']!r} to {r['name']!r}"
        key = (_full_name(r["name"], rns), _full_name(w["name"], wns))
        if key in self.seen:  # a recursive type: assumed to resolve while checking it
            return None
        self.seen.add(key)
        written = {f["name"]: f for f in w["fields"]}
        for f in w["fields"]:
            for alias in f.get("aliases", ()):
                written.setdefault(alias, f)
        for rf in r["fields"]:
            name = rf["name"]
            wf = written.get(name) or next(
                (written[a] for a in rf.get("aliases", ()) if a in written), None
            )
            where = f"{path}.{name}" if path else name
            if wf is None:
                if "default" not in rf:
                    return f"field {where!r} has no default"
                continue
            why = self.check(rf["type"], wf["type"], f"field {where!r}", rns, wns)
            if why is not None:
                return why
        return None


def _kind(schema: Any) -> str:
    return schema if isinstance(schema, str) else str(schema["type"])


def _names_match(r: dict[str, Any], w: dict[str, Any]) -> bool:
    short = str(w["name"]).rpartition(".")[2]
    names = {
        str(r["name"]).rpartition(".")[2],
        *(str(a).rpartition(".")[2] for a in r.get("aliases", ())),
    }
    return short in names


def _describe(schema: Any) -> str:
    if isinstance(schema, list):
        return "[" + ", ".join(_describe(b) for b in schema) + "]"
    if isinstance(schema, str):
        return schema
    return str(schema.get("name") or schema.get("type"))


def resolution_error(reader: str, writer: str) -> str | None:
    """Why data written with Avro schema ``writer`` cannot be read with ``reader`` (both
    JSON text); None when it can."""
    return _Resolver(parse_avro(reader), parse_avro(writer)).check(
        parse_avro(reader), parse_avro(writer), ""
    )


def _pair_error(reader: SchemaData, writer: SchemaData) -> str | None:
    if reader.type != writer.type:
        return f"schema type changed from {writer.type} to {reader.type}"
    if not reader.is_record:
        return None
    return resolution_error(reader.definition, writer.definition)


def check_compatible(
    new: SchemaData, versions: list[tuple[int, SchemaData]], strategy: str
) -> None:
    """Raise :class:`IncompatibleSchema` unless ``new`` may follow ``versions`` (oldest
    first, ``(version, schema)``) under ``strategy``."""
    if strategy not in COMPATIBILITY_STRATEGIES:
        raise InvalidSchemaData(
            f"schema_compatibility_strategy must be one of "
            f"{', '.join(COMPATIBILITY_STRATEGIES)}, got {strategy!r}"
        )
    if not versions or strategy in ("always_compatible", "none"):
        return
    label = strategy.upper()
    if strategy == "always_incompatible":
        last = versions[-1][0]
        raise IncompatibleSchema(
            f"schema is not compatible with version {last} under {label}: "
            "no new schema version is allowed"
        )
    against = versions if strategy.endswith("_transitive") else versions[-1:]
    base = strategy.removesuffix("_transitive")
    for version, old in reversed(against):
        # (reader, writer, what it means when the reader cannot read the writer's data)
        directions = []
        if base in ("backward", "full"):
            directions.append((new, old, "the new schema cannot read its data"))
        if base in ("forward", "full"):
            directions.append((old, new, f"version {version} cannot read the new schema's data"))
        for reader, writer, what in directions:
            why = _pair_error(reader, writer)
            if why is not None:
                raise IncompatibleSchema(
                    f"schema is not compatible with version {version} under {label}: {what}: {why}"
                )


def check_readable(
    reader: SchemaData, versions: list[tuple[int, SchemaData]], strategy: str
) -> None:
    """A consumer's schema ``reader`` (not a stored version) must read the topic's data:
    the last version, or every version under a ``*_transitive`` strategy."""
    if not versions or strategy in ("always_compatible", "none"):
        return
    label = strategy.upper()
    against = versions if strategy.endswith("_transitive") else versions[-1:]
    for version, old in reversed(against):
        why = _pair_error(reader, old)
        if why is not None:
            raise IncompatibleSchema(
                f"consumer schema cannot read version {version} under {label}: {why}"
            )

"""Schema compatibility as pure functions: Avro resolution and every strategy."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pigeon.broker._schema_compat import (
    COMPATIBILITY_STRATEGIES,
    SchemaData,
    check_compatible,
    check_readable,
    resolution_error,
)
from pigeon.core.errors import IncompatibleSchema, InvalidSchemaData


def record(*fields: dict[str, Any], name: str = "User") -> str:
    return json.dumps({"type": "record", "name": name, "fields": list(fields)})


def avro(*fields: dict[str, Any], name: str = "User") -> SchemaData:
    return SchemaData("AVRO", record(*fields, name=name))


NAME = {"name": "name", "type": "string"}
AGE_INT = {"name": "age", "type": "int"}
AGE_LONG = {"name": "age", "type": "long"}
AGE_DEFAULT = {"name": "age", "type": "int", "default": 0}

V1 = avro(NAME)
ADD_WITH_DEFAULT = avro(NAME, AGE_DEFAULT)  # backward and forward: full
ADD_NO_DEFAULT = avro(NAME, AGE_INT)  # forward only (old readers skip it)
REMOVE_NAME = avro()  # backward only: the new reader ignores name; old ones miss it


@pytest.mark.parametrize(
    ("reader", "writer", "why"),
    [
        (record(NAME), record(NAME), None),
        (record(NAME, AGE_DEFAULT), record(NAME), None),
        (record(NAME, AGE_INT), record(NAME), "field 'age' has no default"),
        (record(NAME), record(NAME, AGE_INT), None),
        (record(AGE_LONG), record(AGE_INT), None),  # int promotes to long
        (record(AGE_INT), record(AGE_LONG), "field 'age': type changed from long to int"),
        (record({"name": "d", "type": "double"}), record({"name": "d", "type": "float"}), None),
        (record({"name": "s", "type": "bytes"}), record({"name": "s", "type": "string"}), None),
        (record({"name": "n", "type": ["null", "int"]}), record(AGE_INT | {"name": "n"}), None),
        (
            record({"name": "n", "type": "int"}),
            record({"name": "n", "type": ["null", "int"]}),
            "field 'n': type changed from null to int",
        ),
        (record(NAME, name="Other"), record(NAME), "record name changed"),
        (
            record({"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"]}}),
            record({"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}}),
            "enum symbol 'B' removed",
        ),
        (
            record({"name": "xs", "type": {"type": "array", "items": "long"}}),
            record({"name": "xs", "type": {"type": "array", "items": "int"}}),
            None,
        ),
        (
            record({"name": "m", "type": {"type": "map", "values": "int"}}),
            record({"name": "m", "type": {"type": "map", "values": "string"}}),
            "field 'm'{}: type changed from string to int",
        ),
        (
            record({"name": "new_name", "type": "string", "aliases": ["name"]}),
            record(NAME),
            None,
        ),
    ],
)
def test_resolution(reader: str, writer: str, why: str | None) -> None:
    found = resolution_error(reader, writer)
    if why is None:
        assert found is None
    else:
        assert found is not None and why in found


def test_nested_and_recursive_records_resolve() -> None:
    node = {
        "type": "record",
        "name": "Node",
        "fields": [{"name": "next", "type": ["null", "Node"]}, {"name": "v", "type": "int"}],
    }
    assert resolution_error(json.dumps(node), json.dumps(node)) is None
    widened = json.loads(json.dumps(node))
    widened["fields"][1]["type"] = "long"
    assert resolution_error(json.dumps(widened), json.dumps(node)) is None
    assert resolution_error(json.dumps(node), json.dumps(widened)) is not None


# (change, strategies that accept it as the next version of [V1])
MATRIX = [
    (ADD_WITH_DEFAULT, {"backward", "forward", "full"}),
    (ADD_NO_DEFAULT, {"forward"}),
    (REMOVE_NAME, {"backward"}),
    (avro({"name": "name", "type": "int"}), set()),
]


@pytest.mark.parametrize("transitive", [False, True])
@pytest.mark.parametrize(("new", "accepted"), MATRIX)
def test_strategy_matrix(new: SchemaData, accepted: set[str], transitive: bool) -> None:
    for base in ("backward", "forward", "full"):
        strategy = f"{base}_transitive" if transitive else base
        if base in accepted:
            check_compatible(new, [(0, V1)], strategy)
        else:
            with pytest.raises(IncompatibleSchema, match=f"version 0 under {strategy.upper()}"):
                check_compatible(new, [(0, V1)], strategy)
    check_compatible(new, [(0, V1)], "always_compatible")
    check_compatible(new, [(0, V1)], "none")
    with pytest.raises(IncompatibleSchema, match="ALWAYS_INCOMPATIBLE"):
        check_compatible(new, [(0, V1)], "always_incompatible")


def test_transitive_checks_every_version() -> None:
    # v0 (name), v1 (name, age=0) , v2 (age=0 only): v2 reads v1's data and v0's
    # (age defaults) -> backward_transitive accepts; forward: v0 cannot read v2 (no name)
    v2 = avro(AGE_DEFAULT)
    history = [(0, V1), (1, ADD_WITH_DEFAULT)]
    check_compatible(v2, history, "backward")
    check_compatible(v2, history, "backward_transitive")
    # v3 brings name back (no default): v2's data has none, so v3 cannot read it
    v3 = avro(AGE_DEFAULT, {"name": "email", "type": "string", "default": ""}, NAME)
    check_compatible(v3, [(0, ADD_WITH_DEFAULT), (1, v2)], "forward")  # v2 reads v3's data
    with pytest.raises(
        IncompatibleSchema, match=r"version 1 under BACKWARD:.*'name' has no default"
    ):
        check_compatible(v3, [(0, ADD_WITH_DEFAULT), (1, v2)], "backward")
    # v0 had a long age, v1 an int one: an int-age schema reads v1 but not v0
    narrowed = [(0, avro(NAME, AGE_LONG)), (1, ADD_WITH_DEFAULT)]
    check_compatible(avro(NAME, AGE_DEFAULT), narrowed, "backward")
    with pytest.raises(IncompatibleSchema, match="version 0 under BACKWARD_TRANSITIVE"):
        check_compatible(avro(NAME, AGE_DEFAULT), narrowed, "backward_transitive")


def test_type_change_and_consumers() -> None:
    with pytest.raises(IncompatibleSchema, match="schema type changed from AVRO to JSON"):
        check_compatible(SchemaData("JSON", V1.definition), [(0, V1)], "full")
    check_compatible(SchemaData("STRING"), [(0, SchemaData("STRING"))], "full")
    check_readable(ADD_WITH_DEFAULT, [(0, V1)], "full")
    with pytest.raises(IncompatibleSchema, match="consumer schema cannot read version 0"):
        check_readable(ADD_NO_DEFAULT, [(0, V1)], "full")


def test_bad_schemas_are_refused() -> None:
    for bad in ("not json", '{"type": "string"}', '{"type": "record", "name": "R"}'):
        with pytest.raises(InvalidSchemaData):
            SchemaData("AVRO", bad)
    with pytest.raises(InvalidSchemaData, match="unknown type"):
        SchemaData("AVRO", record({"name": "x", "type": "Missing"}))
    with pytest.raises(InvalidSchemaData, match="schema type"):
        SchemaData("PROTOBUF", "")
    assert set(COMPATIBILITY_STRATEGIES) >= {"full", "backward_transitive", "none"}


def test_malformed_aliases_and_deep_nesting_are_refused_when_parsed() -> None:
    # accepted once, such a schema broke every later check with a TypeError
    for bad in (
        {"type": "record", "name": "R", "aliases": 5, "fields": []},
        {"type": "record", "name": "R", "aliases": [5], "fields": []},
        {"type": "record", "name": "R", "fields": [{"name": "a", "type": "int", "aliases": 5}]},
        {"type": "record", "name": "R", "namespace": 5, "fields": []},
    ):
        with pytest.raises(InvalidSchemaData):
            SchemaData("AVRO", json.dumps(bad))
    for depth in (300, 5000):  # a RecursionError escaped json.loads and the checks
        nested = '{"type": "array", "items": ' * depth + '"int"' + "}" * depth
        with pytest.raises(InvalidSchemaData, match="nested"):
            SchemaData(
                "AVRO",
                f'{{"type": "record", "name": "Z", "fields": [{{"name": "x", "type": {nested}}}]}}',
            )

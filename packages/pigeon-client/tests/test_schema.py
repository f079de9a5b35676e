"""Record classes and schemas without I/O (pigeon.client.schema)."""

from __future__ import annotations

import pytest

from pigeon.client.schema import Array, AvroSchema, JsonSchema, Map, Record, String, StringSchema
from pigeon.core.errors import SchemaSerializationError


class Tagged(Record):
    tags = Array(String(), default=[])
    attrs = Map(String(), default={})


def test_a_mutable_default_is_not_shared_between_records() -> None:
    a = Tagged()
    a.tags.append("x")
    a.attrs["k"] = "v"
    assert Tagged() == Tagged(tags=[], attrs={})
    assert JsonSchema(Tagged).decode(b"{}") == Tagged(tags=[], attrs={})


@pytest.mark.parametrize("schema", [StringSchema(), AvroSchema(Tagged)])
def test_text_that_is_not_unicode_is_a_serialization_error(schema: object) -> None:
    value = "\ud800" if isinstance(schema, StringSchema) else Tagged(tags=["\ud800"])
    with pytest.raises(SchemaSerializationError):
        schema.encode(value)  # type: ignore[attr-defined]

"""Message schemas, as ``pulsar.schema`` names them.

::

    from pigeon.client.schema import AvroSchema, Integer, Record, String

    class User(Record):
        name = String(required=True)
        age = Integer()

    producer = client.create_producer("users", schema=AvroSchema(User))
    producer.send(User(name="ada", age=36))

See docs/messaging.md, "Schemas".
"""

from pigeon.client._schema import (
    Array,
    AvroSchema,
    Boolean,
    Bytes,
    BytesSchema,
    Double,
    Field,
    Float,
    Integer,
    JsonSchema,
    Long,
    Map,
    Record,
    Schema,
    String,
    StringSchema,
)

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

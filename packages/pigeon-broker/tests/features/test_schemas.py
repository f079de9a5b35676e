"""Schemas end to end on the trio face (in-process standalone, virtual time): each schema
class round-trips, the registry refuses an incompatible producer or consumer at attach,
and a consumer decodes every message with the version it was written with."""

from __future__ import annotations

from typing import Any

import pytest

from pigeon.client.schema import (
    Array,
    AvroSchema,
    Boolean,
    Bytes,
    BytesSchema,
    Double,
    Float,
    Integer,
    JsonSchema,
    Long,
    Map,
    Record,
    String,
    StringSchema,
)
from pigeon.client.trio import Client
from pigeon.core.errors import IncompatibleSchema, InvalidArgument, SchemaSerializationError
from pigeon.core.testing import receive_n


class Address(Record):
    city = String()


class Everything(Record):
    name = String(required=True)
    age = Integer()
    big = Long()
    ratio = Float()
    score = Double()
    ok = Boolean()
    raw = Bytes()
    tags = Array(String())
    counts = Map(Long())
    home = Address()


def user_v1() -> type[Record]:
    class User(Record):
        name = String(required=True)
        age = Integer()

    return User


def user_v2() -> type[Record]:
    class User(Record):
        name = String(required=True)
        age = Integer()
        email = String(default="unknown", required_default=True)

    return User


def user_no_default() -> type[Record]:
    class User(Record):
        name = String(required=True)
        age = Integer()
        email = String(required=True)

    return User


EVERYTHING = Everything(
    name="ada",
    age=36,
    big=2**40,
    ratio=0.5,
    score=1.25,
    ok=True,
    raw=b"\x00\xff",
    tags=["a", "b"],
    counts={"x": 1},
    home=Address(city="London"),
)


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        (AvroSchema(Everything), EVERYTHING),
        (JsonSchema(Everything), EVERYTHING),
        (StringSchema(), "héllo"),
        (BytesSchema(), b"\x01\x02"),
    ],
    ids=["avro", "json", "string", "bytes"],
)
async def test_round_trip(pigeon_standalone: Any, schema: Any, value: Any) -> None:
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("rt", "s", schema=schema)
        producer = await client.create_producer("rt", schema=schema)
        await producer.send(value)
        await producer.send_async(value)
        await producer.flush()
        msgs = await receive_n(consumer, 2)
        assert [m.value for m in msgs] == [value, value]
        assert msgs[0].data == schema.encode(value)
        plain = await client.subscribe("rt", "raw", initial_position="earliest")
        raw = await receive_n(plain, 2)
        assert raw[0].value == raw[0].data == msgs[0].data  # no schema: bytes


async def test_wrong_values_are_refused(pigeon_standalone: Any) -> None:
    async with Client(pigeon_standalone.url) as client:
        producer = await client.create_producer("wrong", schema=AvroSchema(Everything))
        with pytest.raises(SchemaSerializationError, match="takes a Everything"):
            await producer.send(b"bytes")
        with pytest.raises(SchemaSerializationError, match="field 'name' is required"):
            await producer.send(Everything(age=1))
        with pytest.raises(SchemaSerializationError, match="field 'age' must be int"):
            await producer.send(Everything(name="x", age="old"))
        with pytest.raises(InvalidArgument, match="schema must be"):
            await client.create_producer("wrong", schema=Everything)


async def test_incompatible_producer_is_refused(pigeon_standalone: Any) -> None:
    async with Client(pigeon_standalone.url) as client:
        await client.create_producer("evolve", schema=AvroSchema(user_v1()))
        with pytest.raises(
            IncompatibleSchema,
            match=r"not compatible with version 0 under FULL: .*field 'email' has no default",
        ):
            await client.create_producer("evolve", schema=AvroSchema(user_no_default()))
        with pytest.raises(IncompatibleSchema, match="schema type changed from AVRO to JSON"):
            await client.create_producer("evolve", schema=JsonSchema(user_v1()))
        # a producer without a schema is allowed (schema_validation_enforced is off)
        await client.create_producer("evolve")


async def test_consumer_decodes_each_version(pigeon_standalone: Any) -> None:
    v1, v2 = user_v1(), user_v2()
    async with Client(pigeon_standalone.url) as client:
        consumer = await client.subscribe("versions", "s", schema=AvroSchema(v2))
        old = await client.create_producer("versions", schema=AvroSchema(v1))
        await old.send(v1(name="old", age=1))
        new = await client.create_producer("versions", schema=AvroSchema(v2))
        await new.send(v2(name="new", age=2, email="n@x"))
        msgs = await receive_n(consumer, 2)
        # version 0's data read with the consumer's schema: email takes its default
        assert msgs[0].value == v2(name="old", age=1, email="unknown")
        assert msgs[1].value == v2(name="new", age=2, email="n@x")
        # a reader of the old schema reads the new data too (FULL: email is dropped)
        reader = await client.create_reader("versions", schema=AvroSchema(v1))
        got = await receive_n(reader, 2)
        assert [m.value for m in got] == [v1(name="old", age=1), v1(name="new", age=2)]


async def test_incompatible_consumer_is_refused(pigeon_standalone: Any) -> None:
    async with Client(pigeon_standalone.url) as client:
        await client.create_producer("readers", schema=AvroSchema(user_v1()))
        with pytest.raises(IncompatibleSchema, match="consumer schema cannot read version 0"):
            await client.subscribe("readers", "s", schema=AvroSchema(user_no_default()))

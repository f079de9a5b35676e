"""A check of every length in a Kafka request before ``kio`` parses it.

``kio``'s native reader reserves memory for an array from the element count the request
states, before reading any element: a count of two billion asks for hundreds of
gigabytes and the allocation failure aborts the whole process (a Rust ``handle_alloc_error``
is not an exception).  :func:`check_lengths` walks the request the way ``kio`` will, with
the same schema (``kio``'s dataclasses), reading only the lengths and skipping the
rest, and refuses any array, string or byte string that cannot fit in the bytes left:
an array of N elements needs at least N times its element's smallest encoding.

Cost: one pass over the fields, no object built (the records of a Produce are one
length and a skip); the per-class layout is computed once.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Any, Final

from kio.serial._introspect import (
    EntityField,
    EntityTupleField,
    PrimitiveTupleField,
    classify_field,
    get_field_tag,
)

from pigeon.core.errors import MalformedRequest

__all__ = ["check_lengths"]

#: fixed sizes of the primitive Kafka types
_FIXED: Final[dict[str, int]] = {
    "bool": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "float64": 8,
    "uuid": 16,
    "timedelta_i32": 4,
    "timedelta_i64": 8,
    "datetime_i64": 8,
    "error_code": 2,
}
#: variable-size primitives: a length, then that many bytes
_SIZED: Final = frozenset({"string", "bytes", "records"})

# a field's layout: (name, kind, kafka type or entity class, is array)
#   kind "fixed": size in the third item; "sized": kafka type; "entity": entity class
Layout = tuple[tuple[str, str, Any, bool], ...]


def _uvarint(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise MalformedRequest("a varint runs past the end of the request")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 35:
            raise MalformedRequest("a varint is longer than 5 bytes")


def _i32(buf: bytes | memoryview, pos: int, end: int, size: int) -> tuple[int, int]:
    if pos + size > end:
        raise MalformedRequest("a length runs past the end of the request")
    return int.from_bytes(buf[pos : pos + size], "big", signed=True), pos + size


@functools.cache
def _layout(cls: Any) -> tuple[Layout, dict[int, tuple[str, str, Any, bool]], int]:
    """(untagged fields in order, tagged fields by tag, smallest encoding in bytes)."""
    flexible = bool(cls.__flexible__)
    plain: list[tuple[str, str, Any, bool]] = []
    tagged: dict[int, tuple[str, str, Any, bool]] = {}
    smallest = 1 if flexible else 0  # the tagged fields' count
    for f in fields(cls):
        fc = classify_field(f)
        array = isinstance(fc, EntityTupleField | PrimitiveTupleField)
        if isinstance(fc, EntityField | EntityTupleField):
            item: tuple[str, str, Any, bool] = (f.name, "entity", fc.type_, array)
            size = _layout(fc.type_)[2]
        else:
            kafka_type = f.metadata["kafka_type"]
            if kafka_type in _FIXED:
                item = (f.name, "fixed", _FIXED[kafka_type], array)
                size = _FIXED[kafka_type]
            elif kafka_type in _SIZED:
                item = (f.name, "sized", kafka_type, array)
                size = 1 if flexible else (2 if kafka_type == "string" else 4)
            else:  # pragma: no cover - a kio type this module does not know yet
                raise AssertionError(f"unknown Kafka type {kafka_type!r} in {cls.__name__}")
        tag = get_field_tag(f)
        if tag is not None:
            tagged[int(tag)] = item
            continue
        plain.append(item)
        smallest += (1 if flexible else 4) if array else size
    return tuple(plain), tagged, smallest


def check_lengths(cls: Any, buf: bytes | memoryview, pos: int, end: int) -> int:
    """Walk one ``cls`` entity at ``buf[pos:end]``; the position after it.

    :raises MalformedRequest: a length that does not fit in what is left, or a field
        that runs past ``end``.
    """
    flexible = bool(cls.__flexible__)
    plain, tagged, _ = _layout(cls)
    for name, kind, what, array in plain:
        pos = _field(cls, flexible, name, kind, what, array, buf, pos, end)
    if flexible:
        count, pos = _uvarint(buf, pos, end)
        if count > end - pos:
            raise MalformedRequest(f"{cls.__name__} claims {count} tagged fields")
        for _ in range(count):
            tag, pos = _uvarint(buf, pos, end)
            size, pos = _uvarint(buf, pos, end)
            if size > end - pos:
                raise MalformedRequest(f"{cls.__name__} tagged field {tag} runs past the end")
            field = tagged.get(tag)
            if field is not None:
                _field(cls, flexible, *field, buf, pos, pos + size)
            pos += size
    return pos


def _field(
    cls: Any,
    flexible: bool,
    name: str,
    kind: str,
    what: Any,
    array: bool,
    buf: bytes | memoryview,
    pos: int,
    end: int,
) -> int:
    count = 1
    if array:
        if flexible:
            n, pos = _uvarint(buf, pos, end)
            count = n - 1
        else:
            count, pos = _i32(buf, pos, end, 4)
        if count <= 0:
            return pos
        smallest = {"fixed": what, "sized": 1 if flexible else 2}.get(kind)
        if smallest is None:
            smallest = _layout(what)[2]
        if count * max(1, smallest) > end - pos:
            raise MalformedRequest(
                f"{cls.__name__}.{name} claims {count} elements in {end - pos} bytes"
            )
    for _ in range(count):
        if kind == "fixed":
            pos += what
            if pos > end:
                raise MalformedRequest(f"{cls.__name__}.{name} runs past the end")
        elif kind == "entity":
            pos = check_lengths(what, buf, pos, end)
        else:
            if flexible:
                n, pos = _uvarint(buf, pos, end)
                size = n - 1
            else:
                size, pos = _i32(buf, pos, end, 2 if what == "string" else 4)
            if size > end - pos:
                raise MalformedRequest(
                    f"{cls.__name__}.{name} claims {size} bytes, {end - pos} are left"
                )
            pos += max(0, size)
    return pos

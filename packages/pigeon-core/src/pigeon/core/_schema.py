"""The Cap'n Proto schemas shipped with pigeon-core, loaded once, and the check that a
received body decodes (:class:`BodyChecker`).

Cap'n Proto readers decode lazily: a bit-flipped pointer, a text that is not UTF-8 or an
enum value this node does not know only fails when the field is read, which is deep inside
a handler.  :class:`BodyChecker` reads, before the handler runs, every field of a body that
*can* fail to decode, so that the handler only ever sees a body it can read and a bad one
is refused as :class:`~pigeon.core.errors.MalformedRequest` naming the field.  Scalar
fields (integers, floats, bools) always decode and are not read: a body made only of them
(``send``, ``flow``) costs nothing to check.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import capnp

from pigeon.core._capnp_fast import FrameCodec
from pigeon.core.errors import MalformedRequest

__all__ = [
    "PROTOCOL_VERSION",
    "SCHEMA_DIR",
    "BodyChecker",
    "BookieFrame",
    "BrokerFrame",
    "FAST_KINDS",
    "body_checker",
    "decode_error_reason",
    "frame_codec",
    "frame_name",
    "frame_role",
    "protocol",
]

SCHEMA_DIR = Path(__file__).parent / "schema"

#: Version exchanged in the ``connect`` handshake. Bump on incompatible changes.
PROTOCOL_VERSION = 1

protocol: Any = capnp.load(str(SCHEMA_DIR / "protocol.capnp"))
BrokerFrame: Any = protocol.BrokerFrame
BookieFrame: Any = protocol.BookieFrame

#: Who serves each root struct, for messages that tell a user they dialled the wrong port.
_ROLES = {"BrokerFrame": "broker", "BookieFrame": "bookie"}


def frame_name(frame_type: Any) -> str:
    """``"BrokerFrame"`` or ``"BookieFrame"``: the root struct a connection speaks."""
    name: str = frame_type.schema.node.displayName
    return name.rpartition(":")[2]


#: The union members of each root struct that :func:`frame_codec` decodes and builds at
#: fixed offsets (:mod:`pigeon.core._capnp_fast`): the frames every entry crosses (a
#: produce, its receipt, a bookie add and its answer, a push to a consumer, its permits
#: and acks) and the small answers around them.  Their bodies are plain tuples with the
#: schema's field names; every handler and ``extract`` of these kinds reads only
#: attributes (no ``which()``, no ``to_dict()`` through the default extract).
FAST_KINDS: dict[str, tuple[str, ...]] = {
    "BrokerFrame": ("send", "sendReceipt", "message", "flow", "ack", "error", "ok", "ping"),
    "BookieFrame": ("addEntry", "addResponse", "error", "ok", "ping"),
}

_FRAME_CODECS: dict[int, tuple[Any, FrameCodec]] = {}


def frame_codec(frame_type: Any) -> FrameCodec:
    """The (cached) fixed-layout codec of a root struct, for its :data:`FAST_KINDS`."""
    found = _FRAME_CODECS.get(id(frame_type))
    if found is None:
        codec = FrameCodec(frame_type, FAST_KINDS.get(frame_name(frame_type), ()))
        found = _FRAME_CODECS[id(frame_type)] = (frame_type, codec)
    return found[1]


def frame_role(frame_type: Any) -> str:
    """``"broker"`` or ``"bookie"``: the kind of node that serves ``frame_type`` (a root
    struct or its :func:`frame_name`)."""
    name = frame_type if isinstance(frame_type, str) else frame_name(frame_type)
    return _ROLES.get(name, name)


# ------------------------------------------------------------------------ body checks


class _Bad(Exception):
    """A field failed to decode; ``path`` grows as the exception leaves nested checks."""

    def __init__(self, reason: str, path: list[str]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path = path


#: check(reader) raises _Bad if a field of ``reader`` does not decode
_Check = Callable[[Any], None]


def decode_error_reason(exc: BaseException) -> str:
    """A short reason for a decoding failure (KjException texts are long)."""
    if isinstance(exc, UnicodeDecodeError):
        return "text is not valid UTF-8"
    text = str(getattr(exc, "description", "") or exc)
    if text.startswith("expected cptr[unboundedSize] == '\\0'"):
        return "text is not NUL-terminated"  # kj's message stops at the NUL it printed
    # "expected boundsCheck(...); Message contains out-of-bounds list pointer. This usually..."
    for marker in ("; Schema mismatch: ", "; Message ", "; INLINE_COMPOSITE "):
        at = text.find(marker)
        if at >= 0:
            text = text[at + 2 :]
            break
    text = "".join(c if c.isprintable() else "?" for c in text.split(". ")[0][:200])
    return text.rstrip(".").strip() or type(exc).__name__


def _read(reader: Any, name: str, field: Any) -> Any:
    # _get_by_field: pycapnp's getattr without the name lookup (3x faster)
    try:
        return reader._get_by_field(field)
    except Exception as exc:  # KjException, UnicodeDecodeError: the bytes, not our code
        raise _Bad(decode_error_reason(exc), [name]) from None


def _enum_check(name: str, field: Any, values: frozenset[int]) -> _Check:
    def check(reader: Any) -> None:
        raw = _read(reader, name, field).raw
        if raw not in values:
            raise _Bad(f"enum value {raw} is unknown to this node", [name])

    return check


def _items_check(element: Any, list_schema: Any) -> _Check | None:
    """Check of the items of a list (``element``: its element type), or None when reading
    the list pointer is all there is to check (lists of numbers, of pointer-free structs)."""
    kind = element.which()
    item_check: Callable[[Any], None] | None = None
    if kind == "enum":

        def check_enum(item: Any) -> None:
            try:
                str(item)  # pycapnp: RuntimeError("Member was null.") for an unknown value
            except Exception:
                raise _Bad(f"enum value {item.raw} is unknown to this node", []) from None

        item_check = check_enum
    elif kind == "struct":
        item_check = _struct_check(list_schema.elementType)
        if item_check is None:
            return None  # the list's words are bounds-checked when the list is read
    elif kind == "list":
        item_check = _items_check(element.list.elementType, list_schema.elementType)
    elif kind not in ("text", "data"):
        return None  # numbers, bools, void

    def check(items: Any) -> None:
        for i in range(len(items)):
            try:
                item = items[i]  # decodes a text, reads a nested list's pointer
            except Exception as exc:
                raise _Bad(decode_error_reason(exc), [f"[{i}]"]) from None
            if item_check is not None:
                try:
                    item_check(item)
                except _Bad as bad:
                    bad.path.insert(0, f"[{i}]")
                    raise

    return check


def _nested_check(name: str, field: Any, inner: _Check | None) -> _Check:
    """Read field ``name`` (a text, data, struct, group or list: a pointer to follow)
    and run ``inner`` on what it holds; a failure names the field in its path."""

    def check(reader: Any) -> None:
        value = _read(reader, name, field)
        if inner is not None:
            try:
                inner(value)
            except _Bad as bad:
                bad.path.insert(0, name)
                raise

    return check


def _field_check(name: str, field: Any) -> _Check | None:
    proto = field.proto
    if proto.which() == "group":
        inner = _struct_check(field.schema)
        return None if inner is None else _nested_check(name, field, inner)
    slot_type = proto.slot.type
    kind = slot_type.which()
    if kind in ("text", "data"):
        return _nested_check(name, field, None)
    if kind == "enum":
        return _enum_check(name, field, frozenset(field.schema.enumerants.values()))
    if kind == "struct":
        return _nested_check(name, field, _struct_check(field.schema))
    if kind == "list":
        return _nested_check(name, field, _items_check(slot_type.list.elementType, field.schema))
    return None  # void, bool, numbers: always decode; anyPointer, interface: not used


_STRUCT_CHECKS: dict[int, _Check | None] = {}


def _struct_check(schema: Any) -> _Check | None:
    """The check of a struct schema; None when nothing in it can fail to decode."""
    node_id = schema.node.id
    if node_id in _STRUCT_CHECKS:
        return _STRUCT_CHECKS[node_id]
    checks = [
        c
        for name in schema.non_union_fields
        if (c := _field_check(name, schema.fields[name])) is not None
    ]
    members: dict[str, _Check | None] = {
        name: _field_check(name, schema.fields[name]) for name in schema.union_fields
    }
    check: _Check | None
    if not checks and not members:
        check = None
    else:

        def check(reader: Any) -> None:
            for c in checks:
                c(reader)
            if members:
                try:
                    which = reader.which()
                except Exception as exc:
                    reason = decode_error_reason(exc)
                    raise _Bad(f"union member unknown to this node ({reason})", []) from None
                member = members.get(str(which))
                if member is not None:
                    member(reader)

    _STRUCT_CHECKS[node_id] = check
    return check


# The fast path: the same reads without bookkeeping.  Any exception means "malformed";
# the checks above then run to say which field and why (only for bad bodies).


def _fast_items(element: Any, list_schema: Any) -> _Check | None:
    kind = element.which()
    if kind in ("text", "data"):

        def decode_all(items: Any) -> None:
            for _item in items:  # iterating decodes each text
                pass

        return decode_all
    if kind == "enum":

        def names(items: Any) -> None:
            for item in items:
                str(item)  # RuntimeError for a value this schema does not know

        return names
    inner: _Check | None = None
    if kind == "struct":
        inner = _fast_struct(list_schema.elementType)
    elif kind == "list":
        inner = _fast_items(element.list.elementType, list_schema.elementType)
        if inner is None:
            return decode_all_lists

    if inner is None:
        return None
    check_item = inner

    def each(items: Any) -> None:
        for item in items:
            check_item(item)

    return each


def decode_all_lists(items: Any) -> None:
    for _item in items:  # reads each nested list's pointer
        pass


_FAST: dict[int, _Check | None] = {}


def _fast_struct(schema: Any) -> _Check | None:
    node_id = schema.node.id
    if node_id in _FAST:
        return _FAST[node_id]
    simple: list[Any] = []  # fields for which reading is the whole check
    nested: list[tuple[Any, _Check]] = []
    enums: list[tuple[Any, frozenset[int]]] = []
    for name in schema.non_union_fields:
        field = schema.fields[name]
        proto = field.proto
        if proto.which() == "group":
            inner = _fast_struct(field.schema)
            if inner is not None:
                nested.append((field, inner))
            continue
        slot_type = proto.slot.type
        kind = slot_type.which()
        if kind in ("text", "data"):
            simple.append(field)
        elif kind == "enum":
            enums.append((field, frozenset(field.schema.enumerants.values())))
        elif kind == "struct":
            inner = _fast_struct(field.schema)
            if inner is None:
                simple.append(field)
            else:
                nested.append((field, inner))
        elif kind == "list":
            inner = _fast_items(slot_type.list.elementType, field.schema)
            if inner is None:
                simple.append(field)
            else:
                nested.append((field, inner))
    union = bool(schema.union_fields)
    if not (simple or nested or enums or union):
        _FAST[node_id] = None
        return None
    # a union's active member: checked by the precise check (unions are rare and small)
    precise = _struct_check(schema) if union else None

    def check(reader: Any) -> None:
        get = reader._get_by_field
        for field in simple:
            get(field)
        for field, inner in nested:
            inner(get(field))
        for field, values in enums:
            if get(field).raw not in values:
                raise ValueError("unknown enum value")
        if precise is not None:
            precise(reader)

    _FAST[node_id] = check
    return check


class BodyChecker:
    """Reads the body of a frame of ``frame_type`` eagerly; see the module doc.

    :meth:`body` returns the union member ``kind`` of a decoded frame (``None`` for a Void
    member) once every field of it that can fail to decode has been read, or raises
    :class:`MalformedRequest` ``"malformed <kind>: <field path>: <reason>"``.  The check
    costs about a microsecond per pointer or enum field read (pycapnp's field access).
    """

    def __init__(self, frame_type: Any) -> None:
        schema = frame_type.schema
        self._void: set[str] = set()
        self._fast: dict[str, _Check | None] = {}
        self._precise: dict[str, _Check | None] = {}
        for name in schema.union_fields:
            field = schema.fields[name]
            if field.proto.which() == "slot" and field.proto.slot.type.which() == "void":
                self._void.add(name)
            else:
                self._fast[name] = _fast_struct(field.schema)
                self._precise[name] = _struct_check(field.schema)

    def body(self, msg: Any, kind: str, *, check: bool = True) -> Any:
        """The body; with ``check=False`` only its own pointer is read (the caller checks
        later, with :meth:`check`, if reading it fails)."""
        if kind in self._void:
            return None
        try:
            value = getattr(msg, kind)
        except Exception as exc:  # the body's own pointer
            raise MalformedRequest(f"malformed {kind}: body: {decode_error_reason(exc)}") from None
        fast = self._fast.get(kind) if check else None
        if fast is not None:
            try:
                fast(value)
            except Exception as exc:
                raise self._diagnose(kind, value, exc) from None
        return value

    def check(self, msg: Any, kind: str) -> MalformedRequest | None:
        """The MalformedRequest a body deserves, or None when it decodes."""
        try:
            self.body(msg, kind)
        except MalformedRequest as exc:
            return exc
        return None

    def _diagnose(self, kind: str, value: Any, exc: Exception) -> MalformedRequest:
        """Which field of a body that failed the fast check is malformed, and why."""
        precise = self._precise.get(kind)
        try:
            if precise is not None:
                precise(value)
        except _Bad as bad:
            field = ".".join(bad.path).replace(".[", "[") or "body"
            return MalformedRequest(f"malformed {kind}: {field}: {bad.reason}")
        return MalformedRequest(f"malformed {kind}: {decode_error_reason(exc)}")


_CHECKERS: dict[int, BodyChecker] = {}


def body_checker(frame_type: Any) -> BodyChecker:
    """The (shared, cached) :class:`BodyChecker` of a root struct."""
    node_id = frame_type.schema.node.id
    checker = _CHECKERS.get(node_id)
    if checker is None:
        checker = _CHECKERS[node_id] = BodyChecker(frame_type)
    return checker

"""Cap'n Proto at fixed offsets: a schema-driven codec for the structs on the per-entry
path, without I/O and without pycapnp's dynamic reader and builder.

pycapnp spends microseconds per field access (a dynamic lookup and a C++ call each);
a frame of the per-entry path (``send``, ``sendReceipt``, ``addEntry`` ...) and an entry's
``BatchHeader`` are a few words at known offsets.  From the loaded schema (each struct's
node: ``dataWordCount``, ``pointerCount``, every field's ``slot.offset``, ``slot.type``,
``slot.defaultValue``) this module precomputes, per struct:

* a decoder: one ``struct.unpack_from`` of the data section, texts, data and lists read
  through their pointers, into a tuple subclass whose attributes are the schema's field
  names (``body.producerId``); an enum reads as a ``str`` with a ``raw`` attribute (as
  pycapnp's enum does), a list as a Python ``list``, a nested struct as its own tuple;
* an encoder: the data section packed at the field offsets, then every pointer's target
  appended in the order the fields are given -- the order in which pycapnp's builder
  allocates them, so that a small message is byte for byte the one pycapnp builds.

Layout read and written (the standard serialisation, one segment only)::

    u32 0 (segment count - 1) | u32 segment words | segment
    segment word 0: root pointer; then the objects
    struct pointer  bits 0-1 = 0, 2-31 signed offset in words from the word after the
                    pointer, 32-47 data words, 48-63 pointer words
                    (an empty struct: offset -1, sizes 0)
    list pointer    bits 0-1 = 1, 2-31 offset, 32-34 element size (2 byte: Text/Data,
                    3/4/5 two/four/eight bytes, 6 pointer, 7 inline composite), 35-63
                    element count (inline composite: words, after a tag word shaped like a
                    struct pointer whose offset is the element count)
    a field whose value has a non-zero default is stored XORed with that default; a
    field beyond a struct's data or pointer section (an older writer) reads as its default

Anything else is not handled here and raises :class:`Unhandled` (a frame of several
segments, a far pointer, a list encoded with another element size, a union member
without a layout, an enum value this schema does not know, a text without its NUL or not
UTF-8, an offset out of bounds, more words read than the message holds): the caller then
takes the pycapnp path, which accepts or refuses the bytes exactly as before, with the
same errors.  Every offset read from the bytes is bounds-checked before it is used.
"""

from __future__ import annotations

import re
import struct
from collections import namedtuple
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["EnumValue", "FrameCodec", "StructCodec", "Unhandled", "struct_codec"]

_U64 = struct.Struct("<Q")
_U32x2 = struct.Struct("<II")
#: one Cap'n Proto word
_W = 8
#: the segment starts after the table of a one-segment message
_SEG = 8

_SCALARS: dict[str, tuple[str, int]] = {
    # kind: (struct format, size in bytes; slot.offset counts in units of this size)
    "int8": ("b", 1),
    "uint8": ("B", 1),
    "int16": ("h", 2),
    "uint16": ("H", 2),
    "int32": ("i", 4),
    "uint32": ("I", 4),
    "int64": ("q", 8),
    "uint64": ("Q", 8),
    "float32": ("f", 4),
    "float64": ("d", 8),
    "enum": ("H", 2),
}
#: list element size codes of the primitive element kinds
_ELEMENT_SIZE = {1: 2, 2: 3, 4: 4, 8: 5}


class Unhandled(Exception):
    """The fast codec does not handle these bytes or values: take the pycapnp path."""


class EnumValue(str):
    """An enum value as decoded: its name (``str(v) == "cumulative"``), with ``raw`` (its
    number), like pycapnp's enum reader."""

    raw: int

    def __new__(cls, name: str, raw: int) -> EnumValue:
        value = super().__new__(cls, name)
        value.raw = raw
        return value


class _Body(tuple):  # type: ignore[type-arg]
    """Base of the decoded structs: a tuple whose items are the fields in code order."""

    __slots__ = ()
    _fields: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (nested structs and lists of them as dicts), enums by name."""
        return {name: _plain(value) for name, value in zip(self._fields, self, strict=True)}


def _plain(value: Any) -> Any:
    if isinstance(value, _Body):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, EnumValue):
        return str(value)
    return value


# ------------------------------------------------------------------ pointer reading


def _target(buf: Any, at: int, end: int, kind: int) -> tuple[int, int]:
    """(start of the target, the pointer word) of the non-null pointer at ``at``."""
    w: int = _U64.unpack_from(buf, at)[0]
    if w & 3 != kind:
        raise Unhandled("unexpected pointer kind")
    off = ((w & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000 >> 2
    start = at + _W + off * _W
    if start < _SEG or start > end:
        raise Unhandled("pointer out of bounds")
    return start, w


def _read_text(buf: Any, at: int, end: int, budget: list[int], default: str) -> str:
    if not _U64.unpack_from(buf, at)[0]:
        return default
    start, w = _target(buf, at, end, 1)
    n = w >> 35
    if (w >> 32) & 7 != 2 or n < 1 or start + n > end:
        raise Unhandled("bad text")
    budget[0] -= (n + 7) >> 3
    if budget[0] < 0 or buf[start + n - 1] != 0:
        raise Unhandled("bad text")
    text: str = bytes(buf[start : start + n - 1]).decode()
    return text


def _read_data(buf: Any, at: int, end: int, budget: list[int], default: bytes) -> bytes:
    if not _U64.unpack_from(buf, at)[0]:
        return default
    start, w = _target(buf, at, end, 1)
    n = w >> 35
    if (w >> 32) & 7 != 2 or start + n > end:
        raise Unhandled("bad data")
    budget[0] -= (n + 7) >> 3
    if budget[0] < 0:
        raise Unhandled("traversal budget")
    return bytes(buf[start : start + n])


class StructCodec:
    """The fixed-layout decoder and encoder of one struct (see the module doc).

    ``supported`` is False for a struct this codec has no layout for (a union, a group,
    an interface or AnyPointer field, a float or list default); :func:`struct_codec`
    builds one per schema node."""

    def __init__(self, schema: Any) -> None:
        node = schema.node
        self.name: str = node.displayName.rpartition(":")[2]
        st = node.struct
        self.data_words: int = st.dataWordCount
        self.pointer_count: int = st.pointerCount
        self.supported = True
        self._schema = schema
        fields = sorted(st.fields, key=lambda f: f.codeOrder)
        self.field_names = tuple(f.name for f in fields)
        if st.discriminantCount or any(f.which() != "slot" for f in fields):
            self.supported = False
            return
        self._setters: dict[str, _Setter] = {}
        self._exprs: list[str] = []
        self._env: dict[str, Any] = {
            "_text": _read_text,
            "_data": _read_data,
            "_list": _read_list,
        }
        # data section: (byte offset, format, expression index) of each scalar slot
        self._slots: list[tuple[int, str]] = []
        self._bool_bytes: dict[int, int] = {}  # byte offset -> slot index
        for f in fields:
            self._add_field(f, schema.fields[f.name])
            if not self.supported:
                return
        self._build_decoder()

    # -- layout

    def _slot(self, offset: int, fmt: str) -> int:
        self._slots.append((offset, fmt))
        return len(self._slots) - 1

    def _add_field(self, proto: Any, field: Any) -> None:
        name = proto.name
        slot = proto.slot
        kind = slot.type.which()
        default = slot.defaultValue
        i = len(self._exprs)
        if kind == "void":
            self._exprs.append("None")
            self._setters[name] = _void_setter
        elif kind == "bool":
            byte, bit = divmod(slot.offset, 8)
            s = self._bool_bytes.get(byte)
            if s is None:
                s = self._bool_bytes[byte] = self._slot(byte, "B")
            flip = bool(default.bool)
            self._exprs.append(f"(v[@{s}@] >> {bit} & 1) {'==' if flip else '!='} 0")
            self._setters[name] = _bool_setter(byte, 1 << bit, flip)
        elif kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            raw_default = 0
            if kind == "enum":
                enumerants = field.schema.enumerants
                values = tuple(
                    EnumValue(n, r) for n, r in sorted(enumerants.items(), key=lambda e: e[1])
                )
                if [v.raw for v in values] != list(range(len(values))):
                    self.supported = False
                    return
                self._env[f"_E{i}"] = values
                raw_default = default.enum
                by_name = {str(v): v.raw for v in values}
            elif kind.startswith("float"):
                if getattr(default, kind) != 0:
                    self.supported = False  # stored XORed bit-wise: not worth it
                    return
            else:
                raw_default = getattr(default, kind)
            s = self._slot(slot.offset * size, fmt)
            expr = f"v[@{s}@]" if not raw_default else f"(v[@{s}@] ^ {raw_default})"
            if kind == "enum":
                expr = f"_E{i}[{expr}]"
                self._setters[name] = _enum_setter(slot.offset * size, by_name, raw_default)
            else:
                self._setters[name] = _scalar_setter(
                    struct.Struct("<" + fmt), slot.offset * size, raw_default
                )
            self._exprs.append(expr)
        elif kind in ("text", "data", "list", "struct"):
            if slot.hadExplicitDefault and kind in ("list", "struct"):
                self.supported = False
                return
            p = slot.offset
            at = f"p + {p * _W}"
            if kind == "text":
                d = default.text
                self._env[f"_D{i}"] = d
                read = f"_text(buf, {at}, end, budget, _D{i})"
                self._setters[name] = _text_setter(p)
                null = f"_D{i}"
            elif kind == "data":
                d = bytes(default.data)
                self._env[f"_D{i}"] = d
                read = f"_data(buf, {at}, end, budget, _D{i})"
                self._setters[name] = _data_setter(p)
                null = f"_D{i}"
            elif kind == "struct":
                sub = struct_codec(field.schema)
                if not sub.supported:
                    self.supported = False
                    return
                self._env[f"_S{i}"] = sub
                read = f"_S{i}.read(buf, {at}, end, budget)"
                null = f"_S{i}.default"
                self._setters[name] = _struct_setter(p, sub)
            else:
                element = _ListElement.of(slot.type.list.elementType, field.schema)
                if element is None:
                    self.supported = False
                    return
                self._env[f"_L{i}"] = element
                read = f"_list(buf, {at}, end, budget, _L{i})"
                null = "[]"
                self._setters[name] = _list_setter(p, element)
            self._exprs.append(f"({read} if pc > {p} else {null})")
        else:  # interface, anyPointer
            self.supported = False

    def _build_decoder(self) -> None:
        size = self.data_words * _W
        fmt = ["<"]
        pos = 0
        order = sorted(range(len(self._slots)), key=lambda s: self._slots[s][0])
        # unpack gives values in byte order: map each slot to its index in that order
        rank = {s: r for r, s in enumerate(order)}
        for s in order:
            offset, f = self._slots[s]
            if offset > pos:
                fmt.append(f"{offset - pos}x")
            fmt.append(f)
            pos = offset + struct.calcsize("<" + f)
        if size > pos:
            fmt.append(f"{size - pos}x")
        self._data = struct.Struct("".join(fmt))
        assert self._data.size == size, (self.name, self._data.size, size)
        # slot numbers -> positions in the unpacked tuple
        exprs = [re.sub(r"@(\d+)@", lambda m: str(rank[int(m[1])]), e) for e in self._exprs]
        cls = namedtuple(self.name, self.field_names)  # type: ignore[misc]  # noqa: PYI024
        self.cls: type[_Body] = type(self.name, (_Body, cls), {"__slots__": ()})
        env = self._env
        env.update(
            _unpack=self._data.unpack_from,
            _unpack_bytes=self._data.unpack,
            _size=size,
            _new=tuple.__new__,
            _cls=self.cls,
        )
        src = (
            "def decode(buf, pos, dw, pc, end, budget):\n"
            "    if dw >= _size // 8:\n"
            "        v = _unpack(buf, pos)\n"
            "    else:\n"
            "        v = _unpack_bytes(bytes(buf[pos:pos + dw * 8]).ljust(_size, b'\\0'))\n"
            "    p = pos + dw * 8\n"
            f"    return _new(_cls, ({', '.join(exprs)}{',' if len(exprs) == 1 else ''}))\n"
        )
        exec(src, env)  # noqa: S102  # our own generated code, from the schema
        self.decode: Callable[..., _Body] = env["decode"]
        zeros = bytes(size + self.pointer_count * _W)
        self.default = self.decode(zeros, 0, self.data_words, 0, len(zeros), [0])
        self._zeros = zeros

    # -- decoding

    def read(self, buf: Any, at: int, end: int, budget: list[int]) -> _Body:
        """The struct the pointer at ``at`` points to (its default when null)."""
        if not _U64.unpack_from(buf, at)[0]:
            return self.default
        start, w = _target(buf, at, end, 0)
        dw = (w >> 32) & 0xFFFF
        pc = w >> 48
        words = dw + pc
        budget[0] -= words or 1
        if start + words * _W > end or budget[0] < 0:
            raise Unhandled("struct out of bounds")
        return self.decode(buf, start, dw, pc, end, budget)

    def decode_message(self, buf: bytes | bytearray | memoryview) -> _Body:
        """Decode a whole one-segment message whose root is this struct."""
        end = _segment_end(buf)
        return self.read(buf, _SEG, end, [(end - _SEG) >> 3])

    # -- encoding

    def write(self, out: bytearray, at: int, fields: dict[str, Any]) -> None:
        """Append this struct, holding ``fields``, to ``out`` and point the pointer at
        byte ``at`` of ``out`` to it."""
        start = len(out)
        words = len(self._zeros) >> 3
        if words:
            _U64.pack_into(
                out,
                at,
                (((start - at - _W) >> 1) & 0xFFFFFFFC)
                | self.data_words << 32
                | self.pointer_count << 48,
            )
        else:
            _U64.pack_into(out, at, 0xFFFFFFFC)
        out += self._zeros
        self.fill(out, start, fields)

    def fill(self, out: bytearray, start: int, fields: dict[str, Any]) -> None:
        """Set ``fields`` in the struct at byte ``start`` of ``out`` (allocated, zero)."""
        setters = self._setters
        base = start + self.data_words * _W
        for name, value in fields.items():
            setter = setters.get(name)
            if setter is None:
                raise Unhandled(f"no field {name!r}")
            fn, pointer = setter
            fn(out, base if pointer else start, value)

    def encode_message(self, fields: dict[str, Any]) -> bytes:
        """A whole one-segment message whose root is this struct."""
        out = bytearray(16)
        self.write(out, _SEG, fields)
        _U32x2.pack_into(out, 0, 0, (len(out) - _SEG) >> 3)
        return bytes(out)


def _segment_end(buf: Any) -> int:
    """End (byte offset) of the one segment of the message in ``buf``."""
    if len(buf) < 16:
        raise Unhandled("message too short")
    extra, words = _U32x2.unpack_from(buf, 0)
    end = _SEG + words * _W
    if extra or end > len(buf):
        raise Unhandled("not one segment")
    return end


# ------------------------------------------------------------------ lists


class _ListElement:
    """How the items of a list field are read and written."""

    def __init__(self, kind: str, size_code: int, fmt: str = "", sub: Any = None) -> None:
        self.kind = kind  # "scalar", "enum", "text", "data", "struct"
        self.size_code = size_code
        self.fmt = fmt
        self.size = struct.calcsize("<" + fmt) if fmt else 0
        self.sub = sub  # enum values (tuple) / name->raw, or the item StructCodec

    @classmethod
    def of(cls, element: Any, list_schema: Any) -> _ListElement | None:
        kind = element.which()
        if kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            if kind == "enum":
                values = tuple(
                    EnumValue(n, r)
                    for n, r in sorted(
                        list_schema.elementType.enumerants.items(), key=lambda e: e[1]
                    )
                )
                return cls("enum", 3, "H", values)
            return cls("scalar", _ELEMENT_SIZE[size], fmt)
        if kind in ("text", "data"):
            return cls(kind, 6)
        if kind == "struct":
            sub = struct_codec(list_schema.elementType)
            return cls("struct", 7, sub=sub) if sub.supported else None
        return None  # bool, void, nested lists, AnyPointer: the pycapnp path


def _read_list(buf: Any, at: int, end: int, budget: list[int], element: _ListElement) -> list[Any]:
    if not _U64.unpack_from(buf, at)[0]:
        return []
    start, w = _target(buf, at, end, 1)
    count = w >> 35
    if (w >> 32) & 7 != element.size_code:
        raise Unhandled("list element size")
    kind = element.kind
    if kind == "struct":
        if start + _W + count * _W > end:
            raise Unhandled("list out of bounds")
        tag: int = _U64.unpack_from(buf, start)[0]
        n = (tag & 0xFFFFFFFF) >> 2
        dw = (tag >> 32) & 0xFFFF
        pc = tag >> 48
        step = (dw + pc) * _W
        budget[0] -= max(count, n) + 1
        if tag & 3 or n * (dw + pc) > count or budget[0] < 0:
            raise Unhandled("bad struct list")
        decode = element.sub.decode
        first = start + _W
        return [decode(buf, first + i * step, dw, pc, end, budget) for i in range(n)]
    if kind in ("text", "data"):
        if start + count * _W > end:
            raise Unhandled("list out of bounds")
        budget[0] -= count
        if budget[0] < 0:
            raise Unhandled("traversal budget")
        read = _read_text if kind == "text" else _read_data
        empty: Any = "" if kind == "text" else b""
        return [read(buf, start + i * _W, end, budget, empty) for i in range(count)]
    nbytes = count * element.size
    budget[0] -= (nbytes + 7) >> 3
    if start + nbytes > end or budget[0] < 0:
        raise Unhandled("list out of bounds")
    items = list(struct.unpack_from(f"<{count}{element.fmt}", buf, start))
    if kind == "enum":
        values = element.sub
        return [values[r] for r in items]  # IndexError: unknown value
    return items


# ------------------------------------------------------------------ field setters
#
# A setter is ``(set, pointer)``: ``set(out, base, value)`` writes ``value`` into the
# struct being built in ``out``; ``base`` is the struct's start for a data field, the
# start of its pointer section for a pointer field (``pointer`` True).

_Setter = tuple[Callable[[bytearray, int, Any], None], bool]


def _set_void(out: bytearray, base: int, value: Any) -> None:
    if value is not None:
        raise Unhandled("void field with a value")


_void_setter: _Setter = (_set_void, False)


def _scalar_setter(s: struct.Struct, offset: int, default: int) -> _Setter:
    pack = s.pack_into
    if default:

        def set_xor(out: bytearray, base: int, value: Any) -> None:
            if type(value) is not int:
                raise Unhandled("not an int")
            pack(out, base + offset, value ^ default)

        return set_xor, False

    def set_plain(out: bytearray, base: int, value: Any) -> None:
        pack(out, base + offset, value)

    return set_plain, False


def _bool_setter(byte: int, mask: int, flip: bool) -> _Setter:
    def set_bool(out: bytearray, base: int, value: Any) -> None:
        if value is not True and value is not False:
            raise Unhandled("not a bool")
        if value is not flip:
            out[base + byte] |= mask
        else:
            out[base + byte] &= ~mask & 0xFF

    return set_bool, False


def _enum_setter(offset: int, by_name: dict[str, int], default: int) -> _Setter:
    pack = struct.Struct("<H").pack_into

    def set_enum(out: bytearray, base: int, value: Any) -> None:
        raw = by_name.get(value) if type(value) is str else None
        if raw is None:
            raise Unhandled("not an enum name")
        pack(out, base + offset, raw ^ default)

    return set_enum, False


def _list_pointer(out: bytearray, at: int, start: int, size_code: int, count: int) -> None:
    _U64.pack_into(
        out, at, 1 | (((start - at - _W) >> 1) & 0xFFFFFFFC) | size_code << 32 | count << 35
    )


def _append_bytes(out: bytearray, at: int, raw: bytes) -> None:
    """Append ``raw`` (padded to a word) as a list of bytes that the pointer at ``at``
    points to."""
    _list_pointer(out, at, len(out), 2, len(raw))
    out += raw
    pad = -len(raw) & 7
    if pad:
        out += bytes(pad)


def _put_text(out: bytearray, at: int, value: Any) -> None:
    if type(value) is not str:
        raise Unhandled("not a str")
    _append_bytes(out, at, value.encode() + b"\0")


def _put_data(out: bytearray, at: int, value: Any) -> None:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise Unhandled("not bytes")
    _append_bytes(out, at, bytes(value))


def _text_setter(index: int) -> _Setter:
    offset = index * _W

    def set_text(out: bytearray, base: int, value: Any) -> None:
        _put_text(out, base + offset, value)

    return set_text, True


def _data_setter(index: int) -> _Setter:
    offset = index * _W

    def set_data(out: bytearray, base: int, value: Any) -> None:
        _put_data(out, base + offset, value)

    return set_data, True


def _struct_setter(index: int, sub: StructCodec) -> _Setter:
    offset = index * _W

    def set_struct(out: bytearray, base: int, value: Any) -> None:
        if type(value) is not dict:
            raise Unhandled("not a dict")
        sub.write(out, base + offset, value)

    return set_struct, True


def _list_setter(index: int, element: _ListElement) -> _Setter:
    offset = index * _W
    kind = element.kind
    code = element.size_code
    put = _put_text if kind == "text" else _put_data
    names = {str(v): v.raw for v in element.sub} if kind == "enum" else {}

    def set_list(out: bytearray, base: int, value: Any) -> None:
        if type(value) is not list and type(value) is not tuple:
            raise Unhandled("not a list")
        at = base + offset
        n = len(value)
        start = len(out)
        if kind == "struct":
            sub: StructCodec = element.sub
            words = sub.data_words + sub.pointer_count
            _list_pointer(out, at, start, 7, n * words)
            out += bytes(_W + n * words * _W)
            _U64.pack_into(out, start, n << 2 | sub.data_words << 32 | sub.pointer_count << 48)
            step = words * _W
            fill = sub.fill
            for i, item in enumerate(value):
                if type(item) is not dict:
                    raise Unhandled("struct list item is not a dict")
                fill(out, start + _W + i * step, item)
        elif kind in ("text", "data"):
            _list_pointer(out, at, start, 6, n)
            out += bytes(n * _W)
            for i, item in enumerate(value):
                put(out, start + i * _W, item)
        else:
            if kind == "enum":
                try:
                    value = [names[v] for v in value]
                except (KeyError, TypeError):
                    raise Unhandled("not enum names") from None
            _list_pointer(out, at, start, code, n)
            raw = struct.pack(f"<{n}{element.fmt}", *value)
            out += raw
            pad = -len(raw) & 7
            if pad:
                out += bytes(pad)

    return set_list, True


# ------------------------------------------------------------------ frames


class FrameCodec:
    """Decoder and encoder of a root frame struct (``requestId`` plus a union of kinds)
    for the union members in ``kinds`` whose struct has a layout (and Void members).

    :meth:`decode` returns ``(request_id, kind, body)`` (``body`` None for a Void
    member), or None for a member it does not handle; :meth:`encode` returns the
    message bytes.  Both raise :class:`Unhandled` (or a ``struct``/``Unicode`` error for
    :meth:`decode`: see :data:`DECODE_ERRORS`) when the pycapnp path must decide."""

    def __init__(self, frame_type: Any, kinds: Iterable[str]) -> None:
        schema = frame_type.schema
        node = schema.node
        st = node.struct
        self.data_words: int = st.dataWordCount
        self.pointer_count: int = st.pointerCount
        self._disc = st.discriminantOffset * 2
        request = schema.fields["requestId"].proto
        if request.slot.type.which() != "uint64" or request.slot.offset != 0:
            raise ValueError("a frame struct starts with requestId :UInt64")
        #: discriminant -> (kind, StructCodec or None for Void, pointer index)
        self._by_disc: dict[int, tuple[str, StructCodec | None, int]] = {}
        #: kind -> (discriminant, StructCodec or None, pointer index)
        self._by_kind: dict[str, tuple[int, StructCodec | None, int]] = {}
        for name in kinds:
            proto = schema.fields[name].proto
            kind = proto.slot.type.which()
            disc = proto.discriminantValue
            if kind == "void":
                entry: tuple[StructCodec | None, int] = (None, 0)
            elif kind == "struct":
                codec = struct_codec(schema.fields[name].schema)
                if not codec.supported:
                    continue
                entry = (codec, proto.slot.offset)
            else:
                continue
            self._by_disc[disc] = (name, *entry)
            self._by_kind[name] = (disc, *entry)
        self.kinds = frozenset(self._by_kind)
        self._root = (
            (self.data_words << 32 | self.pointer_count << 48)
            if self.data_words + self.pointer_count
            else 0xFFFFFFFC
        )
        self._root_size = (self.data_words + self.pointer_count) * _W

    def decode(self, buf: bytes | bytearray | memoryview) -> tuple[int, str, Any] | None:
        end = _segment_end(buf)
        budget = [(end - _SEG) >> 3]
        w: int = _U64.unpack_from(buf, _SEG)[0]
        if not w:
            return None  # a null root: the pycapnp path
        start, w = _target(buf, _SEG, end, 0)
        dw = (w >> 32) & 0xFFFF
        pc = w >> 48
        if start + (dw + pc) * _W > end or dw < 1:
            raise Unhandled("root out of bounds")
        request_id: int = _U64.unpack_from(buf, start)[0]
        disc = self._disc
        which = buf[start + disc] | buf[start + disc + 1] << 8 if disc + 2 <= dw * _W else 0
        member = self._by_disc.get(which)
        if member is None:
            return None
        kind, codec, index = member
        if codec is None:
            return request_id, kind, None
        if index >= pc:
            return request_id, kind, codec.default
        return request_id, kind, codec.read(buf, start + dw * _W + index * _W, end, budget)

    def encode(self, request_id: int, kind: str, fields: dict[str, Any] | None) -> bytes:
        member = self._by_kind.get(kind)
        if member is None:
            raise Unhandled(f"kind {kind!r}")
        disc, codec, index = member
        out = bytearray(16 + self._root_size)
        _U64.pack_into(out, _SEG, self._root)
        root = _SEG + _W
        _U64.pack_into(out, root, request_id)
        out[root + self._disc] = disc & 0xFF
        out[root + self._disc + 1] = disc >> 8
        if codec is None:
            if fields is not None:
                raise Unhandled("a Void member with fields")
        else:
            if type(fields) is not dict:
                raise Unhandled("a struct member without fields")
            codec.write(out, root + self.data_words * _W + index * _W, fields)
        _U32x2.pack_into(out, 0, 0, (len(out) - _SEG) >> 3)
        return bytes(out)


#: what a decode of hostile bytes may raise besides Unhandled (all mean "pycapnp decides")
DECODE_ERRORS = (Unhandled, struct.error, IndexError, UnicodeDecodeError, ValueError)
#: what an encode of values the fast path does not take may raise (pycapnp decides)
ENCODE_ERRORS = (Unhandled, struct.error, TypeError, OverflowError, ValueError)

_CODECS: dict[int, StructCodec] = {}


def struct_codec(schema: Any) -> StructCodec:
    """The (cached) :class:`StructCodec` of a struct schema."""
    node_id = schema.node.id
    codec = _CODECS.get(node_id)
    if codec is None:
        codec = _CODECS[node_id] = StructCodec(schema)
    return codec

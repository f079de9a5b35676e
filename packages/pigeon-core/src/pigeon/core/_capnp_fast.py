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

__all__ = ["Direct", "EnumValue", "FrameCodec", "StructCodec", "Unhandled", "struct_codec"]

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
        """Every field by name (nested structs and lists of them as dicts), enums by name:
        pycapnp's ``to_dict(verbose=True)`` (without ``verbose`` pycapnp leaves out the
        pointer fields that are null; the kinds decoded here are never read that way)."""
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


def _target(w: int, at: int, end: int) -> int:
    """Start of the target of the pointer word ``w`` found at byte ``at``."""
    start = at + _W + ((((w & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000) >> 2) * _W
    if start < _SEG or start > end:
        raise Unhandled("pointer out of bounds")
    return start


def _read_text(buf: Any, at: int, end: int, budget: list[int], default: str) -> str:
    w: int = _U64.unpack_from(buf, at)[0]
    if not w:
        return default
    start = at + _W + ((((w & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000) >> 2) * _W
    n = w >> 35
    if w & 0x700000003 != 0x200000001 or n < 1 or start < _SEG or start + n > end:
        raise Unhandled("bad text")
    budget[0] -= (n + 7) >> 3
    if budget[0] < 0 or buf[start + n - 1]:
        raise Unhandled("bad text")
    if n == 1:
        return ""
    text: str = bytes(buf[start : start + n - 1]).decode()
    return text


def _read_data(buf: Any, at: int, end: int, budget: list[int], default: bytes) -> bytes:
    w: int = _U64.unpack_from(buf, at)[0]
    if not w:
        return default
    start = _target(w, at, end)
    n = w >> 35
    if w & 0x700000003 != 0x200000001 or start + n > end:
        raise Unhandled("bad data")
    budget[0] -= (n + 7) >> 3
    if budget[0] < 0:
        raise Unhandled("traversal budget")
    return bytes(buf[start : start + n])


#: schema types whose values read back as themselves (:meth:`StructCodec.body_of`); an
#: int of another field type (a bool for an int) reads back as another type
_PLAIN_TYPES: dict[str, type] = {
    **{k: int for k in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")},
    "bool": bool,
    "text": str,
}


#: the values an integer field's encoder takes
_INT_RANGES: dict[str, tuple[int, int]] = {
    f"{sign}int{bits}": (0, (1 << bits) - 1) if sign else (-(1 << bits - 1), (1 << bits - 1) - 1)
    for sign in ("", "u")
    for bits in (8, 16, 32, 64)
}


def _as_bool(value: Any) -> int:
    if value is True:
        return 1
    if value is False:
        return 0
    raise Unhandled("not a bool")


class StructCodec:
    """The fixed-layout decoder and encoder of one struct (see the module doc).

    ``supported`` is False for a struct this codec has no layout for (a union, a group,
    a Void, interface or AnyPointer field, a float, list or struct default);
    :func:`struct_codec` builds one per schema node.  Both directions are Python
    functions generated from the layout (as :mod:`dataclasses` generates ``__init__``):
    one ``unpack_from`` / ``pack_into`` of the data section and a call per pointer."""

    def __init__(self, schema: Any) -> None:
        node = schema.node
        self.name: str = node.displayName.rpartition(":")[2]
        st = node.struct
        self.data_words: int = st.dataWordCount
        self.pointer_count: int = st.pointerCount
        self.supported = True
        fields = sorted(st.fields, key=lambda f: f.codeOrder)
        self.field_names: tuple[str, ...] = tuple(f.name for f in fields)
        if st.discriminantCount or any(f.which() != "slot" for f in fields):
            self.supported = False
            return
        #: decode expression of each field, in code order; ``@n@`` stands for data slot n
        self._exprs: list[str] = []
        #: the schema type of each field, in code order
        self._kinds: list[str] = []
        #: data slots: (byte offset, struct format, encode expressions OR-ed together)
        self._slots: list[tuple[int, str, list[str]]] = []
        self._bool_bytes: dict[int, int] = {}  # byte offset -> slot
        #: pointer field name -> (``put(out, pointer_at, value)``, the pointer's offset in
        #: the pointer section)
        self._pointers: dict[str, tuple[Callable[[bytearray, int, Any], None], int]] = {}
        self._env: dict[str, Any] = {
            "_text": _read_text,
            "_data": _read_data,
            "_b": _as_bool,
            "_Unhandled": Unhandled,
        }
        for f in fields:
            self._add_field(f, schema.fields[f.name])
            if not self.supported:
                return
        try:
            self._generate()
        except (ValueError, SyntaxError):  # a field name namedtuple or Python refuses
            self.supported = False

    # -- layout

    def _slot(self, offset: int, fmt: str) -> int:
        self._slots.append((offset, fmt, []))
        return len(self._slots) - 1

    def _add_field(self, proto: Any, field: Any) -> None:
        name = proto.name
        slot = proto.slot
        kind = slot.type.which()
        self._kinds.append(kind)
        default = slot.defaultValue
        i = len(self._exprs)
        get = f"_f.get({name!r}"
        if kind == "bool":
            byte, bit = divmod(slot.offset, 8)
            s = self._bool_bytes.get(byte)
            if s is None:
                s = self._bool_bytes[byte] = self._slot(byte, "B")
            flip = bool(default.bool)
            self._exprs.append(f"(v[@{s}@] >> {bit} & 1) {'==' if flip else '!='} 0")
            value = f"_b({get}, {flip}))"
            self._slots[s][2].append(f"({value} ^ 1) << {bit}" if flip else f"{value} << {bit}")
        elif kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            s = self._slot(slot.offset * size, fmt)
            if kind == "enum":
                values = _enum_values(field.schema)
                if values is None:
                    self.supported = False
                    return
                d = default.enum
                self._env[f"_E{i}"] = values
                self._env[f"_N{i}"] = {str(v): v.raw ^ d for v in values}
                self._exprs.append(f"_E{i}[v[@{s}@] ^ {d}]" if d else f"_E{i}[v[@{s}@]]")
                self._slots[s][2].append(f"(_N{i}[_f[{name!r}]] if {name!r} in _f else 0)")
            elif kind.startswith("float"):
                if getattr(default, kind) != 0:
                    self.supported = False  # stored XORed bit-wise: not worth it
                    return
                self._exprs.append(f"v[@{s}@]")
                self._slots[s][2].append(f"{get}, 0.0)")
            else:
                d = getattr(default, kind)
                self._exprs.append(f"(v[@{s}@] ^ {d})" if d else f"v[@{s}@]")
                self._slots[s][2].append(f"({get}, {d}) ^ {d})" if d else f"{get}, 0)")
        elif kind in ("text", "data", "list", "struct"):
            if slot.hadExplicitDefault and kind in ("list", "struct"):
                self.supported = False
                return
            p = slot.offset
            at = f"p + {p * _W}"
            if kind in ("text", "data"):
                d = default.text if kind == "text" else bytes(default.data)
                self._env[f"_D{i}"] = d
                read = f"_{kind}(buf, {at}, end, budget, _D{i})"
                null = f"_D{i}"
                self._pointers[name] = (_put_text if kind == "text" else _put_data, p * _W)
            elif kind == "struct":
                sub = struct_codec(field.schema)
                if not sub.supported:
                    self.supported = False
                    return
                self._env[f"_S{i}"] = sub
                read = f"_S{i}.read(buf, {at}, end, budget)"
                null = f"_S{i}.default"
                self._pointers[name] = (sub.put, p * _W)
            else:
                element = _ListElement.of(slot.type.list.elementType, field.schema)
                if element is None:
                    self.supported = False
                    return
                if element.kind == "struct":
                    self._env[f"_L{i}"] = (_read_struct_list, element.sub)
                elif element.kind in ("text", "data"):
                    self._env[f"_L{i}"] = (_read_pointer_list, element.kind)
                else:
                    self._env[f"_L{i}"] = (_read_number_list, element)
                read = f"_L{i}[0](buf, {at}, end, budget, _L{i}[1])"
                null = "[]"
                self._pointers[name] = (element.put, p * _W)
            self._exprs.append(f"({read} if pc > {p} else {null})")
        else:  # void, interface, anyPointer
            self.supported = False

    def _generate(self) -> None:
        size = self.data_words * _W
        order = sorted(range(len(self._slots)), key=lambda s: self._slots[s][0])
        fmt = ["<"]
        pos = 0
        for s in order:
            offset, f, _ = self._slots[s]
            if offset > pos:
                fmt.append(f"{offset - pos}x")
            fmt.append(f)
            pos = offset + struct.calcsize("<" + f)
        if size > pos:
            fmt.append(f"{size - pos}x")
        data = struct.Struct("".join(fmt))
        if data.size != size:
            raise ValueError(f"{self.name}: fields overlap or leave the data section")
        # unpack gives the slots in byte order: each slot's index in that tuple
        rank = {s: r for r, s in enumerate(order)}
        exprs = [re.sub(r"@(\d+)@", lambda m: str(rank[int(m[1])]), e) for e in self._exprs]
        base = namedtuple(self.name, self.field_names)  # type: ignore[misc]
        self.cls: type[_Body] = type(self.name, (_Body, base), {"__slots__": ()})
        zeros = bytes(size + self.pointer_count * _W)
        env = self._env
        env.update(
            _unpack=data.unpack_from,
            _pack=data.pack_into,
            _zeros=zeros,
            _new=tuple.__new__,
            _cls=self.cls,
            _NAMES=frozenset(self.field_names),
            _PTR=self._pointers,
        )
        if exprs == [f"v[{k}]" for k in range(len(exprs))] and len(exprs) == len(order):
            values = "v"  # every field a plain number, in byte order: the tuple itself
        else:
            values = f"({', '.join(exprs)}{',' if len(exprs) == 1 else ''})"
        lines = [
            "def decode(buf, pos, dw, pc, end, budget):",
            f"    if dw >= {self.data_words}:",
            "        v = _unpack(buf, pos)",
            "    else:  # an older, smaller struct: the fields it lacks read as zero",
            f"        v = _unpack(bytes(buf[pos:pos + dw * 8]).ljust({size}, b'\\0'))",
        ]
        if self._pointers:
            lines.append("    p = pos + dw * 8")
        lines += [
            f"    return _new(_cls, {values})",
            "",
            "def fill(out, start, _f):",
            "    if not _f.keys() <= _NAMES:",
            "        raise _Unhandled('a field this struct does not have')",
        ]
        if order:
            packed = ", ".join(" | ".join(self._slots[s][2]) for s in order)
            lines.append(f"    _pack(out, start, {packed})")
        if self._pointers:
            lines += [
                f"    base = start + {size}",
                "    for name, value in _f.items():",
                "        ptr = _PTR.get(name)",
                "        if ptr is not None:",
                "            ptr[0](out, base + ptr[1], value)",
            ]
        exec("\n".join(lines) + "\n", env)  # generated from the schema
        self.decode: Callable[..., _Body] = env["decode"]
        self.fill: Callable[[bytearray, int, dict[str, Any]], None] = env["fill"]
        self._zeros = zeros
        #: bytes of the struct without what its pointers point to
        self.size = len(zeros)
        self._root = self.data_words << 32 | self.pointer_count << 48 if zeros else 0xFFFFFFFC
        self.default: _Body = self.decode(zeros, 0, self.data_words, 0, len(zeros), [0])
        #: the body of a message built from ``fields`` without reading it back
        #: (:meth:`body_of`): field name -> (index, the one type its value reads back
        #: as itself: ints, bools, texts); the defaults; the fields read as a new list
        self._plain: dict[str, tuple[int, type]] = {}
        for i, (kind, name) in enumerate(zip(self._kinds, self.field_names, strict=True)):
            if kind in _PLAIN_TYPES:
                self._plain[name] = (i, _PLAIN_TYPES[kind])
        #: the int and bool fields (:meth:`scalar_body`): name -> (index, type, range)
        self._scalars: dict[str, tuple[int, type, int, int]] = {}
        for i, (kind, name) in enumerate(zip(self._kinds, self.field_names, strict=True)):
            if kind in _INT_RANGES:
                self._scalars[name] = (i, int, *_INT_RANGES[kind])
            elif kind == "bool":
                self._scalars[name] = (i, bool, 0, 1)
        self._defaults = list(self.default)
        self._new_lists = [i for i, kind in enumerate(self._kinds) if kind == "list"]

    # -- decoding

    def read(self, buf: Any, at: int, end: int, budget: list[int]) -> _Body:
        """The struct the pointer at byte ``at`` points to (its default when null)."""
        w: int = _U64.unpack_from(buf, at)[0]
        if not w:
            return self.default
        start = at + _W + ((((w & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000) >> 2) * _W
        dw = (w >> 32) & 0xFFFF
        pc = w >> 48
        words = dw + pc
        budget[0] -= words or 1
        if w & 3 or start < _SEG or start + words * _W > end or budget[0] < 0:
            raise Unhandled("struct out of bounds")
        return self.decode(buf, start, dw, pc, end, budget)

    def decode_message(self, buf: bytes | bytearray | memoryview) -> _Body:
        """Decode a whole one-segment message whose root is this struct."""
        if len(buf) < 16:
            raise Unhandled("message too short")
        extra, words = _U32x2.unpack_from(buf, 0)
        end = _SEG + words * _W
        if extra or end > len(buf):
            raise Unhandled("not one segment")
        return self.read(buf, _SEG, end, [words])

    def _fresh_values(self) -> list[Any]:
        """The default values of a body, each list one of its own (as each decode
        returns)."""
        values = self._defaults.copy()
        for i in self._new_lists:
            values[i] = []
        return values

    def scalar_body(self, fields: dict[str, Any]) -> _Body:
        """What :meth:`decode` reads from the struct :meth:`put` writes for ``fields``
        when they are all ints and bools (checked here as the encoder checks them: the
        type, the field's range), without writing it; raises Unhandled for any other
        field or value (:meth:`FrameCodec.direct`)."""
        values = self._fresh_values()
        scalars = self._scalars
        for name, value in fields.items():
            spec = scalars.get(name)
            if spec is None:
                raise Unhandled("not an int or bool field")
            i, kind, lo, hi = spec
            same_type = type(value) is kind  # (first: a str compared with an int raises)
            if not same_type or not lo <= value <= hi:
                raise Unhandled("a value its encoder refuses, or one of another type")
            values[i] = value
        return tuple.__new__(self.cls, values)

    def body_of(self, fields: dict[str, Any]) -> _Body:
        """What :meth:`decode` reads from the struct :meth:`put` writes for ``fields``
        (which ``put`` must have taken: it checks them): the values themselves when
        each is one that reads back as itself (an int, a bool, a text), the others read
        back from the bytes (:meth:`FrameCodec.direct`)."""
        values = self._fresh_values()
        plain = self._plain
        for name, value in fields.items():
            spec = plain.get(name)
            if spec is None or type(value) is not spec[1]:
                raise Unhandled("a value that may not read back as itself")
            values[spec[0]] = value
        return tuple.__new__(self.cls, values)

    # -- encoding

    def put(self, out: bytearray, at: int, fields: Any) -> None:
        """Append this struct, holding ``fields`` (a dict), to ``out`` and point the
        pointer at byte ``at`` of ``out`` to it."""
        if type(fields) is not dict:
            raise Unhandled("not a dict")
        start = len(out)
        if self._zeros:
            _U64.pack_into(out, at, (((start - at - _W) >> 1) & 0xFFFFFFFC) | self._root)
        else:
            _U64.pack_into(out, at, 0xFFFFFFFC)
        out += self._zeros
        self.fill(out, start, fields)

    def encode_message(self, fields: dict[str, Any]) -> bytes:
        """A whole one-segment message whose root is this struct."""
        out = bytearray(16)
        self.put(out, _SEG, fields)
        _U32x2.pack_into(out, 0, 0, (len(out) - _SEG) >> 3)
        return bytes(out)


def _enum_values(schema: Any) -> tuple[EnumValue, ...] | None:
    """The values of an enum, indexed by number (None if the numbers have gaps)."""
    values = tuple(
        EnumValue(n, r) for n, r in sorted(schema.enumerants.items(), key=lambda e: e[1])
    )
    return values if [v.raw for v in values] == list(range(len(values))) else None


# ------------------------------------------------------------------ lists


class _ListElement:
    """How the items of a list field are read and written."""

    def __init__(self, kind: str, size_code: int, fmt: str = "", sub: Any = None) -> None:
        self.kind = kind  # "scalar", "enum", "text", "data", "struct"
        self.size_code = size_code
        self.fmt = fmt
        self.size = struct.calcsize("<" + fmt) if fmt else 0
        #: enum: the values by number; struct: the items' StructCodec
        self.sub = sub
        self.names = {str(v): v.raw for v in sub} if kind == "enum" else {}

    @classmethod
    def of(cls, element: Any, list_schema: Any) -> _ListElement | None:
        kind = element.which()
        if kind == "enum":
            values = _enum_values(list_schema.elementType)
            return None if values is None else cls("enum", 3, "H", values)
        if kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            return cls("scalar", _ELEMENT_SIZE[size], fmt)
        if kind in ("text", "data"):
            return cls(kind, 6)
        if kind == "struct":
            sub = struct_codec(list_schema.elementType)
            return cls("struct", 7, sub=sub) if sub.supported else None
        return None  # bool, void, nested lists, AnyPointer: the pycapnp path

    def put(self, out: bytearray, at: int, value: Any) -> None:
        """Append the list ``value`` to ``out``; point the pointer at byte ``at`` to it."""
        if type(value) is not list and type(value) is not tuple:
            raise Unhandled("not a list")
        n = len(value)
        start = len(out)
        kind = self.kind
        if kind == "struct":
            sub: StructCodec = self.sub
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
            put = _put_text if kind == "text" else _put_data
            for i, item in enumerate(value):
                put(out, start + i * _W, item)
        else:
            if kind == "enum":
                names = self.names
                try:
                    value = [names[v] for v in value]
                except (KeyError, TypeError):
                    raise Unhandled("not enum names") from None
            _list_pointer(out, at, start, self.size_code, n)
            if not n:
                return
            raw = struct.pack(f"<{n}{self.fmt}", *value)
            out += raw
            pad = -len(raw) & 7
            if pad:
                out += bytes(pad)


def _list_target(w: int, at: int, end: int, size_code: int) -> int:
    """Start of the target of the list pointer word ``w`` found at byte ``at``."""
    if w & 0x700000003 != 1 | size_code << 32:
        raise Unhandled("not a list of the expected element size")
    start = at + _W + ((((w & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000) >> 2) * _W
    if start < _SEG or start > end:
        raise Unhandled("pointer out of bounds")
    return start


def _read_struct_list(
    buf: Any, at: int, end: int, budget: list[int], sub: StructCodec
) -> list[Any]:
    w: int = _U64.unpack_from(buf, at)[0]
    if not w:
        return []
    start = _list_target(w, at, end, 7)
    count = w >> 35
    if start + _W + count * _W > end:
        raise Unhandled("list out of bounds")
    tag: int = _U64.unpack_from(buf, start)[0]
    n = (tag & 0xFFFFFFFF) >> 2
    dw = (tag >> 32) & 0xFFFF
    pc = tag >> 48
    budget[0] -= max(count, n) + 1
    if tag & 3 or n * (dw + pc) > count or budget[0] < 0:
        raise Unhandled("bad struct list")
    decode = sub.decode
    if n == 1:
        return [decode(buf, start + _W, dw, pc, end, budget)]
    step = (dw + pc) * _W
    first = start + _W
    return [decode(buf, first + i * step, dw, pc, end, budget) for i in range(n)]


def _read_pointer_list(buf: Any, at: int, end: int, budget: list[int], kind: str) -> list[Any]:
    w: int = _U64.unpack_from(buf, at)[0]
    if not w:
        return []
    start = _list_target(w, at, end, 6)
    count = w >> 35
    budget[0] -= count
    if start + count * _W > end or budget[0] < 0:
        raise Unhandled("list out of bounds")
    if kind == "text":
        return [_read_text(buf, start + i * _W, end, budget, "") for i in range(count)]
    return [_read_data(buf, start + i * _W, end, budget, b"") for i in range(count)]


def _read_number_list(
    buf: Any, at: int, end: int, budget: list[int], element: _ListElement
) -> list[Any]:
    w: int = _U64.unpack_from(buf, at)[0]
    if not w:
        return []
    start = _list_target(w, at, end, element.size_code)
    count = w >> 35
    if not count:
        return []
    nbytes = count * element.size
    budget[0] -= (nbytes + 7) >> 3
    if start + nbytes > end or budget[0] < 0:
        raise Unhandled("list out of bounds")
    items = list(struct.unpack_from(f"<{count}{element.fmt}", buf, start))
    if element.kind == "enum":
        values = element.sub
        return [values[r] for r in items]  # IndexError: a value this schema does not know
    return items


# ------------------------------------------------------------------ writing pointers


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


# ------------------------------------------------------------------ frames


class FrameCodec:
    """Decoder and encoder of a root frame struct (``requestId`` plus a union of kinds)
    for the union members in ``kinds`` whose struct has a layout (and Void members).

    :meth:`decode` returns ``(request_id, kind, body)`` (``body`` None for a Void
    member), or None for a member it does not handle; :meth:`encode` returns the
    message bytes.  Both raise one of :data:`DECODE_ERRORS` / :data:`ENCODE_ERRORS` when
    the pycapnp path must decide."""

    def __init__(self, frame_type: Any, kinds: Iterable[str]) -> None:
        schema = frame_type.schema
        st = schema.node.struct
        dw: int = st.dataWordCount
        pc: int = st.pointerCount
        self._disc = disc_at = st.discriminantOffset * 2
        request = schema.fields["requestId"].proto
        if request.slot.type.which() != "uint64" or request.slot.offset != 0 or not dw:
            raise ValueError("a frame struct starts with requestId :UInt64")
        #: reads requestId and the discriminant of a root struct of at least dw words
        self._head = struct.Struct(f"<Q{disc_at - 8}xH" if disc_at >= 8 else "<QH")
        if disc_at < 8:
            raise ValueError("the discriminant of a frame struct follows requestId")
        self._dw = dw
        #: discriminant -> (kind, StructCodec or None for Void, pointer index)
        self._by_disc: dict[int, tuple[str, StructCodec | None, int]] = {}
        #: kind -> (StructCodec or None, the message up to the body, without requestId)
        self._by_kind: dict[str, tuple[StructCodec | None, bytes]] = {}
        for name in kinds:
            proto = schema.fields[name].proto
            kind = proto.slot.type.which()
            codec: StructCodec | None = None
            index = 0
            if kind == "struct":
                codec = struct_codec(schema.fields[name].schema)
                index = proto.slot.offset
                if not codec.supported or index >= pc:
                    continue
            elif kind != "void":
                continue
            value = proto.discriminantValue
            self._by_disc[value] = (name, codec, index)
            # segment table (sizes filled in), root pointer, root struct with the
            # discriminant set and (for a struct member) its pointer to the body that
            # follows at once
            prefix = bytearray(16 + (dw + pc) * _W)
            _U64.pack_into(prefix, _SEG, dw << 32 | pc << 48)
            prefix[16 + disc_at] = value & 0xFF
            prefix[16 + disc_at + 1] = value >> 8
            if codec is not None:
                at = 16 + dw * _W + index * _W
                if codec._zeros:
                    ptr = (((len(prefix) - at - _W) >> 1) & 0xFFFFFFFC) | codec._root
                else:
                    ptr = 0xFFFFFFFC
                _U64.pack_into(prefix, at, ptr)
            self._by_kind[name] = (codec, bytes(prefix))
        self.kinds = frozenset(self._by_kind)

    def decode(self, buf: bytes | bytearray | memoryview) -> tuple[int, str, Any] | None:
        size = len(buf)
        if size < 16:
            raise Unhandled("message too short")
        extra, words, w = _TABLE_AND_ROOT.unpack_from(buf, 0)
        end = _SEG + words * _W
        if extra or end > size or w & 3:
            raise Unhandled("not one segment, or no struct at its root")
        if not w:
            return None  # a null root: the pycapnp path
        start = _target(w, _SEG, end)
        dw = (w >> 32) & 0xFFFF
        pc = w >> 48
        if start + (dw + pc) * _W > end:
            raise Unhandled("root out of bounds")
        if dw >= self._dw:
            request_id, which = self._head.unpack_from(buf, start)
        else:  # an older root: what it lacks reads as zero
            head = bytes(buf[start : start + dw * _W]).ljust(self._dw * _W, b"\0")
            request_id, which = self._head.unpack_from(head, 0)
        member = self._by_disc.get(which)
        if member is None:
            return None
        kind, codec, index = member
        if codec is None:
            return request_id, kind, None
        if index >= pc:
            return request_id, kind, codec.default
        body = codec.read(buf, start + dw * _W + index * _W, end, [words])
        return request_id, kind, body

    def encode(self, request_id: int, kind: str, fields: dict[str, Any] | None) -> bytes:
        member = self._by_kind.get(kind)
        if member is None:
            raise Unhandled(f"kind {kind!r}")
        codec, prefix = member
        out = bytearray(prefix)
        _U64.pack_into(out, 16, request_id)
        if codec is None:
            if fields is not None:
                raise Unhandled("a Void member with fields")
        else:
            if type(fields) is not dict:
                raise Unhandled("a struct member without fields")
            start = len(out)
            out += codec._zeros
            codec.fill(out, start, fields)
        _U32x2.pack_into(out, 0, 0, (len(out) - _SEG) >> 3)
        return bytes(out)

    def direct(self, request_id: int, kind: str, fields: dict[str, Any] | None) -> Direct | None:
        """What :meth:`decode` would return for the message :meth:`encode` builds, without
        the message: for an in-process link (:mod:`pigeon.core._local_link`), whose
        receiver would decode at once what its sender just encoded.  The body is still
        written and read by the same generated code (every value the encoder refuses
        is refused, every one it takes reads back as :meth:`decode` reads it); only the
        frame around it (segment table, root struct, request id) is skipped.  None when
        this codec does not take ``kind`` or these values: the caller builds the
        message (:func:`~pigeon.core._framing.build_message`)."""
        member = self._by_kind.get(kind)
        if member is None:
            return None
        codec, prefix = member
        if codec is None:
            if fields is not None:
                return None
            return Direct((request_id, kind, None), len(prefix))
        if type(fields) is not dict:
            return None
        try:
            return Direct((request_id, kind, codec.scalar_body(fields)), len(prefix) + codec.size)
        except Unhandled:
            pass
        out = bytearray(codec._zeros)
        try:
            codec.fill(out, 0, fields)  # every value checked as encode checks it
        except ENCODE_ERRORS:
            return None
        end = len(out)
        try:
            body = codec.body_of(fields)
        except Unhandled:
            try:
                body = codec.decode(out, 0, codec.data_words, codec.pointer_count, end, [end])
            except DECODE_ERRORS:
                return None
        return Direct((request_id, kind, body), len(prefix) + end)


class Direct:
    """A frame handed over in process without its message (:meth:`FrameCodec.direct`):
    ``fast`` is what :meth:`FrameCodec.decode` returns for it, ``len()`` the size of
    the message it stands for."""

    __slots__ = ("fast", "size")

    def __init__(self, fast: tuple[int, str, Any], size: int) -> None:
        self.fast = fast
        self.size = size

    def __len__(self) -> int:
        return self.size


_TABLE_AND_ROOT = struct.Struct("<IIQ")
#: what a decode of hostile bytes may raise besides Unhandled (all mean "pycapnp decides")
DECODE_ERRORS = (Unhandled, struct.error, IndexError, UnicodeDecodeError, ValueError)
#: what an encode of values the fast path does not take may raise (pycapnp decides)
ENCODE_ERRORS = (Unhandled, struct.error, TypeError, OverflowError, ValueError, KeyError)

_CODECS: dict[int, StructCodec] = {}


def struct_codec(schema: Any) -> StructCodec:
    """The (cached) :class:`StructCodec` of a struct schema."""
    node_id = schema.node.id
    codec = _CODECS.get(node_id)
    if codec is None:
        codec = _CODECS[node_id] = StructCodec(schema)
    return codec

"""Postcard 1.x encoding of the schema, as the unix socket carries it.

Unsigned integers wider than a byte are LEB128 varints, `u8` and `bool` one raw byte,
`f32` four little-endian bytes, strings and vectors a varint count then their items, an
option a 0/1 byte, structs and tuples their fields back to back, enums a varint variant
index then the variant's fields. Trailing bytes after a complete value are ignored.
"""

from __future__ import annotations

import struct
from typing import Any

from .types import (
    BLOB_T,
    BOOL_T,
    F32_T,
    LIMITS,
    STR_T,
    U8_T,
    EnumShape,
    FixedShape,
    OptionShape,
    PrimShape,
    StructShape,
    TupleShape,
    VecShape,
    shape_of,
    variant_of,
)


class DecodeError(ValueError):
    """The bytes are not a valid postcard encoding of the expected type."""


def encode(value: Any, tp: Any = None) -> bytes:
    """Encode a schema value; `tp` is needed only for non-class types."""
    out = bytearray()
    _encode(out, value, shape_of(tp if tp is not None else _root_type(value)))
    return bytes(out)


def decode(data: bytes, tp: Any) -> Any:
    """Decode one value of type `tp` from the start of `data`."""
    reader = _Reader(memoryview(data))
    try:
        return _decode(reader, shape_of(tp))
    except RecursionError:
        raise DecodeError("the value is nested too deeply") from None


def _root_type(value: Any) -> Any:
    cls = type(value)
    return getattr(cls, "enum", cls)


def write_varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _encode(out: bytearray, value: Any, shape: Any) -> None:
    kind = type(shape)
    if kind is PrimShape:
        prim = shape.prim
        if prim is STR_T:
            raw = value.encode("utf-8")
            write_varint(out, len(raw))
            out += raw
        elif prim is BOOL_T:
            out.append(1 if value else 0)
        elif prim is U8_T:
            out.append(value)
        elif prim is F32_T:
            out += struct.pack("<f", value)
        elif prim is BLOB_T:
            write_varint(out, len(value))
            out += value
        else:
            if not 0 <= value <= LIMITS[prim]:
                raise ValueError(f"{value} does not fit in {prim}")
            write_varint(out, value)
    elif kind is VecShape:
        write_varint(out, len(value))
        item = shape.item
        if type(item) is PrimShape and item.prim in LIMITS and item.prim is not U8_T:
            for n in value:
                write_varint(out, n)
        else:
            for element in value:
                _encode(out, element, item)
    elif kind is OptionShape:
        if value is None and shape.trailing:
            return  # a trailing option that is unset stays off the wire, as an older peer writes it
        if value is None:
            out.append(0)
        else:
            out.append(1)
            _encode(out, value, shape.inner)
    elif kind is StructShape:
        for field in shape.fields:
            _encode(out, getattr(value, field.attr), field.shape)
    elif kind is EnumShape:
        _, index, _ = variant_of(value)
        write_varint(out, index)
        _encode(out, value, shape.variants[index])
    elif kind is TupleShape:
        for element, item in zip(value, shape.items, strict=True):
            _encode(out, element, item)
    elif kind is FixedShape:
        if len(value) != shape.size:
            raise ValueError(f"expected {shape.size} bytes, got {len(value)}")
        out += value
    else:
        raise TypeError(f"unknown shape {shape!r}")


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise DecodeError("Hit the end of buffer, expected more data")
        chunk = bytes(self.buf[self.pos : end])
        self.pos = end
        return chunk

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            raise DecodeError("Hit the end of buffer, expected more data")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self, limit: int) -> int:
        result = 0
        shift = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 70:
                raise DecodeError("Found a bad varint")
        if result > limit:
            raise DecodeError(f"varint {result} is out of range")
        return result


def _decode(r: _Reader, shape: Any) -> Any:
    kind = type(shape)
    if kind is PrimShape:
        prim = shape.prim
        if prim is STR_T:
            raw = r.take(r.varint(1 << 62))
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DecodeError(f"invalid UTF-8 in string: {e}") from None
        if prim is BOOL_T:
            b = r.byte()
            if b > 1:
                raise DecodeError(f"invalid bool byte {b}")
            return b == 1
        if prim is U8_T:
            return r.byte()
        if prim is F32_T:
            return f32_value(struct.unpack("<f", r.take(4))[0])
        if prim is BLOB_T:
            return r.take(r.varint(1 << 62))
        return r.varint(LIMITS[prim])
    if kind is VecShape:
        count = r.varint(1 << 62)
        item = shape.item
        if count > len(r.buf) - r.pos and not _zero_sized(item):
            # each element takes at least a byte: refuse before allocating a huge list
            raise DecodeError("Hit the end of buffer, expected more data")
        if type(item) is PrimShape and item.prim in LIMITS and item.prim is not U8_T:
            limit = LIMITS[item.prim]
            return [r.varint(limit) for _ in range(count)]
        return [_decode(r, item) for _ in range(count)]
    if kind is OptionShape:
        if shape.trailing and r.pos >= len(r.buf):
            return None
        tag = r.byte()
        if tag == 0:
            return None
        if tag == 1:
            return _decode(r, shape.inner)
        raise DecodeError(f"invalid option tag {tag}")
    if kind is StructShape:
        return shape.cls(*[_decode(r, f.shape) for f in shape.fields])
    if kind is EnumShape:
        index = r.varint(1 << 32)
        if index >= len(shape.variants):
            raise DecodeError(f"unknown {shape.cls.__name__} variant index {index}")
        return _decode(r, shape.variants[index])
    if kind is TupleShape:
        return tuple(_decode(r, item) for item in shape.items)
    if kind is FixedShape:
        return r.take(shape.size)
    raise TypeError(f"unknown shape {shape!r}")


def _zero_sized(shape: Any) -> bool:
    return type(shape) is StructShape and not shape.fields


def f32_value(x: float) -> float:
    """The shortest decimal that rounds to the same f32 as `x`, as a Python float.

    Keeps f32 fields stable whether they arrived as JSON text or as postcard bytes.
    """
    if x != x or x in (float("inf"), float("-inf")):
        return x
    packed = struct.pack("<f", x)
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        try:
            if struct.pack("<f", candidate) == packed:
                return candidate
        except OverflowError:  # rounded past the largest f32
            continue
    return struct.unpack("<f", packed)[0]

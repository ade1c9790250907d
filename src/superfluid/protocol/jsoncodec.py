"""JSON encoding of the schema, as the browser transport carries it (serde's defaults).

Enums are externally tagged: `{"Variant": {fields}}`, or the bare string `"Variant"`
for a variant without fields (`{"Variant": null}` is accepted on input). Structs are
objects in declaration order; tuples are arrays; bytes are arrays of numbers. On input,
unknown fields are ignored, a missing optional field is null, and anything else missing
or mistyped is an error that names the field.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .postcard import f32_value
from .types import (
    BLOB_T,
    BOOL_T,
    F32_T,
    LIMITS,
    STR_T,
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


class JsonShapeError(ValueError):
    """A JSON value does not have the shape the schema expects."""


def to_json(value: Any, tp: Any = None) -> Any:
    """The JSON-ready form (dicts, lists, numbers) of a schema value."""
    if tp is None:
        cls = type(value)
        tp = getattr(cls, "enum", cls)
    return _out(value, shape_of(tp))


# One encoder for every compact text: json.dumps with arguments builds an encoder per call, the largest
# single cost (8%) of the daemon's time holding the GIL while it streamed one reply token by token.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def compact(obj: Any) -> str:
    """Compact JSON text of parsed JSON (dicts, lists, strings, numbers), one line."""
    return _COMPACT.encode(obj)


def sse(obj: Any, event: str | None = None) -> str:
    """A server-sent event whose data is `obj` as compact JSON, named `event` where given."""
    data = f"data: {_COMPACT.encode(obj)}\n\n"
    return data if event is None else f"event: {event}\n{data}"


def dumps(value: Any, tp: Any = None) -> str:
    """Compact JSON text of a schema value, one line."""
    return compact(to_json(value, tp))


def from_json(obj: Any, tp: Any) -> Any:
    """Build a schema value of type `tp` from parsed JSON, or raise `JsonShapeError`."""
    return _in(obj, shape_of(tp), "")


def loads(text: str | bytes, tp: Any) -> Any:
    """Parse JSON text into a schema value of type `tp`."""
    try:
        obj = json.loads(text)
        return from_json(obj, tp)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise JsonShapeError(str(e)) from None
    except RecursionError:
        raise JsonShapeError("the JSON is nested too deeply") from None


def _out(value: Any, shape: Any) -> Any:
    kind = type(shape)
    if kind is PrimShape:
        if shape.prim is F32_T:
            return f32_value(value) if math.isfinite(value) else None
        if shape.prim is BLOB_T:
            return list(value)
        return value
    if kind is VecShape:
        item = shape.item
        if type(item) is PrimShape and item.prim in LIMITS:
            return list(value)
        return [_out(v, item) for v in value]
    if kind is OptionShape:
        return None if value is None else _out(value, shape.inner)
    if kind is StructShape:
        return {
            f.wire: _out(getattr(value, f.attr), f.shape)
            for f in shape.fields
            if not (getattr(value, f.attr) is None and type(f.shape) is OptionShape and f.shape.trailing)
        }
    if kind is EnumShape:
        _, index, name = variant_of(value)
        variant = shape.variants[index]
        if not variant.fields:
            return name
        return {name: _out(value, variant)}
    if kind is TupleShape:
        return [_out(v, s) for v, s in zip(value, shape.items, strict=True)]
    if kind is FixedShape:
        return list(value)
    raise TypeError(f"unknown shape {shape!r}")


def _describe(obj: Any) -> str:
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return f"boolean `{str(obj).lower()}`"
    if isinstance(obj, int):
        return f"integer `{obj}`"
    if isinstance(obj, float):
        return f"floating point `{obj}`"
    if isinstance(obj, str):
        return f"string {json.dumps(obj)}"
    if isinstance(obj, list):
        return "sequence"
    return "map"


def _fail(path: str, message: str) -> JsonShapeError:
    return JsonShapeError(f"{message} at {path}" if path else message)


def _expect(obj: Any, what: str, path: str) -> JsonShapeError:
    return _fail(path, f"invalid type: {_describe(obj)}, expected {what}")


def _in(obj: Any, shape: Any, path: str) -> Any:
    kind = type(shape)
    if kind is PrimShape:
        return _prim_in(obj, shape.prim, path)
    if kind is VecShape:
        if not isinstance(obj, list):
            raise _expect(obj, "a sequence", path)
        return [_in(v, shape.item, f"{path}[{i}]") for i, v in enumerate(obj)]
    if kind is OptionShape:
        return None if obj is None else _in(obj, shape.inner, path)
    if kind is StructShape:
        return _struct_in(obj, shape, path)
    if kind is EnumShape:
        return _enum_in(obj, shape, path)
    if kind is TupleShape:
        if not isinstance(obj, list) or len(obj) != len(shape.items):
            raise _expect(obj, f"a tuple of size {len(shape.items)}", path)
        return tuple(_in(v, s, f"{path}[{i}]") for i, (v, s) in enumerate(zip(obj, shape.items, strict=True)))
    if kind is FixedShape:
        data = _prim_in(obj, BLOB_T, path)
        if len(data) != shape.size:
            raise _fail(path, f"invalid length {len(data)}, expected an array of length {shape.size}")
        return data
    raise TypeError(f"unknown shape {shape!r}")


def _prim_in(obj: Any, prim: Any, path: str) -> Any:
    if prim is STR_T:
        if not isinstance(obj, str):
            raise _expect(obj, "a string", path)
        return obj
    if prim is BOOL_T:
        if not isinstance(obj, bool):
            raise _expect(obj, "a boolean", path)
        return obj
    if prim is F32_T:
        if isinstance(obj, bool) or not isinstance(obj, (int, float)):
            raise _expect(obj, "f32", path)
        return f32_value(float(obj))
    if prim is BLOB_T:
        if not isinstance(obj, list):
            raise _expect(obj, "a sequence of bytes", path)
        for i, b in enumerate(obj):
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= 255:
                raise _expect(b, "u8", f"{path}[{i}]")
        return bytes(obj)
    if isinstance(obj, bool) or not isinstance(obj, int):
        raise _expect(obj, str(prim), path)
    if not 0 <= obj <= LIMITS[prim]:
        raise _fail(path, f"invalid value: integer `{obj}`, expected {prim}")
    return obj


def _struct_in(obj: Any, shape: StructShape, path: str) -> Any:
    name = shape.cls.__name__
    if obj is None and not shape.fields:
        return shape.cls()
    if not isinstance(obj, dict):
        raise _expect(obj, f"struct {name}", path)
    values = []
    for field in shape.fields:
        here = f"{path}.{field.wire}" if path else field.wire
        if field.wire in obj:
            values.append(_in(obj[field.wire], field.shape, here))
        elif type(field.shape) is OptionShape:
            values.append(None)
        else:
            raise _fail(path or name, f"missing field `{field.wire}`")
    return shape.cls(*values)


def _enum_in(obj: Any, shape: EnumShape, path: str) -> Any:
    by_name = shape.cls.by_name
    if isinstance(obj, str):
        name, payload = obj, None
    elif isinstance(obj, dict) and len(obj) == 1:
        ((name, payload),) = obj.items()
    else:
        raise _expect(obj, f"enum {shape.cls.__name__}", path)
    variant = by_name.get(name)
    if variant is None:
        expected = ", ".join(f"`{n}`" for n in by_name)
        raise _fail(path, f"unknown variant `{name}`, expected one of {expected}")
    variant_shape = shape.variants[variant.index]  # type: ignore[attr-defined]
    if isinstance(obj, str) and variant_shape.fields:
        raise _fail(path, f"invalid type: unit variant, expected struct variant {name}")
    return _struct_in(payload, variant_shape, path or name)

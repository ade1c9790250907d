"""The vocabulary the protocol schema is written in.

A wire struct is a `Struct` subclass; a wire enum is an `Enum` subclass whose nested
`Struct` classes are its variants, in wire order. Field annotations name the wire type
(`U8`, `U32`, `U64`, `F32`, `bool`, `str`, `Blob`, `list[...]`, `tuple[...]`, `X | None`).
Both codecs read these declarations through `shape_of`, so the schema is written once.

A field whose Python name ends in `_` (such as `class_`) has the underscore dropped on
the wire, since the protocol uses names that are Python keywords.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Union, dataclass_transform


class Prim:
    """A primitive wire type; `name` is what error messages call it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


U8_T = Prim("u8")
U32_T = Prim("u32")
U64_T = Prim("u64")
F32_T = Prim("f32")
BOOL_T = Prim("bool")
STR_T = Prim("string")
BLOB_T = Prim("bytes")


@dataclass(frozen=True)
class Fixed:
    """A fixed-size byte array (`[u8; n]`): raw bytes on postcard, n numbers in JSON."""

    size: int


@dataclass(frozen=True)
class TrailingOptional:
    """An `Option` that a postcard frame may omit entirely by ending before it."""


U8 = Annotated[int, U8_T]
U32 = Annotated[int, U32_T]
U64 = Annotated[int, U64_T]
F32 = Annotated[float, F32_T]
Blob = Annotated[bytes, BLOB_T]

LIMITS = {U8_T: 0xFF, U32_T: 0xFFFF_FFFF, U64_T: 0xFFFF_FFFF_FFFF_FFFF}


@dataclass_transform(frozen_default=True)
class Struct:
    """Base of every wire struct and enum variant: subclasses become frozen dataclasses."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclass(frozen=True)(cls)


class Enum:
    """Base of a wire enum: its nested `Struct` classes are the variants, in wire order."""

    variants: ClassVar[tuple[type[Struct], ...]]
    by_name: ClassVar[dict[str, type[Struct]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found = [v for v in vars(cls).values() if isinstance(v, type) and issubclass(v, Struct)]
        cls.variants = tuple(found)
        cls.by_name = {v.__name__: v for v in found}
        for index, variant in enumerate(found):
            variant.enum = cls  # type: ignore[attr-defined]
            variant.index = index  # type: ignore[attr-defined]


def variant_of(value: Struct) -> tuple[type[Enum], int, str]:
    """The enum, wire index and wire name of an enum variant value."""
    cls = type(value)
    return cls.enum, cls.index, cls.__name__  # type: ignore[attr-defined]


# ---- shapes: the resolved form of an annotation, built once per class and cached ----


@dataclass(frozen=True)
class PrimShape:
    """A primitive."""

    prim: Prim


@dataclass(frozen=True)
class FixedShape:
    """A fixed-size byte array."""

    size: int


@dataclass(frozen=True)
class VecShape:
    """A vector of items."""

    item: Any


@dataclass(frozen=True)
class OptionShape:
    """An optional value (`trailing`: a frame may end before it)."""

    inner: Any
    trailing: bool = False


@dataclass(frozen=True)
class TupleShape:
    """A tuple."""

    items: tuple[Any, ...]


@dataclass(frozen=True)
class FieldShape:
    """One field: its Python name, its wire name and shape."""

    attr: str
    wire: str
    shape: Any


@dataclass
class StructShape:
    """A struct: its class and fields in wire order."""

    cls: type
    fields: tuple[FieldShape, ...] = ()


@dataclass
class EnumShape:
    """An enum: its class and its variants in wire order."""

    cls: type[Enum]
    variants: tuple[StructShape, ...] = ()


Shape = PrimShape | FixedShape | VecShape | OptionShape | TupleShape | StructShape | EnumShape

_shapes: dict[type, StructShape | EnumShape] = {}  # whole shapes only: read with no lock by every codec call
# Shapes being built: registered before their parts are filled in (an enum may nest itself), and
# published to `_shapes` whole once the outermost one is done, so no thread reads one half-made.
_building: dict[type, StructShape | EnumShape] = {}
_building_lock = threading.RLock()

_PLAIN = {bool: BOOL_T, str: STR_T, bytes: BLOB_T}


def shape_of(tp: Any) -> Any:
    """Resolve an annotation (or a Struct/Enum class) into its cached shape."""
    if isinstance(tp, type) and issubclass(tp, (Struct, Enum)):
        return _class_shape(tp)
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *extra = typing.get_args(tp)
        for marker in extra:
            if isinstance(marker, Prim):
                return PrimShape(marker)
            if isinstance(marker, Fixed):
                return FixedShape(marker.size)
            if isinstance(marker, TrailingOptional):
                inner = shape_of(base)
                return OptionShape(inner.inner, trailing=True)
        return shape_of(base)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"only `X | None` unions are wire types, not {tp!r}")
        return OptionShape(shape_of(args[0]))
    if origin is list:
        return VecShape(shape_of(typing.get_args(tp)[0]))
    if origin is tuple:
        return TupleShape(tuple(shape_of(a) for a in typing.get_args(tp)))
    if tp in _PLAIN:
        return PrimShape(_PLAIN[tp])
    raise TypeError(f"not a wire type: {tp!r}")


def _class_shape(cls: type) -> StructShape | EnumShape:
    cached = _shapes.get(cls)
    if cached is not None:
        return cached
    with _building_lock:
        outermost = not _building
        shape = _shapes.get(cls) or _building.get(cls) or _built_shape(cls)
        if outermost:
            _shapes.update(_building)
            _building.clear()
        return shape


def _built_shape(cls: type) -> StructShape | EnumShape:
    if issubclass(cls, Enum):
        enum_shape = EnumShape(cls)
        _building[cls] = enum_shape  # registered first: enums may nest themselves
        enum_shape.variants = tuple(_class_shape(v) for v in cls.variants)  # type: ignore[misc]
        return enum_shape
    struct_shape = StructShape(cls)
    _building[cls] = struct_shape
    module = sys.modules[cls.__module__]
    hints = typing.get_type_hints(cls, globalns=vars(module), include_extras=True)
    struct_shape.fields = tuple(
        FieldShape(f.name, f.name.rstrip("_"), shape_of(hints[f.name]))
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
    )
    return struct_shape

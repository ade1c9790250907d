"""The protocol reference (docs/protocol.md), written from the schema itself.

    python -m superfluid.protocol.doc > docs/protocol.md

Every enum lists its variants with their postcard index, fields and meaning; every struct
its fields. A test checks that the committed page is what this prints, so the page can
not drift from the schema the codecs use.
"""

from __future__ import annotations

import inspect
from typing import Any

from . import schema
from .types import (
    EnumShape,
    FixedShape,
    OptionShape,
    PrimShape,
    StructShape,
    TupleShape,
    VecShape,
    shape_of,
)

ENUMS = [schema.Request, schema.Response, schema.EventBody, schema.RebaseEdit, schema.PurgeMode, schema.Tier]
STRUCTS = [schema.GenParams, schema.EventMsg, schema.SessionSummary, schema.LedgerEntry, schema.Inspection]


def type_name(shape: Any) -> str:
    """A shape in the Rust-like notation the wire-format fact sheet uses."""
    kind = type(shape)
    if kind is PrimShape:
        return {"string": "String", "bytes": "Vec<u8>"}.get(shape.prim.name, shape.prim.name)
    if kind is FixedShape:
        return f"[u8; {shape.size}]"
    if kind is VecShape:
        return f"Vec<{type_name(shape.item)}>"
    if kind is OptionShape:
        written = f"Option<{type_name(shape.inner)}>"
        return f"{written}, may be left off the end" if shape.trailing else written
    if kind is TupleShape:
        return "(" + ", ".join(type_name(item) for item in shape.items) + ")"
    return shape.cls.__name__


def _fields(shape: StructShape) -> str:
    return ", ".join(f"{f.wire} `{type_name(f.shape)}`" for f in shape.fields) or "—"


def _doc(cls: type) -> str:
    return " ".join((inspect.getdoc(cls) or "").split())


def render() -> str:
    out = [
        "# Session protocol reference",
        "",
        "Written by `python -m superfluid.protocol.doc` from `src/superfluid/protocol/schema.py`, the one",
        "declaration both codecs use. The index is the postcard discriminant; fields are in wire order.",
        'In JSON an enum is `{"Variant": {fields}}`, or the bare string `"Variant"` when it has no fields.',
        "",
        "Every session runs on the daemon's default model: the first one `superfluid serve` names (its",
        "`MODEL` argument or first `--model`). The other models serve the HTTP routes, which pick one by",
        "the request's `model` field.",
        "",
    ]
    for enum in ENUMS:
        shape = shape_of(enum)
        assert isinstance(shape, EnumShape)
        out += [
            f"## {enum.__name__}",
            "",
            _doc(enum),
            "",
            "| index | variant | fields | meaning |",
            "|---|---|---|---|",
        ]
        for index, variant in enumerate(shape.variants):
            out.append(f"| {index} | `{variant.cls.__name__}` | {_fields(variant)} | {_doc(variant.cls)} |")
        out.append("")
    for struct in STRUCTS:
        shape = shape_of(struct)
        assert isinstance(shape, StructShape)
        out += [f"## {struct.__name__}", "", _doc(struct), "", "| field | type |", "|---|---|"]
        out += [f"| {f.wire} | `{type_name(f.shape)}` |" for f in shape.fields]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")

"""The protocol codecs against the byte vectors of spec/wire-format.md §5, and round trips."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superfluid.protocol import jsoncodec, postcard
from superfluid.protocol.doc import render
from superfluid.protocol.schema import (
    EventBody,
    EventMsg,
    GenParams,
    Inspection,
    PurgeMode,
    RebaseEdit,
    Request,
    Response,
    SessionSummary,
    Tier,
)
from superfluid.protocol.types import (
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
)
from superfluid.protocol.wal import encode_record

B = EventBody
ZERO = GenParams(0.0, 0.0, 0.0, 0, 0)

VECTORS: list[tuple[Any, str]] = [
    (Request.List(), "07"),
    (Request.AppendMessage(1, 1, "hi"), "02 01 01 02 68 69"),
    (Request.AppendToolResult(1, 4, "x"), "05 01 04 01 78"),
    (Request.Pin(1, 5), "21 01 05"),
    (Request.AppendSystem(1, None, ["{}"]), "22 01 00 01 02 7b 7d"),
    (Response.Err("no"), "0d 02 6e 6f"),
    (Response.Throttled(9), "1a 09"),
    (Response.Elsewhere(7, "h:1"), "1b 07 03 68 3a 31"),
    (Request.Create(None, GenParams(0.7, 0.95, 0.0, 0, 1)), "00 00 33 33 33 3f 33 33 73 3f 00 00 00 00 00 01"),
    (Request.Generate(300, 256), "03 ac 02 80 02"),
    (Request.Purge(1, 0, PurgeMode.Reroot()), "10 01 00 01"),
    (Request.Rebase(1, [RebaseEdit.Replace(2, 4, 1, "new")], None), "0f 01 01 01 02 04 01 03 6e 65 77 00"),
    (Request.SetQos(1, 0, False), "11 01 00 00"),
    (
        Response.Committed(EventMsg(1, 2, 1700000000000, B.Message(1, "hi", [256, 257]))),
        "03 01 02 80 d0 95 ff bc 31 02 01 02 68 69 02 80 02 81 02",
    ),
    (EventMsg(5, 3, 0, B.EpochBump()), "05 03 00 07"),
]


@pytest.mark.parametrize(
    ("value", "hex_bytes"), VECTORS, ids=lambda v: type(v).__qualname__ if not isinstance(v, str) else v
)
def test_postcard_vectors(value: Any, hex_bytes: str) -> None:
    expected = bytes.fromhex(hex_bytes)
    assert postcard.encode(value) == expected
    assert postcard.decode(expected, type(value).enum if hasattr(type(value), "enum") else type(value)) == value


def test_decoding_the_spec_generate_vector() -> None:
    assert postcard.decode(bytes.fromhex("030108"), Request) == Request.Generate(1, 8)


def test_trailing_bytes_are_ignored() -> None:
    assert postcard.decode(bytes.fromhex("07ffff"), Request) == Request.List()


def test_wal_frame_vector() -> None:
    frame = encode_record(1, EventMsg(0, 1, 1700000000000, B.Created(None, ZERO)))
    assert frame == bytes.fromhex(
        "19 00 00 00  46 44 4a fd 8f 3d ba 0c  01 00 01 80 d0 95 ff bc 31"
        " 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00"
    )


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ("", "end of buffer"),
        ("23", "variant index 35"),
        ("0d 05 61", "end of buffer"),
        ("09 01 01 02", "bool"),
        ("0d 02 ff fe", "UTF-8"),
        ("00 02", "option tag"),
        ("04 ff ff ff ff ff ff ff ff ff ff 01 00", "out of range"),
    ],
)
def test_postcard_refuses_malformed_bytes(data: str, why: str) -> None:
    tp = Response if data.startswith("0d") else Request
    with pytest.raises(postcard.DecodeError, match=why):
        postcard.decode(bytes.fromhex(data), tp)


def test_inspection_store_id_is_a_trailing_optional() -> None:
    summary = SessionSummary(1, None, 0, None, False, 0, 0, 1, 0, 0)
    full = Inspection(summary, ZERO, 1, 0, 2, False, 0, None, [], Tier.Cold(), [], [], 2, bytes(range(16)))
    encoded = postcard.encode(full)
    assert encoded.endswith(b"\x01" + bytes(range(16)))
    # an older peer's frame that ends before store_id decodes as None
    older = encoded[:-17]
    decoded = postcard.decode(older, Inspection)
    assert decoded.store_id is None and decoded.summary == summary
    as_json = jsoncodec.to_json(full)
    assert as_json["store_id"] == list(range(16))
    del as_json["store_id"]
    assert jsoncodec.from_json(as_json, Inspection).store_id is None


def test_json_forms() -> None:
    create = Request.Create(None, GenParams(0.7, 0.95, 0.0, 0, 1))
    assert jsoncodec.dumps(create) == (
        '{"Create":{"parent":null,"params":{"temperature":0.7,"top_p":0.95,"min_p":0.0,"top_k":0,"seed":1}}}'
    )
    assert jsoncodec.dumps(Request.Tree()) == '"Tree"'
    assert jsoncodec.loads('{"Tree":null}', Request) == Request.Tree()
    assert jsoncodec.loads('"List"', Request) == Request.List()
    assert jsoncodec.dumps(Request.SetQos(1, 3, True)) == '{"SetQos":{"session":1,"class":3,"batch_invariant":true}}'
    assert jsoncodec.dumps(RebaseEdit.Drop(2, 3)) == '{"Drop":{"from":2,"to":3}}'
    assert (
        jsoncodec.dumps(EventMsg(5, 3, 0, B.EpochBump()))
        == '{"event_id":5,"epoch":3,"ts_unix_ms":0,"body":"EpochBump"}'
    )
    assert jsoncodec.to_json(Request.PutMedia(b"\x00\xff", "image/png")) == {
        "PutMedia": {"bytes": [0, 255], "mime": "image/png"}
    }
    assert jsoncodec.dumps(Response.Tree([(1, None, 0), (2, 1, 3)])) == '{"Tree":{"nodes":[[1,null,0],[2,1,3]]}}'
    # unknown fields are ignored; a missing optional field is null
    assert jsoncodec.loads('{"Fork":{"session":1,"at_event":2,"extra":true}}', Request) == Request.Fork(1, 2, None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"Create":{"parent":null}}', "missing field `params` at Create"),
        ('{"Nope":{}}', "unknown variant `Nope`"),
        ('{"Generate":{"session":"1","max_tokens":3}}', 'invalid type: string "1", expected u64 at Generate.session'),
        ('{"Generate":{"session":-1,"max_tokens":3}}', "invalid value: integer `-1`, expected u64"),
        ('{"Generate":{"session":1.5,"max_tokens":3}}', "invalid type: floating point `1.5`, expected u64"),
        ('{"SetQos":{"session":1,"class":300,"batch_invariant":false}}', "expected u8"),
        ('"Generate"', "expected struct variant Generate"),
        ("[1,2]", "expected enum Request"),
        ("{", "Expecting property name"),
    ],
)
def test_json_errors_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(jsoncodec.JsonShapeError, match=message.replace("(", r"\(").replace("[", r"\[")):
        jsoncodec.loads(text, Request)


def test_f32_fields_keep_their_short_form() -> None:
    params = postcard.decode(postcard.encode(GenParams(0.7, 0.95, 0.05, 20, 3)), GenParams)
    assert params == GenParams(0.7, 0.95, 0.05, 20, 3)
    assert json.loads(jsoncodec.dumps(params))["temperature"] == 0.7


# ---- round trips over every type of the schema ----

_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def strategy(shape: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    kind = type(shape)
    if kind is PrimShape:
        prim = shape.prim
        if prim is STR_T:
            return st.text(max_size=12)
        if prim is BOOL_T:
            return st.booleans()
        if prim is F32_T:
            return _f32.map(postcard.f32_value)
        if prim is BLOB_T:
            return st.binary(max_size=12)
        return st.integers(0, LIMITS[prim])
    if kind is FixedShape:
        return st.binary(min_size=shape.size, max_size=shape.size)
    if kind is VecShape:
        if depth >= 3:
            return st.just([])  # EventBody nests itself (Rerooted); stop the recursion
        return st.lists(strategy(shape.item, depth + 1), max_size=3)
    if kind is OptionShape:
        return st.none() | strategy(shape.inner, depth + 1)
    if kind is TupleShape:
        return st.tuples(*(strategy(s, depth + 1) for s in shape.items))
    if kind is StructShape:
        return st.builds(shape.cls, *(strategy(f.shape, depth + 1) for f in shape.fields))
    if kind is EnumShape:
        return st.one_of(*(strategy(v, depth) for v in shape.variants))
    raise TypeError(shape)


ROOTS = [Request, Response, EventBody, EventMsg, Inspection]
STRATEGIES = {root: strategy(shape_of(root)) for root in ROOTS}


@pytest.mark.parametrize("root", ROOTS)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_round_trips(root: Any, data: st.DataObject) -> None:
    value = data.draw(STRATEGIES[root])
    assert postcard.decode(postcard.encode(value, root), root) == value
    assert jsoncodec.loads(jsoncodec.dumps(value, root), root) == value


def test_every_variant_index_is_its_declaration_order() -> None:
    assert [v.__name__ for v in Request.variants][:4] == ["Create", "Append", "AppendMessage", "Generate"]
    assert len(Request.variants) == 35 and Request.variants[34].__name__ == "AppendSystem"
    assert len(Response.variants) == 28 and Response.variants[26].__name__ == "Throttled"
    assert Response.variants[27].__name__ == "Elsewhere"
    assert len(EventBody.variants) == 25 and EventBody.variants[24].__name__ == "Pinned"


def test_non_finite_f32_becomes_null_in_json() -> None:
    value = GenParams(float("inf"), 1.0, 0.0, 0, 0)
    assert json.loads(jsoncodec.dumps(value))["temperature"] is None
    assert struct.unpack("<f", postcard.encode(value)[:4])[0] == float("inf")


@settings(max_examples=2000, deadline=None)
@given(data=st.binary(max_size=64))
def test_any_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    for root in (Request, Response):
        with contextlib.suppress(postcard.DecodeError):  # anything else fails the test
            postcard.decode(data, root)


def test_deep_nesting_is_a_clean_refusal() -> None:
    deep = '{"Rebase":{"session":1,"edits":' + "[" * 100_000 + "]" * 100_000 + ',"params":null}}'
    with pytest.raises(jsoncodec.JsonShapeError, match="nested too deeply"):
        jsoncodec.loads(deep, Request)
    # Rerooted nests EventBody in itself: a crafted frame nests it past the stack
    nested = bytes.fromhex("0f 00 01 00") * 20_000
    with pytest.raises(postcard.DecodeError):
        postcard.decode(nested, EventBody)


def test_the_protocol_reference_is_written_from_the_schema() -> None:
    page = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
    assert page.read_text() == render(), "run: python -m superfluid.protocol.doc > docs/protocol.md"
    assert "| 34 | `AppendSystem` | session `u64`, text `Option<String>`, tools `Vec<String>` |" in page.read_text()


def test_threads_decoding_their_first_messages_at_once_each_get_a_whole_shape() -> None:
    """A shape is published only once it is whole: a thread never decodes with an enum whose variants are
    still being filled in (it read `unknown Response variant index 0` before)."""
    import threading

    from superfluid.protocol import types

    data = postcard.encode(Response.Created(7), Response)
    for _ in range(5):
        types._shapes.clear()
        failures: list[BaseException] = []

        def decode(failures: list[BaseException] = failures) -> None:
            try:
                assert postcard.decode(data, Response) == Response.Created(7)
            except BaseException as e:
                failures.append(e)

        threads = [threading.Thread(target=decode) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures[0]

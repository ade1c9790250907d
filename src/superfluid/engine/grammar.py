"""Grammar-constrained decoding with llama.cpp's grammar machinery.

A `Grammar` wraps llama.cpp's grammar sampler: `mask` sets the logits of tokens the
grammar cannot accept next to -inf (our own sampler then draws from what is left), and
`accept` advances it by the token drawn. Once the grammar is complete only
end-of-generation tokens remain, so a constrained generation ends with finish 3.
JSON schemas are compiled to GBNF with llama-cpp-python's converter.
"""

from __future__ import annotations

import ctypes
import json
import re
from typing import Any

import llama_cpp as L
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from ..model.dialects.shape import GEMMA_QUOTE, CallShape
from .llama import LlamaModel

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class GrammarError(ValueError):
    """A grammar or schema that cannot constrain a generation."""


class Grammar:
    """One generation's grammar state."""

    def __init__(self, model: LlamaModel, gbnf: str) -> None:
        self.gbnf = gbnf
        self._sampler = L.llama_sampler_init_grammar(model._vocab, gbnf.encode("utf-8"), b"root")
        if not self._sampler:
            raise GrammarError("the grammar does not parse as GBNF with a `root` rule")
        self._data = np.zeros(model.n_vocab, dtype=_TOKEN_DATA)
        self._data["id"] = np.arange(model.n_vocab, dtype=np.int32)
        self._array = L.llama_token_data_array(
            data=self._data.ctypes.data_as(L.llama_token_data_p), size=model.n_vocab, selected=-1, sorted=False
        )

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with every token the grammar forbids at -inf."""
        self._data["logit"] = logits
        self._array.size = len(self._data)
        self._array.selected = -1
        self._array.sorted = False
        L.llama_sampler_apply(self._sampler, ctypes.byref(self._array))
        return self._data["logit"].copy()

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts `token` next (cheaper than a whole mask)."""
        one = np.array([(token, 0.0, 0.0)], dtype=_TOKEN_DATA)
        single = L.llama_token_data_array(
            data=one.ctypes.data_as(L.llama_token_data_p), size=1, selected=-1, sorted=False
        )
        L.llama_sampler_apply(self._sampler, ctypes.byref(single))
        return bool(np.isfinite(one["logit"][0]))

    def accept(self, token: int) -> None:
        L.llama_sampler_accept(self._sampler, token)

    def close(self) -> None:
        if self._sampler:
            L.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        self.close()


def schema_grammar(schema: Any) -> str:
    """GBNF for JSON values that match `schema`."""
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter raises bare exceptions on schemas it cannot handle
        raise GrammarError(f"the JSON schema cannot be compiled to a grammar: {e}") from None


_RULE_NAME = re.compile(r"^([A-Za-z0-9-]+)\s*::=", re.MULTILINE)
# GBNF's pieces: string literals and character classes (left alone), names, anything else
_GBNF_PIECE = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z0-9-]+|.', re.DOTALL)


def _prefixed(gbnf: str, prefix: str) -> str:
    """`gbnf` with every rule renamed `prefix` + name, so several grammars can share one root."""
    names = set(_RULE_NAME.findall(gbnf))
    return "".join(prefix + piece if piece in names else piece for piece in _GBNF_PIECE.findall(gbnf))


def _value_rules(schema: Any, prefix: str, what: str) -> str:
    """Rules for JSON values of `schema`, the top one named `prefix`root."""
    try:
        return _prefixed(json_schema_to_gbnf(json.dumps(schema)), prefix)
    except Exception as e:  # the converter raises bare exceptions on schemas it cannot handle
        raise GrammarError(f"the parameters of {what} cannot be compiled to a grammar: {e}") from None


def _literal(text: str) -> str:
    return json.dumps(text)  # GBNF string literals are written like JSON strings


def tool_call_grammar(
    tools: list[tuple[str, dict[str, Any]]], shape: CallShape, *, parallel: bool = False, prefix: str = ""
) -> str:
    """GBNF forcing calls of `tools` ((name, parameters) pairs) in a dialect's own markup: one call, or
    with `parallel` one or more; `prefix` is text the reply must begin with (the close of a reasoning
    block its generation prompt opened)."""
    rules: list[str] = []
    alternatives = []
    head, index_mark, tail = shape.name_close.partition("{index}")
    name_close = _literal(head) + (" [0-9]{1,2} " + _literal(tail) if index_mark else "")
    for index, (name, parameters) in enumerate(tools):
        schema = parameters or {"type": "object"}
        arguments = _arguments(schema, shape, f"t{index}-", name, rules)
        rules.append(
            f"call-{index} ::= {_literal(shape.call_open + name)} {name_close} {arguments} {_literal(shape.call_close)}"
        )
        alternatives.append(f"call-{index}")
    repeat = f" ({_literal(shape.separator)} call)*" if parallel else ""
    root = f"root ::= {_literal(prefix + shape.section_open)} call{repeat} {_literal(shape.section_close)}"
    return "\n".join([root, f"call ::= {' | '.join(alternatives)}", *rules])


def _arguments(schema: dict[str, Any], shape: CallShape, prefix: str, name: str, rules: list[str]) -> str:
    """The rule text of one call's arguments in the shape's style (rules it needs go to `rules`)."""
    if shape.arguments == "json":
        rules.append(_value_rules(schema, prefix, name))
        return f"{prefix}root"
    properties = schema.get("properties") or {}
    required = [key for key in schema.get("required", []) if key in properties]
    items = []
    for position, key in enumerate(properties):
        value = _param_value(properties[key], shape, f"{prefix}p{position}-", name, rules)
        if shape.arguments == "gemma":
            if key in required:
                items.append(f"{_literal(key + ':')} {value}")
            continue
        item = f"{_literal(shape.param_open + key + shape.param_mid)} {value} {_literal(shape.param_close)}"
        items.append(item if key in required else f"({item})?")
    if shape.arguments == "gemma":
        return '"{" ' + ' "," '.join(items) + ' "}"' if items else '"{}"'
    return " ".join(items) if items else '""'


def _param_value(schema: dict[str, Any], shape: CallShape, prefix: str, name: str, rules: list[str]) -> str:
    """One parameter's value: a string as raw text (quoted in Gemma's syntax), any other type as JSON."""
    enum = schema.get("enum")
    if schema.get("type", "string") == "string" or (enum and all(isinstance(v, str) for v in enum)):
        raw = "(" + " | ".join(_literal(v) for v in enum) + ")" if enum else "[^<]*"
        return f"{_literal(GEMMA_QUOTE)} {raw} {_literal(GEMMA_QUOTE)}" if shape.arguments == "gemma" else raw
    rules.append(_value_rules(schema, prefix, name))
    return f"{prefix}root"

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


def tool_call_grammar(tools: list[tuple[str, dict[str, Any]]], open_marker: str, close_marker: str) -> str:
    """GBNF forcing one call of one of `tools` ((name, parameters) pairs): the markers around
    `{"name": ..., "arguments": {...}}`."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
            "required": ["name", "arguments"],
        }
        for name, parameters in tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        body = json_schema_to_gbnf(json.dumps(schema), prop_order=["name", "arguments"])
    except Exception as e:
        names = ", ".join(name for name, _ in tools)
        raise GrammarError(f"the parameters of {names} cannot be compiled to a grammar: {e}") from None
    body = re.sub(r"^root ::=", "call ::=", body, flags=re.MULTILINE)
    # GBNF string literals are written like JSON strings
    return f"root ::= {json.dumps(open_marker + chr(10))} call {json.dumps(chr(10) + close_marker)}\n{body}"

"""The grammar a generation is held to, from whichever constraint its request gave: one place for every API.

A request constrains a reply by at most one of: GBNF text, a JSON schema (or "any JSON object"),
or tools the reply must call (Hermes `<tool_call>`, Harmony, Mistral... in the served model's
own dialect, after the reasoning its template leaves open). The socket's browser transport, the
OpenAI, Anthropic, Ollama and Responses routes all come here; the engine parses the result
once more against the model's vocabulary when the generation starts.
"""

from __future__ import annotations

from typing import Any

from ..engine.grammar import GrammarError, schema_grammar, tool_call_grammar
from ..model.template import ChatTemplate


class ConstraintError(ValueError):
    """A constraint that cannot be turned into a grammar; the text says why."""


def constraint_grammar(
    template: ChatTemplate,
    *,
    gbnf: Any = None,
    json_schema: Any = None,
    tools: list[tuple[str, Any]] | None = None,
    parallel: bool = False,
) -> str | None:
    """The GBNF of a constraint: `gbnf` as given, `json_schema` (True: any JSON object), or a call of one of
    `tools` ((name, parameters schema) pairs; `parallel`: one or more calls). None when nothing constrains."""
    given = [name for name, value in (("grammar", gbnf), ("json_schema", json_schema), ("tool", tools)) if value]
    if len(given) > 1:
        raise ConstraintError(f"give one constraint, not {' and '.join(given)}")
    try:
        if gbnf:
            if not isinstance(gbnf, str):
                raise ConstraintError("grammar must be GBNF text with a `root` rule")
            return gbnf
        if json_schema is not None and json_schema is not False:
            return schema_grammar({"type": "object"} if json_schema is True else json_schema)
        if tools:
            return tool_call_grammar(
                tools, template.dialect.shape, parallel=parallel, prefix=template.reasoning_left_open()
            )
    except GrammarError as e:
        raise ConstraintError(f"constraint unsatisfiable: {e}") from None
    return None

"""The model's chat template, turned into token spans one turn at a time.

The GGUF's Jinja template is rendered in a sandbox with each message's content replaced
by a sentinel. The template's own text around the sentinels is tokenized with special
tokens parsed; the content is tokenized as plain text, so marker-shaped text a user
sends (`<|im_end|>`) stays ordinary tokens and cannot forge a turn.

At load the template is probed once per role to learn each turn's frame: what it puts
before and after a message's content, as the first message and as a later one, the
assistant opener (`add_generation_prompt`), and the separator that closes a finished
assistant turn. A session's input is then built append-only from those frames.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..protocol.schema import CHANNEL_TOOL_CALL, ROLE_NAMES, ROLE_SYSTEM, ROLE_USER
from .channels import TOOL_CALL, Markers
from .tools import fallback_system_text

Tokenize = Callable[[str, bool], list[int]]  # (text, parse_special) -> token ids

_SENTINEL = "\u2063SFCONTENT{}\u2063"
_SENTINEL_RE = re.compile("\u2063SFCONTENT(\\d+)\u2063")

# What the renderer itself passes: a request's template variables may not set these.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})
# reasoning efforts that mean "do not think", for a template that only knows enable_thinking
NO_THINKING = frozenset({"none", "minimal"})

# ChatML, for a GGUF that carries no template of its own.
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TemplateProblem(ValueError):
    """The chat template cannot render what was asked of it."""


@dataclass(frozen=True)
class Frame:
    """Template text around one message's content: `before` + content + `after`."""

    before: str
    after: str


def call_wire(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style tool call as the `<tool_call>` wire writes it: name and arguments."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # keep text that is not JSON as it is
            arguments = json.loads(arguments)
    return {"name": function.get("name", ""), "arguments": arguments}


def _object_end(text: str, start: int) -> int:
    """Index just past the JSON object starting at `start`, or -1."""
    if start < 0:
        return -1
    try:
        _, end = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError:
        return -1
    return start + end


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """A model's chat template, probed at load into per-role frames."""

    def __init__(
        self,
        source: str,
        tokenize: Tokenize,
        *,
        bos_text: str = "",
        eos_text: str = "",
        bos_token: int | None = None,
    ) -> None:
        # the environment Hugging Face renders chat templates in
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent, ensure_ascii=False)
        self.source = source
        try:
            self._template = env.from_string(source)
            # the variables the template reads (enable_thinking, reasoning_effort, ...)
            self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
        except TemplateError as e:
            raise TemplateProblem(f"the chat template does not compile: {e}") from None
        self._tokenize = tokenize
        self._bos_text = bos_text
        self._eos_text = eos_text
        self._bos_token = bos_token  # a model that wants BOS first gets it, if the template does not write it
        self.supports_tools = "tools" in source
        probe = {"role": "system", "content": "sf-probe"}
        self._first: dict[int, Frame] = {}
        self._later: dict[int, Frame] = {}
        for role, name in ROLE_NAMES.items():
            try:
                self._first[role] = self._frame([], name)
                self._later[role] = self._frame([probe], name)
            except (TemplateError, TemplateProblem):
                continue  # the template refuses this role; messages of it fall back (see frame_for)
        if ROLE_USER not in self._later:
            raise TemplateProblem("the chat template cannot render a user message after a system message")
        base = [probe, {"role": "user", "content": "sf-probe"}]
        closed = self.render(base, add_generation_prompt=False)
        opened = self.render(base, add_generation_prompt=True)
        if not opened.startswith(closed):
            raise TemplateProblem("the chat template's generation prompt does not extend the conversation")
        self.opener_text = opened[len(closed) :]
        self.separator_text = self._later[2].after if 2 in self._later else self._later[ROLE_USER].after
        self.call_markers = (self._learn_call_markers() if self.supports_tools else None) or TOOL_CALL

    def _learn_call_markers(self) -> Markers | None:
        """How the template writes a tool call, from one synthetic call: the text around its JSON."""
        probe_tool = {"type": "function", "function": {"name": "sf_probe_fn", "parameters": {"type": "object"}}}
        call = {
            "type": "function",
            "function": {"name": "sf_probe_fn", "arguments": {"sf_probe_arg": "sf_probe_value"}},
        }
        history = [{"role": "system", "content": "sf-probe"}, {"role": "user", "content": "sf-probe"}]
        try:
            before = self.render(history, add_generation_prompt=False, tools=[probe_tool])
            text = self.render(
                [*history, {"role": "assistant", "content": "", "tool_calls": [call]}],
                add_generation_prompt=False,
                tools=[probe_tool],
            )
        except TemplateProblem:
            return None
        if not text.startswith(before) or "sf_probe_fn" not in text:
            return None
        turn = text[len(before) :]
        frame = self._later.get(2)
        if frame is not None and turn.startswith(frame.before):
            turn = turn[len(frame.before) :]
        if frame is not None and turn.endswith(frame.after):
            turn = turn[: len(turn) - len(frame.after)]
        start = turn.rfind("{", 0, turn.find("sf_probe_fn"))
        end = _object_end(turn, start)
        if start < 0 or end < 0:
            return None
        open_text, close_text = turn[:start].strip(), turn[end:].strip()
        if not open_text or not close_text:
            return None
        return Markers(CHANNEL_TOOL_CALL, open_text, close_text)

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool, **extra: Any) -> str:
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_text,
                eos_token=self._eos_text,
                **extra,
            )
        except TemplateError as e:
            raise TemplateProblem(f"the chat template failed to render: {e}") from None

    def _frame(self, history: list[dict[str, Any]], role: str, **extra: Any) -> Frame:
        mark = _SENTINEL.format(0)
        before_text = self.render(history, add_generation_prompt=False, **extra) if history else ""
        text = self.render([*history, {"role": role, "content": mark}], add_generation_prompt=False, **extra)
        if not text.startswith(before_text) or text.count(mark) != 1:
            raise TemplateProblem(f"the chat template does not render a {role} turn append-only")
        before, after = text[len(before_text) :].split(mark)
        return Frame(before, after)

    def frame_for(self, role: int, first: bool) -> Frame:
        """The frame of a message of `role`, as the session's first input or a later one."""
        frames = self._first if first else self._later
        if role in frames:
            return frames[role]
        if role == ROLE_SYSTEM:
            # templates without a system role: its text becomes a user turn
            return frames[ROLE_USER]
        raise TemplateProblem(f"the chat template has no {ROLE_NAMES.get(role, role)} role")

    def message(self, role: int, text: str, *, first: bool) -> list[int]:
        """Tokens of one message: template text with specials, content as plain text."""
        return self.framed(self.frame_for(role, first), text, first=first)

    def framed(self, frame: Frame, text: str, *, first: bool = False) -> list[int]:
        """Template text with specials, content as plain text; the model's BOS first if `first` needs it."""
        tokens = self._tokenize(frame.before, True) + self._tokenize(text, False) + self._tokenize(frame.after, True)
        if first and self._bos_token is not None and tokens[:1] != [self._bos_token]:
            tokens.insert(0, self._bos_token)
        return tokens

    def system_with_tools(self, tools: list[dict[str, Any]]) -> Frame:
        """The frame of a first system turn that declares `tools` through the template."""
        return self._frame([], "system", tools=tools)

    def request_variables(self, given: dict[str, Any]) -> dict[str, Any]:
        """A request's template variables (`chat_template_kwargs`, `enable_thinking`, `reasoning_effort`)
        as this template takes them; TemplateProblem for one the renderer sets itself.

        A `reasoning_effort` of none or minimal turns thinking off in a template that knows
        `enable_thinking` but no effort; any other effort it does not know is left to be ignored.
        """
        reserved = sorted(RESERVED_VARIABLES & given.keys())
        if reserved:
            raise TemplateProblem(f"chat_template_kwargs may not set {', '.join(reserved)}: the request does")
        out = dict(given)
        effort = out.get("reasoning_effort")
        if "reasoning_effort" not in self.variables and effort in NO_THINKING and "enable_thinking" in self.variables:
            out.setdefault("enable_thinking", False)
        return out

    def conversation(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> tuple[list[int], list[int]]:
        """A whole chat rendered at once, as the HTTP APIs send it: (its tokens, the assistant opener).

        Message contents are tokenized as plain text and the template's own text with special
        tokens. A template that knows no tools gets them in the system turn and sees earlier
        calls written in the `<tool_call>` wire. `variables` (see `request_variables`) go to
        the template as they are.
        """
        tokens, opener, _ = self.marked_conversation(messages, tools, variables)
        return tokens, opener

    def marked_conversation(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
        marks: Sequence[tuple[int, int]] = (),
    ) -> tuple[list[int], list[int], list[int]]:
        """`conversation`, and where each mark falls in its tokens.

        A mark is (message index, characters of that message's content): the prompt-cache
        breakpoints of a request. Its position is the number of prompt tokens up to it (a
        content's tokens are cut where its cut text's tokens stop agreeing with them).
        """
        messages = [dict(m) for m in messages]
        shift = 0  # messages put before the request's own
        extra: dict[str, Any] = self.request_variables(variables or {})
        if tools and self.supports_tools:
            extra["tools"] = tools
        elif tools:
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = fallback_system_text(str(messages[0].get("content") or ""), tools)
            else:
                messages.insert(0, {"role": "system", "content": fallback_system_text("", tools)})
                shift = 1
        contents: list[str] = []
        piece_of: dict[int, int] = {}  # message index -> its content's piece
        for index, message in enumerate(messages):
            if message.get("tool_calls") and not self.supports_tools:
                markers = self.call_markers
                calls = "".join(
                    f"{markers.open}\n{json.dumps(call_wire(call), ensure_ascii=False)}\n{markers.close}"
                    for call in message.pop("tool_calls")
                )
                message["content"] = f"{message.get('content') or ''}{calls}"
            content = message.get("content")
            if isinstance(content, str) and content:
                message["content"] = _SENTINEL.format(len(contents))
                piece_of[index] = len(contents)
                contents.append(content)
            elif content is None:
                message["content"] = ""
        closed = self.render(messages, add_generation_prompt=False, **extra)
        opened = self.render(messages, add_generation_prompt=True, **extra)
        if not opened.startswith(closed):
            raise TemplateProblem("the chat template's generation prompt does not extend the conversation")
        tokens: list[int] = []
        placed: dict[int, tuple[int, list[int]]] = {}  # piece -> (its first token, its tokens)
        for index, part in enumerate(_SENTINEL_RE.split(closed)):
            if index % 2:
                placed[int(part)] = (len(tokens), self._tokenize(contents[int(part)], False))
                tokens += placed[int(part)][1]
            else:
                tokens += self._tokenize(part, True)
        bos = int(self._bos_token is not None and tokens[:1] != [self._bos_token])
        if bos:
            tokens.insert(0, self._bos_token)
        positions = []
        for message, chars in marks:
            piece = piece_of.get(message + shift)
            if piece is None or piece not in placed:
                continue
            start, whole = placed[piece]
            if chars >= len(contents[piece]):
                positions.append(bos + start + len(whole))
                continue
            cut = self._tokenize(contents[piece][:chars], False)
            agreeing = next((i for i, (a, b) in enumerate(zip(whole, cut, strict=False)) if a != b), len(cut))
            positions.append(bos + start + min(agreeing, len(whole)))
        return tokens, self._tokenize(opened[len(closed) :], True), positions

    def opener(self) -> list[int]:
        """Tokens that open an assistant turn after an input turn."""
        return self._tokenize(self.opener_text, True)

    def separator(self) -> list[int]:
        """Tokens that close a finished assistant turn (its end-of-turn is never in a span)."""
        return self._tokenize(self.separator_text, True)

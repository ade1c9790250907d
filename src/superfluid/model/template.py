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
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, meta, nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import SandboxedEnvironment

from ..protocol.schema import ROLE_NAMES, ROLE_SYSTEM, ROLE_TOOL, ROLE_USER
from .dialects import HERMES, Dialect, hermes_with, recognise
from .tools import fallback_system_text

Tokenize = Callable[[str, bool], list[int]]  # (text, parse_special) -> token ids

log = logging.getLogger("superfluid.template")

_SENTINEL = "\u2063SFCONTENT{}\u2063"
_SENTINEL_RE = re.compile("\u2063SFCONTENT(\\d+)\u2063")

# What the renderer itself passes: a request's template variables may not set these.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})
# reasoning efforts that mean "do not think", for a template that only knows enable_thinking
NO_THINKING = frozenset({"none", "minimal"})
# reasoning efforts from least to most; a level a template does not know is snapped to its nearest
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

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


def call_wire(call: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """An OpenAI-style tool call as (name, arguments object), arguments sent as JSON text decoded."""
    function = call.get("function", call)
    arguments = _arguments_object(function.get("arguments", {}))
    return function.get("name", ""), arguments if isinstance(arguments, dict) else {}


def _arguments_object(arguments: Any) -> Any:
    """Arguments sent as JSON text, decoded (what chat templates iterate and `tojson`); other text as it is."""
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(arguments)
    return arguments


def text_content(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


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


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    if not isinstance(value, (dict, list, str, int, float, bool, type(None))):
        value = list(value) if hasattr(value, "__iter__") else None  # a generator or an undefined value
    return json.dumps(value, indent=indent, ensure_ascii=False)


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (Hugging Face marks the assistant's own text with it):
    rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


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
        dialect: Dialect | None = None,
    ) -> None:
        # the environment Hugging Face renders chat templates in; lists may be appended to (Kimi K2's do)
        env = SandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationTag]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
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
        self.supports_tools = "tools" in source  # it declares tools itself
        self.renders_calls = "tool_calls" in source  # it writes an assistant's earlier calls itself
        probe = {"role": "system", "content": "sf-probe"}
        asked = {"role": "user", "content": "sf-probe"}
        # what a later message follows: a system turn, or (for templates that want a user turn
        # first, or have no system role) a finished exchange
        histories = ([probe], [asked, {"role": "assistant", "content": "sf-probe"}], [asked])
        self._first: dict[int, Frame] = {}
        self._later: dict[int, Frame] = {}
        for role, name in ROLE_NAMES.items():
            with contextlib.suppress(TemplateError, TemplateProblem):
                self._first[role] = self._frame([], name)
            for history in histories:
                try:
                    self._later[role] = self._frame(history, name)
                    break
                except (TemplateError, TemplateProblem):
                    continue  # the template refuses this role; messages of it fall back (see frame_for)
        if ROLE_USER not in self._later:
            raise TemplateProblem("the chat template cannot render a user message after another message")
        try:
            base = [probe, asked]
            closed = self.render(base, add_generation_prompt=False)
        except TemplateProblem:
            base = [asked]  # no system role
            closed = self.render(base, add_generation_prompt=False)
        opened = self.render(base, add_generation_prompt=True)
        if not opened.startswith(closed):
            raise TemplateProblem("the chat template's generation prompt does not extend the conversation")
        self.opener_text = opened[len(closed) :]
        self.separator_text = self._later[2].after if 2 in self._later else self._later[ROLE_USER].after
        self.dialect = dialect or self._recognise()
        self.arguments_as_text = self.renders_calls and self._arguments_as_text()

    def _recognise(self) -> Dialect:
        """The dialect the template's text shows; else Hermes-style JSON calls between the tags the
        template writes them in; else Hermes (what the fallback prompt of a template without tools asks for)."""
        shown = recognise(self.source)
        if shown is not None or not self.supports_tools:
            return shown or HERMES
        return self._learn_call_tags() or HERMES

    def _learn_call_tags(self) -> Dialect | None:
        """Hermes-style calls between the template's own tags, from one synthetic call: the text around its JSON."""
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
        return hermes_with(open_text, close_text)

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool, **extra: Any) -> str:
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_text,
                eos_token=self._eos_text,
                **extra,
            )
        except (TemplateError, TypeError) as e:  # TypeError: the template adds text to an object, say
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
        if role in (ROLE_SYSTEM, ROLE_TOOL):
            # templates without a system role, or that write a tool's result inside the model's own
            # turn (Gemma 4): its text becomes a user turn
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
        """The frame of a first system turn that declares `tools` through the template (in the system turn
        where the template would put them in the first user turn, as Llama 3.1's does by default)."""
        extra: dict[str, Any] = {"tools": tools}
        if "tools_in_user_message" in self.variables:
            extra["tools_in_user_message"] = False
        return self._frame([], "system", **extra)

    def request_variables(self, given: dict[str, Any]) -> dict[str, Any]:
        """A request's template variables (`chat_template_kwargs`, `enable_thinking`, `reasoning_effort`)
        as this template takes them; TemplateProblem for one the renderer sets itself.

        A template that takes `reasoning_effort` gets a level it knows (an unknown one snaps to the
        nearest, with a log line); one that knows only `enable_thinking` (or DeepSeek's `thinking`)
        has it turned off by none or minimal.
        """
        reserved = sorted(RESERVED_VARIABLES & given.keys())
        if reserved:
            raise TemplateProblem(f"chat_template_kwargs may not set {', '.join(reserved)}: the request does")
        out = dict(given)
        effort = out.get("reasoning_effort")
        if effort is not None and "reasoning_effort" in self.variables:
            out["reasoning_effort"] = self._known_effort(str(effort))
        elif effort is not None:
            del out["reasoning_effort"]
            if effort in NO_THINKING:
                out.setdefault("enable_thinking", False)
        if "enable_thinking" in out and "enable_thinking" not in self.variables and "thinking" in self.variables:
            out.setdefault("thinking", out.pop("enable_thinking"))  # DeepSeek V3.1's switch
        return out

    def _known_effort(self, effort: str) -> str:
        """`effort` as this template knows it: a level it does not know becomes its nearest, with a note."""
        known = [level for level in EFFORTS if f'"{level}"' in self.source or f"'{level}'" in self.source]
        if len(known) < 2:
            known = ["low", "medium", "high"]  # what templates taking an effort know, gpt-oss's among them
        if effort in known:
            return effort
        rank = EFFORTS.index(effort) if effort in EFFORTS else EFFORTS.index("medium")  # a level of no scale
        nearest = min(known, key=lambda level: (abs(EFFORTS.index(level) - rank), EFFORTS.index(level)))
        log.info(
            "reasoning_effort %r is not a level this template knows (%s): using %r", effort, ", ".join(known), nearest
        )
        return nearest

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
                text = str(messages[0].get("content") or "")
                messages[0]["content"] = fallback_system_text(text, tools, self.dialect)
            else:
                messages.insert(0, {"role": "system", "content": fallback_system_text("", tools, self.dialect)})
                shift = 1
        if ROLE_SYSTEM not in self._first and len(messages) > 1 and messages[0].get("role") == "system":
            # a template with no system role (Gemma 2): the system text opens the first user turn
            system = messages.pop(0)
            first = dict(messages[0])
            first["content"] = f"{text_content(system)}\n\n{text_content(first)}"
            messages[0] = first
            shift -= 1
        contents: list[str] = []
        piece_of: dict[int, int] = {}  # message index -> its content's piece
        for index, message in enumerate(messages):
            if message.get("tool_calls") and not self.renders_calls:
                calls = self.dialect.write([call_wire(call) for call in message.pop("tool_calls")])
                message["content"] = f"{message.get('content') or ''}{calls}"
            else:
                messages[index] = message = self._as_template_takes(message)
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
        bos = 0  # tokens put before the rendered text
        if self._bos_token is not None and tokens[:1] != [self._bos_token]:
            tokens.insert(0, self._bos_token)
            bos = 1
        positions = []
        for marked, chars in marks:
            piece = piece_of.get(marked + shift)
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

    def _as_template_takes(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message as chat templates read it: call arguments as objects (as text for a template that
        wants text), call ids in the form the dialect's template accepts, reasoning as `thinking` too."""
        ids = self.dialect.call_ids
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                call = dict(call)
                if "id" in call:
                    call["id"] = ids(str(call["id"]))
                if isinstance(call.get("function"), dict):
                    function = dict(call["function"])
                    arguments = _arguments_object(function.get("arguments", {}))
                    if self.arguments_as_text and not isinstance(arguments, str):
                        arguments = json.dumps(arguments, ensure_ascii=False)
                    function["arguments"] = arguments
                    call["function"] = function
                calls.append(call)
            message["tool_calls"] = calls
        if message.get("tool_call_id"):
            message["tool_call_id"] = ids(str(message["tool_call_id"]))
        if message.get("reasoning_content") and "thinking" not in message:
            message["thinking"] = message["reasoning_content"]
        return message

    def _arguments_as_text(self) -> bool:
        """Whether the template wants call arguments as JSON text (most iterate them as an object)."""
        function: dict[str, Any] = {"name": "sf_probe_fn", "arguments": {"a": 1}}
        call = {"id": "sfprobe01", "type": "function", "function": function}
        history: list[dict[str, Any]] = [
            {"role": "user", "content": "sf-probe"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        try:
            self.render(history, add_generation_prompt=False)
            return False
        except (TemplateProblem, TypeError):
            pass
        function["arguments"] = '{"a": 1}'
        try:
            self.render(history, add_generation_prompt=False)
            return True
        except (TemplateProblem, TypeError):
            return False

    def reasoning_left_open(self) -> str:
        """The close of a reasoning block the generation prompt opens (GLM-4.7's `<think>`), or ""."""
        for marker in self.dialect.reasoning:
            if self.opener_text.rfind(marker.open) > self.opener_text.rfind(marker.close):
                return marker.close
        return ""

    def opener(self) -> list[int]:
        """Tokens that open an assistant turn after an input turn."""
        return self._tokenize(self.opener_text, True)

    def separator(self) -> list[int]:
        """Tokens that close a finished assistant turn (its end-of-turn is never in a span)."""
        return self._tokenize(self.separator_text, True)

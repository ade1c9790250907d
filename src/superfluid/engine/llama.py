"""llama.cpp through llama-cpp-python's low-level API: a model, and one context whose
KV memory is split into slots, one per sequence id (plus, when embeddings are asked for, a
small second context that pools them).

The engine knows token ids, positions and sequence ids, nothing about sessions. Each
sequence has a KV stream of its own (`kv_unified` off), and flash attention runs only where
its kernel sums each query in one order; with llama.cpp built as `build.py` checks, a
sequence's logits then depend only on its own tokens: batched, chunked and solo decodes
agree bit for bit, and so do a fork, an import from host memory and a re-prefill after a
restart.
A fork copies its source's stream (a memory copy inside llama.cpp, milliseconds)
instead of recomputing it. Every call into llama.cpp is a ctypes call, which releases
the GIL while it runs.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import os
import threading
from pathlib import Path

import llama_cpp as L
import numpy as np

from . import build  # imported for its effect too: llama.cpp's batch-dependent kernels off
from .devices import Device, KVShape, compute_bytes, devices, gpus, kv_refusal, layers_on_gpu, offload_supported
from .interface import ContextShape, DeviceReport, EngineError, KVFull, StepInterrupted
from .interrupt import CALLBACK, Interrupt
from .placement import Placement

log = logging.getLogger("superfluid.engine")

# Testing aid: a seed here adds a fixed offset to each token's logit, so greedy text comes
# out as different as it would on another CPU, while everything that holds on every machine
# (the same request twice, a continuation equal to the uncut run, a forced length) still holds.
SKEW_ENV = "SUPERFLUID_TEST_LOGIT_SKEW"

_init_lock = threading.Lock()
_initialised = False


_errors: collections.deque[str] = collections.deque(maxlen=8)  # llama.cpp's last error lines, for reasons


def _llama_log(level: int, text: bytes, _user: object) -> None:
    if level < 3:  # below GGML_LOG_LEVEL_WARN: llama.cpp's load chatter stays out of our log
        return
    message = text.decode("utf-8", "replace").rstrip()
    if message:
        if level == 4:  # GGML_LOG_LEVEL_ERROR
            _errors.append(message)
        log.debug("llama.cpp: %s", message)


_LOG_CALLBACK = L.llama_log_callback(_llama_log)


def _backend_init() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            L.llama_log_set(_LOG_CALLBACK, None)
            L.llama_backend_init()
            _initialised = True


class LlamaModel:
    """The weights and vocabulary of one GGUF file; `vocab_only` loads the vocabulary and
    metadata alone (what the daemon needs when a worker runs the weights). The weights go where
    `placement` says (by default, where the `SUPERFLUID_*` variables of `--gpu-layers` and its
    fellows say: `placement.py`)."""

    def __init__(
        self, path: Path, *, vocab_only: bool = False, placement: Placement | None = None, exact: bool | None = None
    ) -> None:
        _backend_init()
        self.path = path
        # exact (by default, unless a fast worker's environment says otherwise): a token's logits ignore its
        # batch, so extra buffer types only for the weights whose repacked kernels ignore it too, and a library
        # that cannot keep that is refused
        exact = build.exact_wanted() if exact is None else exact
        self.exact = exact
        if exact and not vocab_only and (problems := build.exactness_problems()):
            library = os.environ.get(build.LIBRARY_ENV) or "llama-cpp-python's own"
            raise EngineError(
                f"the llama.cpp library ({library}) cannot compute a token the same whatever its batch: "
                f"{'; '.join(problems)}. Serve --kernels fast to run on it"
            )
        params = L.llama_model_default_params()
        params.vocab_only = vocab_only
        # repacked weights where they ignore the batch (build.exact_repacking), never AMX (build.amx_compiled)
        params.use_extra_bufts = build.exact_repacking() if exact else not build.amx_compiled()
        self.repacking = bool(params.use_extra_bufts)  # whether llama.cpp may repack its weights
        self.gpu_layers = 0  # the n_gpu_layers it loaded with (-1: every layer)
        self.gpus: list[Device] = []  # the GPUs its layers are on
        params.n_gpu_layers = 0
        if not vocab_only:
            try:
                self._place(params, Placement.from_environment() if placement is None else placement)
            except ValueError as e:  # layers asked of a build with no GPU, or a placement that does not parse
                raise EngineError(str(e)) from None
        self._model = L.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise EngineError(f"llama.cpp could not load {path}: {_load_failure(path)}")
        self._vocab = L.llama_model_get_vocab(self._model)
        self.metadata = self._read_metadata()
        self.n_vocab = L.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(self._model)
        # the width of an embedding; a vocab-only load reads no hyperparameters, so the metadata says it
        arch = self.metadata.get("general.architecture", "")
        self.n_embd = L.llama_model_n_embd_out(self._model) or int(self.metadata.get(f"{arch}.embedding_length", 0))
        self.bos = L.llama_vocab_bos(self._vocab)
        self.eos = L.llama_vocab_eos(self._vocab)
        self.size = path.stat().st_size
        self.add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        self.name = self.metadata.get("general.name") or path.stem
        self.chat_template = self.metadata.get("tokenizer.chat_template")
        self.end_of_generation = np.array(
            [bool(L.llama_vocab_is_eog(self._vocab, t)) for t in range(self.n_vocab)], dtype=bool
        )
        self.fim = {
            "prefix": L.llama_vocab_fim_pre(self._vocab),
            "suffix": L.llama_vocab_fim_suf(self._vocab),
            "middle": L.llama_vocab_fim_mid(self._vocab),
        }

    def _place(self, params: L.llama_model_params, placement: Placement) -> None:
        """Set the model's parameters for `placement`: none on a GPU for a CPU build, else its layers on its GPUs."""
        self.gpu_layers = params.n_gpu_layers = placement.layers(offload_supported())
        if self.gpu_layers == 0:
            return
        self.gpus = gpus(placement.gpus)
        if placement.tensor_split and len(placement.tensor_split) != len(self.gpus):
            raise EngineError(
                f"--tensor-split gives {len(placement.tensor_split)} proportions for {len(self.gpus)} GPUs "
                f"({', '.join(d.label for d in self.gpus)}): one for each"
            )
        # kept on self: llama.cpp reads both while the model loads
        self._gpu_list = (ctypes.c_void_p * (len(self.gpus) + 1))(*(d.handle for d in self.gpus), None)
        params.devices = ctypes.addressof(self._gpu_list)  # type: ignore[assignment]  # NULL-terminated; a void * field
        params.split_mode = L.LLAMA_SPLIT_MODE_LAYER if len(self.gpus) > 1 else L.LLAMA_SPLIT_MODE_NONE
        params.main_gpu = 0  # the first of `devices`, which is the only one without a split
        if placement.tensor_split:
            self._split = (ctypes.c_float * L.llama_max_devices())(*placement.tensor_split)
            params.tensor_split = self._split

    def kv_shape(self) -> KVShape:
        """What one token's KV costs in this model (layer 0's KV heads stand for every layer's)."""
        arch = self.metadata.get("general.architecture", "")
        heads = L.llama_model_n_head(self._model) or 1
        width = L.llama_model_n_embd(self._model) // heads
        return KVShape(
            L.llama_model_n_layer(self._model),
            L.llama_model_n_head_kv(self._model),
            int(self.metadata.get(f"{arch}.attention.key_length", width)),
            int(self.metadata.get(f"{arch}.attention.value_length", width)),
        )

    def device_report(self) -> DeviceReport:
        """What llama.cpp sees and what this model put where: each device with its memory in bytes, the GPUs
        its layers are on, and how many of its layers (the output layer counted) are there."""
        layers = L.llama_model_n_layer(self._model) + 1
        offloaded = 0 if not self.gpus else layers if self.gpu_layers < 0 else min(layers, self.gpu_layers)
        return {
            "devices": [d.as_dict() for d in devices()],
            "gpus": [d.name for d in self.gpus],
            "gpu_layers": offloaded,
            "layers": layers,
        }

    @functools.cached_property
    def pieces(self) -> list[bytes]:
        """Each token's bytes as text, control tokens empty."""
        return [self._piece(t, special=False) for t in range(self.n_vocab)]

    @functools.cached_property
    def special_pieces(self) -> list[bytes]:
        """Each token's bytes, control tokens spelled out (`<|im_end|>`)."""
        return [self._piece(t, special=True) for t in range(self.n_vocab)]

    def set_fim(self, prefix: int, suffix: int, middle: int) -> None:
        """Name the fill-in-the-middle marker tokens when the GGUF's metadata does not."""
        for token in (prefix, suffix, middle):
            if not 0 <= token < self.n_vocab:
                raise EngineError(f"FIM token {token} is outside the vocabulary (0..{self.n_vocab - 1})")
        self.fim = {"prefix": prefix, "suffix": suffix, "middle": middle}

    def _read_metadata(self) -> dict[str, str]:
        out: dict[str, str] = {}
        buf = ctypes.create_string_buffer(1 << 20)
        for i in range(L.llama_model_meta_count(self._model)):
            if L.llama_model_meta_key_by_index(self._model, i, buf, len(buf)) < 0:
                continue
            key = buf.value.decode("utf-8", "replace")
            if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type", "scores")):
                continue
            if L.llama_model_meta_val_str_by_index(self._model, i, buf, len(buf)) < 0:
                continue
            out[key] = buf.value.decode("utf-8", "replace")
        return out

    def _piece(self, token: int, *, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def tokenize(self, text: str, special: bool, *, add_special: bool = False) -> list[int]:
        """Token ids of `text`; `special` parses marker text such as `<|im_end|>` as its token;
        `add_special` adds the BOS (and EOS) the model's vocabulary asks for around a whole input."""
        if not text and not add_special:
            return []
        raw = text.encode("utf-8")
        room = len(raw) + 16
        out = (L.llama_token * room)()
        n = L.llama_tokenize(self._vocab, raw, len(raw), out, room, add_special, special)
        if n < 0:
            room = -n
            out = (L.llama_token * room)()
            n = L.llama_tokenize(self._vocab, raw, len(raw), out, room, add_special, special)
        return list(out[:n])

    def detokenize(self, tokens: list[int], *, special: bool = False) -> str:
        table = self.special_pieces if special else self.pieces
        return b"".join(table[t] for t in tokens).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        return self.special_pieces[token].decode("utf-8", "replace")

    @property
    def pooling(self) -> int:
        """How an embedding pools its tokens: the GGUF's own `<arch>.pooling_type` when it is mean, CLS or
        last token, else mean (a chat model names none; a reranker's rank pooling yields scores, not vectors)."""
        arch = self.metadata.get("general.architecture", "")
        own = int(self.metadata.get(f"{arch}.pooling_type", L.LLAMA_POOLING_TYPE_NONE))
        pooled = (L.LLAMA_POOLING_TYPE_MEAN, L.LLAMA_POOLING_TYPE_CLS, L.LLAMA_POOLING_TYPE_LAST)
        return own if own in pooled else L.LLAMA_POOLING_TYPE_MEAN

    def close(self) -> None:
        if self._model:
            L.llama_model_free(self._model)
            self._model = None


def _load_failure(path: Path) -> str:
    """Why a file did not load, as far as we can tell without llama.cpp's log."""
    if not path.is_file():
        return "no such file"
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        return f"not a GGUF file (it starts with {magic!r})"
    said = [m for m in _errors if "error loading model" in m] or list(_errors)
    if said:
        return said[-1].split(": ", 1)[-1] if "error loading model" in said[-1] else said[-1]
    return "llama.cpp refused it (a truncated or damaged GGUF, or an architecture this build does not know)"


def logit_skew(n_vocab: int) -> np.ndarray | None:
    """The per-token offsets `SUPERFLUID_TEST_LOGIT_SKEW` asks for, or None."""
    seed = os.environ.get(SKEW_ENV, "").strip()
    if not seed:
        return None
    return np.random.default_rng(int(seed)).normal(0.0, 0.5, n_vocab).astype(np.float32)


# A copy through the sequence state costs about 0.05 ms a token, a stream copy about 0.003 ms
# a window cell (bench/copies.py): below window / 16 tokens the state is the cheaper way.
SHORT_COPY_DIVISOR = 16


def kv_room(model: LlamaModel, shape: ContextShape) -> str | None:
    """Why `shape`'s KV would not fit on the model's GPUs beside its weights and the compute buffers;
    None when it fits, or when the KV is in host memory (a CPU build, or --gpu-layers 0)."""
    if not model.gpus:
        return None
    names = {d.name for d in model.gpus}
    now = [d for d in devices() if d.name in names]  # their free memory with the weights on them
    kv = model.kv_shape()
    compute = compute_bytes(L.llama_model_n_head(model._model), shape.batch, shape.window, model.n_vocab)
    return kv_refusal(
        kv.token_bytes(layers_on_gpu(model.gpu_layers, kv.layers)),
        shape.sequences,
        shape.window,
        sum(d.free for d in now) - compute,
        " + ".join(d.label for d in now),
    )


class LlamaContext:
    """One llama.cpp context: a KV slot per sequence id, decoded in batches."""

    def __init__(self, model: LlamaModel, shape: ContextShape, interrupt: Interrupt | None = None) -> None:
        self.model = model
        self.shape = shape
        self.interrupt = interrupt
        params = L.llama_context_default_params()
        params.n_ctx = shape.pool_tokens
        params.n_batch = shape.batch
        params.n_ubatch = shape.batch
        params.n_seq_max = shape.sequences
        params.n_threads = shape.threads
        params.n_threads_batch = shape.threads
        # One KV stream per sequence: each sequence's cells sit in position order in a stream
        # of its own, so its arithmetic never depends on other sequences (a shared pool
        # interleaves the cells). Flash attention only where the library holds each query to
        # one order (build.flash_attention_problem): llama.cpp's own changes it with the batch.
        params.kv_unified = False
        params.flash_attn_type = (
            L.LLAMA_FLASH_ATTN_TYPE_ENABLED if shape.flash_attention else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.no_perf = True
        refusal = kv_room(model, shape)
        if refusal is not None:
            raise EngineError(refusal)
        if shape.flash_attention and model.exact and (problem := build.flash_attention_problem()):
            raise EngineError(f"flash attention would let the batch change a token's logits: {problem}")
        self._ctx = L.llama_init_from_model(model._model, params)
        if not self._ctx:
            raise EngineError(
                f"llama.cpp could not create a context of {shape.sequences} slots of {shape.window} tokens"
            )
        self._mem = L.llama_get_memory(self._ctx)
        if interrupt is not None:  # llama.cpp asks the flag after every operation of a decode's graph
            L.llama_set_abort_callback(self._ctx, L.ggml_abort_callback(CALLBACK), interrupt.address)
        self.n_vocab = model.n_vocab
        self.skew = logit_skew(model.n_vocab)
        # llama.cpp copies a stream's buffer at the start of the next decode: until then
        # neither end of the copy may be exported or overwritten
        self._copying: set[int] = set()
        size = shape.batch
        self._tokens = np.zeros(size, dtype=np.int32)
        self._pos = np.zeros(size, dtype=np.int32)
        self._n_seq = np.ones(size, dtype=np.int32)
        self._seq = np.zeros(size, dtype=np.int32)
        self._logits = np.zeros(size, dtype=np.int8)
        seq_ptrs = (ctypes.POINTER(L.llama_seq_id) * size)()
        base = self._seq.ctypes.data
        for i in range(size):
            seq_ptrs[i] = ctypes.cast(base + 4 * i, ctypes.POINTER(L.llama_seq_id))
        self._seq_ptrs = seq_ptrs
        self._batch = L.llama_batch()
        # llama_cpp annotates the batch's pointer fields as ctypes arrays; ctypes takes pointers there
        self._batch.token = self._tokens.ctypes.data_as(ctypes.POINTER(L.llama_token))  # type: ignore[assignment]
        self._batch.embd = ctypes.POINTER(ctypes.c_float)()  # type: ignore[assignment]
        self._batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(L.llama_pos))  # type: ignore[assignment]
        self._batch.n_seq_id = self._n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))  # type: ignore[assignment]
        self._batch.seq_id = ctypes.cast(seq_ptrs, ctypes.POINTER(ctypes.POINTER(L.llama_seq_id)))  # type: ignore[assignment]
        self._batch.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))  # type: ignore[assignment]

    def decode(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, want: np.ndarray) -> np.ndarray:
        """Run one batch; returns the logits rows of the entries flagged in `want`, in order.

        The rows are a view into llama.cpp's buffer: read them before the next decode.
        """
        n = len(tokens)
        if n == 0 or n > self.shape.batch:
            raise EngineError(f"a batch holds 1 to {self.shape.batch} tokens, not {n}")
        self._tokens[:n] = tokens
        self._pos[:n] = positions
        self._seq[:n] = seqs
        self._logits[:n] = want
        self._batch.n_tokens = n
        status = L.llama_decode(self._ctx, self._batch)
        if status in (0, 1, 2):  # the decode ran its pending copies before it looked for room
            self._copying.clear()
        if status == 1:  # refused before any of it was placed in the KV
            raise KVFull("no room in the KV pool for this batch")
        if status != 0:
            self._forget(n)
        if status == 2:
            raise StepInterrupted("the step was interrupted")
        if status != 0:
            said = f" ({'; '.join(list(_errors)[-3:])})" if _errors else ""  # its reason, where it logged one
            raise EngineError(f"llama_decode failed with status {status}{said}")
        rows = int(np.count_nonzero(want))
        if rows == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        pointer = L.llama_get_logits(self._ctx)
        logits = np.ctypeslib.as_array(pointer, shape=(rows, self.n_vocab))
        if self.skew is not None:
            logits += self.skew
        return logits

    def _forget(self, n: int) -> None:
        """Take a failed batch of `n` tokens back out of the KV.

        llama.cpp splits a batch into micro-batches (one per run of consecutive sequence ids with
        as many tokens each) and, when one fails or is aborted, removes only that one's positions:
        those before it stay stored. Each sequence is cut back to where the batch started it.
        """
        seqs, positions = self._seq[:n], self._pos[:n]
        for seq in np.unique(seqs):
            self.truncate(int(seq), int(positions[seqs == seq].min()))

    def copy(self, source: int, target: int, length: int) -> None:
        """Make `target` hold `source`'s positions [0, length).

        llama.cpp copies a whole stream, all `window` cells of it, at the start of the next
        decode (about 12 ms at 4,096 tokens here; the fast build copies the cells given:
        scripts/patches/kv-pages-on-use.patch), and until then neither slot may be exported
        or restored (see `copy_pending`). A short source moves faster through its state, which
        costs by the tokens it holds: at once, and the same bytes.
        """
        if self.length(source) <= self.shape.window // SHORT_COPY_DIVISOR and not self._copying & {source, target}:
            self.truncate(target, 0)
            self.restore(target, self.export(source))
        else:
            L.llama_memory_seq_cp(self._mem, source, target, -1, -1)
            self._copying.update((source, target))
        self.truncate(target, length)

    @property
    def copy_pending(self) -> bool:
        """True between a `copy` and the decode that carries it out."""
        return bool(self._copying)

    def _settled(self, seq: int, what: str) -> None:
        if seq in self._copying:
            raise EngineError(f"slot {seq} cannot be {what} before the copy it takes part in has run")

    def truncate(self, seq: int, length: int) -> None:
        """Drop `seq`'s positions from `length` on (0 drops the whole sequence)."""
        if not L.llama_memory_seq_rm(self._mem, seq, length if length > 0 else -1, -1):
            raise EngineError(f"llama.cpp could not truncate sequence {seq} at {length}")

    def length(self, seq: int) -> int:
        """Positions held by `seq` (0 when it holds none)."""
        return L.llama_memory_seq_pos_max(self._mem, seq) + 1

    def export(self, seq: int) -> bytes:
        """The KV state of `seq`, to keep in host memory."""
        data = bytearray(self.export_size(seq))
        return bytes(memoryview(data)[: self.export_into(seq, memoryview(data))])

    def export_size(self, seq: int) -> int:
        """The bytes `export_into` may write for `seq`."""
        return L.llama_state_seq_get_size(self._ctx, seq)

    def export_into(self, seq: int, buffer: memoryview) -> int:
        """Write the KV state of `seq` into `buffer` (at least `export_size` long); the bytes written."""
        self._settled(seq, "exported")
        target = (ctypes.c_uint8 * len(buffer)).from_buffer(buffer)
        try:
            return L.llama_state_seq_get_data(self._ctx, target, len(buffer), seq)
        finally:
            del target  # the buffer may be remapped later: nothing may keep it exported

    def restore(self, seq: int, data: bytes | memoryview) -> None:
        """Load a state from `export` into `seq` (which must be empty)."""
        self._settled(seq, "restored")
        view = memoryview(data)
        source = (ctypes.c_uint8 * len(view)).from_buffer(view if not view.readonly else bytearray(view))
        try:
            if L.llama_state_seq_set_data(self._ctx, source, len(view), seq) == 0:
                raise KVFull("no room in the KV pool to restore a cached prefix")
        finally:
            del source

    def close(self) -> None:
        if self._ctx:
            L.llama_free(self._ctx)
            self._ctx = None


EMBED_OUTPUT_BYTES = 512 << 20  # what the logits rows of one embedding decode may take
EMBED_MIN_TOKENS = 512  # llama-server's default bound on an embedding input


def embedding_limit(model: LlamaModel, window: int) -> int:
    """The longest input an embedding takes: the window, or fewer when the model's vocabulary is large.

    With embeddings on, llama.cpp keeps a row of logits for every token of a decode, and an
    input is decoded whole, so its length is bounded by what those rows may take.
    """
    return min(window, max(EMBED_MIN_TOKENS, EMBED_OUTPUT_BYTES // (4 * model.n_vocab)))


class EmbeddingContext:
    """A second llama.cpp context on a model, for embeddings: one sequence, embeddings on, pooled by
    `LlamaModel.pooling`, not normalized.

    llama.cpp pools within one micro-batch, so an input is decoded whole: the context (and its
    batch) is sized to the longest input seen so far, in powers of two up to `embedding_limit`.
    Its KV and compute buffers are separate from the generation context's, which never sees
    these decodes.
    """

    def __init__(self, model: LlamaModel, threads: int, window: int) -> None:
        self.model = model
        self.threads = threads
        self.limit = embedding_limit(model, window)
        self.size = 0
        self._ctx: L.llama_context_p | None = None
        self._batch: L.llama_batch | None = None

    def _open(self, size: int) -> None:
        self.close()
        params = L.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = size
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = self.threads
        params.embeddings = True
        params.pooling_type = self.model.pooling
        params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        ctx = L.llama_init_from_model(self.model._model, params)
        if not ctx:
            raise EngineError(f"llama.cpp could not create an embedding context of {size} tokens")
        self._ctx, self.size = ctx, size
        # every input is sequence 0 from position 0, and pooling reads every token's output
        batch = self._batch = L.llama_batch_init(size, 0, 1)
        np.ctypeslib.as_array(batch.pos, shape=(size,))[:] = np.arange(size)
        np.ctypeslib.as_array(batch.n_seq_id, shape=(size,))[:] = 1
        np.ctypeslib.as_array(batch.logits, shape=(size,))[:] = 1
        for i in range(size):
            batch.seq_id[i][0] = 0

    def embed(self, tokens: list[int]) -> np.ndarray:
        """The pooled embedding of one input, `n_embd` float32s."""
        n = len(tokens)
        if not 0 < n <= self.limit:
            raise EngineError(f"an embedding input holds 1 to {self.limit} tokens, not {n}")
        if n > self.size:
            self._open(min(self.limit, max(256, 1 << (n - 1).bit_length())))
        assert self._ctx is not None and self._batch is not None
        L.llama_memory_clear(L.llama_get_memory(self._ctx), True)
        np.ctypeslib.as_array(self._batch.token, shape=(n,))[:] = tokens
        self._batch.n_tokens = n
        status = L.llama_decode(self._ctx, self._batch)
        if status != 0:
            raise EngineError(f"llama_decode of an embedding input failed with status {status}")
        pooled = L.llama_get_embeddings_seq(self._ctx, 0)
        if not pooled:
            raise EngineError("llama.cpp returned no pooled embedding")
        return np.ctypeslib.as_array(pooled, shape=(self.model.n_embd,)).copy()

    def close(self) -> None:
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            L.llama_free(self._ctx)
            self._ctx = None
        self.size = 0

"""A random-weight GGUF of the embedded model's architecture at a size people run, for the bench.

    .venv/bin/python bench/random_model.py --peers ~/.cache/superfluid/peers/<build>   # prints its path
    .venv/bin/python bench/random_model.py --peers DIR --size 8b --weights f16          # for llama-quantize

The embedded SmolLM2-135M decodes in a few milliseconds a token, where fixed costs per step
dominate; the models people serve (0.5-8B) are bound by memory bandwidth instead. This writes
a llama-architecture model with SmolLM2's tokenizer and chat template, but wider and with its
own layer count (about 0.7B parameters by default), its weights drawn at random and quantized
to Q4_1 like the embedded model's. Its text is noise and its cost is real: requests to it use
`ignore_eos`, so their lengths are fixed. The writer is llama.cpp's own `gguf-py`, from the
source tree `make` unpacks next to the peers; the file is cached under
`~/.cache/superfluid/models/`, named by its shape, and written once.

`--size 8b` is Llama-3-8B's shape (4,096 wide, 32 layers, heads of 128, 8 KV heads) with
SmolLM2's vocabulary: 7.2B parameters, for the GPU check (scripts/gpu_check.sh). Quantizing
that many weights in numpy takes long, so it is written in f16 (`--weights f16`) and
llama.cpp's `llama-quantize` makes it Q4_K_M.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CACHE = Path.home() / ".cache" / "superfluid" / "models"
SEED = 20261203  # the weights are the same on every machine that writes the file
HEAD_DIM = 64  # SmolLM2's


@dataclass(frozen=True)
class Shape:
    """The dimensions that set a llama model's size; the rest comes from the embedded model."""

    width: int = 1536  # n_embd
    layers: int = 24
    ffn: int = 4096
    kv_heads: int = 8
    head_dim: int = HEAD_DIM

    @property
    def heads(self) -> int:
        return self.width // self.head_dim

    def parameters(self, vocab: int) -> int:
        attention = 2 * self.width * self.width + 2 * self.width * self.kv_heads * self.head_dim
        return vocab * self.width + self.layers * (attention + 3 * self.width * self.ffn + 2 * self.width)

    def name(self, weights: str = "q4_1") -> str:
        heads = "" if self.head_dim == HEAD_DIM else f"-h{self.head_dim}"
        return f"random-llama-w{self.width}-l{self.layers}-f{self.ffn}-kv{self.kv_heads}{heads}-{weights}"


# the shapes `--size` names: the default, and Llama-3-8B's for the GPU check
SIZES = {"0.7b": Shape(), "8b": Shape(width=4096, layers=32, ffn=14336, kv_heads=8, head_dim=128)}
# numpy quantizes to Q4_1 and Q4_0 itself (Q4_0 is a type llama.cpp repacks); K-quant and IQ blocks are drawn as
# bytes, since gguf-py cannot quantize to them: Q4_K (Q4_K_M's main type, repacked too), the others llama.cpp's
# tiled kernels take (Q6_K, the rest of a Q4_K_M model; Q5_K, Q3_K, Q2_K, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS
# and IQ2_XXS), and Q4_K_M, Q4_K and Q6_K mixed as in the most common download; f16 is for llama-quantize
IQ_TYPES = ("iq4_xs", "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs")
WEIGHTS = ("q4_1", "q4_0", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k", *IQ_TYPES, "q4_k_m", "f16")
# a drawn block's f16 scales (d, and dmin where it has mins), and whether they lead the block (Q4_K, Q5_K and the
# IQ types) or end it: with the quants (an IQ type's grid indices and signs), sub-block scales and mins uniform,
# weights of mean about 0 and spread about 0.02
K_QUANT_SCALES = {
    "q4_k": (True, (8e-5, 6e-4)),
    "q5_k": (True, (4e-5, 6e-4)),
    "q6_k": (False, (1.5e-5,)),
    "q3_k": (False, (5e-4,)),
    "q2_k": (False, (2e-3, 3e-3)),
    "iq4_xs": (True, (1.5e-5,)),
    "iq3_s": (True, (1.4e-4,)),
    "iq3_xxs": (True, (1.5e-4,)),
    "iq2_s": (True, (3.5e-4,)),
    "iq2_xs": (True, (3.5e-4,)),
    "iq2_xxs": (True, (3.5e-4,)),
}


def gguf_py(peers: Path) -> Any:
    """llama.cpp's gguf-py package from the source tree under `peers`, imported."""
    found = sorted(peers.glob("src/llama_cpp_python-*/vendor/llama.cpp/gguf-py"))
    if not found:
        raise SystemExit(f"no llama.cpp source under {peers}/src: run `make peers` first")
    if str(found[-1]) not in sys.path:
        sys.path.insert(0, str(found[-1]))
    import gguf

    return gguf


# keys the new shape replaces (with the architecture's prefix), and the weights' file type
SHAPE_KEYS = (
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.dimension_count",
)


@functools.cache
def metadata(peers: Path, source: Path) -> dict[str, tuple[Any, Any, Any]]:
    """`source`'s metadata fields: each one's value, type and element type (for arrays). Read once a process:
    gguf-py parses the 49,152 tokens and merges of the embedded model's vocabulary in about 3 s, where writing
    a small model takes under one (the exactness tests write one a weight type)."""
    gguf = gguf_py(peers)
    fields = {}
    for name, field in gguf.GGUFReader(source).fields.items():
        vtype = field.types[0]
        fields[name] = (field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    return fields


def write(shape: Shape, peers: Path, source: Path, target: Path, weights: str = "q4_1") -> None:
    """Write the model: `source`'s metadata (tokenizer, template, rope, norms) with `shape`'s sizes, and
    weights drawn at random, quantized to Q4_1 or Q4_0, drawn as K-quant blocks (one type, or Q4_K_M's mix), or
    kept as f16 (`weights`)."""
    gguf = gguf_py(peers)
    fields = metadata(peers, source)
    arch = fields["general.architecture"][0]
    if arch != "llama":
        raise SystemExit(f"{source} is a {arch} model; this writer knows llama's tensors only")
    replaced = {f"{arch}.{key}" for key in SHAPE_KEYS} | {"general.architecture", "general.name", "general.file_type"}
    writer = gguf.GGUFWriter(target.with_suffix(".partial"), arch)
    for name, (value, vtype, sub) in fields.items():
        if not name.startswith("GGUF.") and name not in replaced:
            writer.add_key_value(name, value, vtype, sub)
    writer.add_name(shape.name(weights))
    writer.add_embedding_length(shape.width)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    file_type = f"MOSTLY_{weights.upper()}_S" if weights in ("q3_k", "q4_k", "q5_k") else f"MOSTLY_{weights.upper()}"
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    vocab = len(fields["tokenizer.ggml.tokens"][0])
    rng = np.random.default_rng(SEED)

    def matrix(name: str, rows: int, columns: int) -> None:
        kind = tensor_weights(weights, name)
        quantized = getattr(gguf.GGMLQuantizationType, kind.upper())
        if kind in K_QUANT_SCALES:
            block_size = gguf.GGML_QUANT_SIZES[quantized]  # (weights, bytes) per block
            writer.add_tensor(name, k_quant_blocks(rng, rows, columns, block_size, kind), raw_dtype=quantized)
        elif kind == "f16":  # drawn in float32, half float64's time and memory, at 7B parameters
            drawn = rng.standard_normal(size=(rows, columns), dtype=np.float32) * np.float32(0.02)
            writer.add_tensor(name, drawn.astype(np.float16))
        else:
            drawn = rng.normal(0.0, 0.02, size=(rows, columns)).astype(np.float32)
            writer.add_tensor(name, gguf.quants.quantize(drawn, quantized), raw_dtype=quantized)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(shape.width, dtype=np.float32))

    kv = shape.kv_heads * shape.head_dim
    matrix("token_embd.weight", vocab, shape.width)  # tied: the output reads it too, as SmolLM2's does
    for layer in range(shape.layers):
        block = f"blk.{layer}"
        norm(f"{block}.attn_norm.weight")
        matrix(f"{block}.attn_q.weight", shape.width, shape.width)
        matrix(f"{block}.attn_k.weight", kv, shape.width)
        matrix(f"{block}.attn_v.weight", kv, shape.width)
        matrix(f"{block}.attn_output.weight", shape.width, shape.width)
        norm(f"{block}.ffn_norm.weight")
        matrix(f"{block}.ffn_gate.weight", shape.ffn, shape.width)
        matrix(f"{block}.ffn_up.weight", shape.ffn, shape.width)
        matrix(f"{block}.ffn_down.weight", shape.width, shape.ffn)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    target.with_suffix(".partial").rename(target)  # a file of this name is whole


def tensor_weights(weights: str, name: str) -> str:
    """The type of tensor `name` in a model of `weights`: that type, but for Q4_K_M, which keeps the output (here
    the tied embedding) and the attn_v and ffn_down of every other layer in Q6_K, the rest in Q4_K, about as
    llama-quantize lays out a Q4_K_M model."""
    if weights != "q4_k_m":
        return weights
    if name == "token_embd.weight":
        return "q6_k"
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and int(name.split(".")[1]) % 2 == 0:
        return "q6_k"
    return "q4_k"


def k_quant_blocks(
    rng: np.random.Generator, rows: int, columns: int, block: tuple[int, int], weights: str
) -> np.ndarray:
    """K-quant blocks of random quants and sub-block scales (and mins), as the bytes of `rows` rows of `columns`
    weights; `block` is a block's weights and bytes, and its f16 scales go where `K_QUANT_SCALES` says."""
    per_block, size = block
    if columns % per_block:
        raise SystemExit(f"{weights.upper()} rows hold whole blocks of {per_block} weights, not {columns}")
    blocks = rng.integers(0, 256, size=(rows, columns // per_block, size), dtype=np.uint8)
    leading, values = K_QUANT_SCALES[weights]
    scales = np.array(values, dtype=np.float16).view(np.uint8)
    at = 0 if leading else size - scales.size
    blocks[:, :, at : at + scales.size] = scales
    return blocks.reshape(rows, -1)


def random_model(peers: Path, shape: Shape = Shape(), cache: Path = CACHE, weights: str = "q4_1") -> Path:
    """The cached model of `shape` with `weights` of that type, written first if it is not there."""
    from superfluid.model.resolve import embedded_model

    target = cache / f"{shape.name(weights)}.gguf"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        source = embedded_model().path
        started = time.monotonic()
        print(f"writing {target.name} (once): {source.name}'s architecture at this shape", file=sys.stderr)
        write(shape, peers, source, target, weights)
        size = target.stat().st_size / 1e6
        print(f"wrote {target} ({size:.0f} MB) in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=Path, required=True, help="the Makefile's PEERS directory")
    parser.add_argument("--size", choices=SIZES, default="0.7b", help="a shape to start from (default: %(default)s)")
    parser.add_argument("--width", type=int, help="n_embd (default: the size's)")
    parser.add_argument("--layers", type=int, help="blocks (default: the size's)")
    parser.add_argument("--ffn", type=int, help="feed-forward width (default: the size's)")
    parser.add_argument("--kv-heads", type=int, help="KV heads (default: the size's)")
    parser.add_argument("--weights", choices=WEIGHTS, default="q4_1", help="their type (default: %(default)s)")
    args = parser.parse_args()
    base = SIZES[args.size]
    shape = Shape(
        args.width or base.width, args.layers or base.layers, args.ffn or base.ffn, args.kv_heads or base.kv_heads,
        base.head_dim,
    )  # fmt: skip
    for name, value in (("width", shape.width), ("ffn", shape.ffn)):
        if value <= 0 or value % shape.head_dim:
            parser.error(f"--{name} must be a positive multiple of {shape.head_dim}, not {value}")
    print(random_model(args.peers, shape, weights=args.weights))


if __name__ == "__main__":
    main()

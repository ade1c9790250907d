"""The bench's random-weight model (bench/random_model.py): a GGUF llama.cpp loads and decodes, with the
embedded model's tokenizer and chat template, written once and cached."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import TEMPLATES
from random_model import Shape, random_model

from superfluid.engine.interface import ContextShape
from superfluid.engine.llama import LlamaContext, LlamaModel
from superfluid.model.resolve import embedded_model

PEERS = TEMPLATES.resolve().parents[5]  # <peers>/src/llama_cpp_python-*/vendor/llama.cpp/models/templates


def test_a_small_random_model_loads_decodes_and_is_written_once(tmp_path: Path) -> None:
    shape = Shape(width=64, layers=2, ffn=128, kv_heads=1)
    path = random_model(PEERS, shape, tmp_path)
    written = path.stat().st_mtime_ns
    assert random_model(PEERS, shape, tmp_path) == path and path.stat().st_mtime_ns == written, "cached"
    assert not list(tmp_path.glob("*.partial"))
    model = LlamaModel(path)
    embedded = LlamaModel(embedded_model().path, vocab_only=True)
    assert model.n_vocab == embedded.n_vocab
    assert model.metadata["tokenizer.chat_template"] == embedded.metadata["tokenizer.chat_template"]
    assert model.metadata["llama.embedding_length"] == "64" and model.metadata["llama.block_count"] == "2"
    tokens = model.tokenize("Write a poem about the sea.", True)
    assert tokens == embedded.tokenize("Write a poem about the sea.", True)
    context = LlamaContext(model, ContextShape(128, 1, 64, 1))
    want = np.zeros(len(tokens), dtype=np.int8)
    want[-1] = 1
    positions = np.arange(len(tokens), dtype=np.int32)
    logits = context.decode(np.asarray(tokens, dtype=np.int32), positions, np.zeros(len(tokens), np.int32), want)
    assert logits.shape == (1, model.n_vocab) and np.isfinite(logits).all()

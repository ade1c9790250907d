"""`superfluid models`: the GGUF files on this machine, read from their own metadata."""

from __future__ import annotations

from pathlib import Path

import pytest

from superfluid.cli.main import main
from superfluid.engine.llama import LlamaModel
from superfluid.model.resolve import EMBEDDED_NAME, embedded_model


def test_models_lists_the_embedded_the_hub_cache_and_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hub = tmp_path / "hub"
    snapshot = hub / "models--someone--Tiny-GGUF" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "tiny-Q4_1.gguf").symlink_to(embedded_model().path)
    (snapshot / "mmproj-tiny-f16.gguf").write_bytes(b"not a model")  # a projector is not listed
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "plain.gguf").symlink_to(embedded_model().path)
    (folder / "cut.gguf").write_bytes(embedded_model().path.read_bytes()[:4096])  # a download cut short
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert main(["models", "--dir", str(folder), "--http", "127.0.0.1:9"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "QUANT", "CONTEXT", "FAMILY", "LOADED"]
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert set(rows) == {EMBEDDED_NAME, "someone/Tiny-GGUF:Q4_1", str(folder / "plain.gguf")}
    metadata = LlamaModel(embedded_model().path, vocab_only=True).metadata
    context = metadata[f"{metadata['general.architecture']}.context_length"]
    for row in rows.values():
        assert row[3:6] == ["Q4_1", context, "chatml"], row  # size is two words: "94 MiB"
    assert lines[4:] == [
        f"(not a GGUF llama.cpp reads: {folder / 'cut.gguf'})",
        "(no daemon answers at 127.0.0.1:9: LOADED is left empty)",
    ]

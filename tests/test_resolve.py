"""Model references: the embedded model, paths, the Hugging Face cache and a download."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import FakeHub

from superfluid.config import ServeConfig
from superfluid.core.runtime import Models
from superfluid.model.resolve import ModelNotFound, embedded_model, hub_ref, is_hub_id, pick_gguf, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return cache


def put_in_cache(cache: Path, repo: str, files: dict[str, bytes], revision: str = COMMIT) -> Path:
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / revision
    for name, data in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(data)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    return snapshot


def test_the_embedded_model_is_found_without_importing_its_package() -> None:
    model = embedded_model()
    assert model.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and model.path.stat().st_size > 50_000_000
    assert resolve_model(None) == model


def test_hub_ids_and_paths() -> None:
    assert is_hub_id("unsloth/Qwen3-0.6B-GGUF:Q4_K_M")
    assert is_hub_id("bartowski/SmolLM2-360M-Instruct-GGUF")
    assert not is_hub_id("./models/x.gguf") and not is_hub_id("/abs/x.gguf") and not is_hub_id("dir/model.gguf")
    with pytest.raises(ModelNotFound, match=r"model file .*missing\.gguf does not exist"):
        resolve_model("/nonexistent/missing.gguf")


def test_picking_the_quant_out_of_a_repo() -> None:
    files = [
        "model-Q4_K_M.gguf",
        "model-Q4_K_S.gguf",
        "model-Q8_0.gguf",
        "mmproj-model-f16.gguf",
        "big/model-Q6_K-00001-of-00002.gguf",
        "big/model-Q6_K-00002-of-00002.gguf",
    ]
    assert pick_gguf(files, "Q8_0") == "model-Q8_0.gguf"
    assert pick_gguf(files, "q4_k_s") == "model-Q4_K_S.gguf"
    assert pick_gguf(files, "Q6_K") == "big/model-Q6_K-00001-of-00002.gguf"
    assert pick_gguf(files, None) == "model-Q4_K_M.gguf"
    assert pick_gguf(files, "IQ2_XS") is None


def test_a_hub_id_resolves_from_the_local_cache(hub_cache: Path) -> None:
    snapshot = put_in_cache(hub_cache, "someone/tiny-GGUF", {"tiny-Q8_0.gguf": b"GGUF", "tiny-Q4_1.gguf": b"GGUF"})
    found = resolve_model("someone/tiny-GGUF:Q4_1", offline=True)
    assert found.path == snapshot / "tiny-Q4_1.gguf" and found.name == "someone/tiny-GGUF"
    # the names people copy from the hub and Ollama find the same file
    for name in ("hf.co/someone/tiny-GGUF:Q4_1", "https://huggingface.co/someone/tiny-GGUF:Q4_1"):
        assert resolve_model(name, offline=True) == found


def test_a_served_model_answers_to_its_hub_name_with_the_quant(hub_cache: Path) -> None:
    put_in_cache(hub_cache, "someone/tiny-GGUF", {"tiny-Q8_0.gguf": b"GGUF"})
    models = Models(ServeConfig(offline=True))
    model_id = models.add("hf.co/someone/tiny-GGUF:Q8_0")
    assert model_id == "someone/tiny-GGUF"
    for name in ("someone/tiny-GGUF", "hf.co/someone/tiny-GGUF:Q8_0", "someone/tiny-gguf:latest", "tiny-Q8_0"):
        assert models.find(name) == model_id, name
    assert models.find("hf.co/someone/tiny-GGUF:Q4_K_M") is None, "a quantisation it does not serve"
    assert hub_ref("hf.co/a/b:latest") == "a/b" and hub_ref("smollm2:latest") == "smollm2:latest", "no hub name"


def test_offline_and_missing_names_what_was_looked_for_and_where(hub_cache: Path) -> None:
    put_in_cache(hub_cache, "someone/tiny-GGUF", {"tiny-Q8_0.gguf": b"GGUF"})
    with pytest.raises(ModelNotFound) as error:
        resolve_model("someone/tiny-GGUF:Q4_K_M", offline=True)
    message = str(error.value)
    assert "someone/tiny-GGUF:Q4_K_M" in message
    assert str(hub_cache / "models--someone--tiny-GGUF" / "snapshots") in message
    assert "huggingface-cli download someone/tiny-GGUF --include '*Q4_K_M*.gguf'" in message


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub() as hub:
        hub.repos["someone/remote-GGUF"] = {
            "remote-Q4_1.gguf": b"GGUF-remote-weights",
            "remote-Q8_0.gguf": b"GGUF-other",
        }
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield hub


def test_a_missing_model_is_downloaded_into_the_cache(
    hub_cache: Path, fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = resolve_model("someone/remote-GGUF:Q4_1")
    assert found.path.read_bytes() == b"GGUF-remote-weights"
    assert str(found.path).startswith(str(hub_cache / "models--someone--remote-GGUF"))
    # the next start finds it in the cache, with no network at all
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("someone/remote-GGUF:Q4_1").path == found.path

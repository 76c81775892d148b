"""The loader: a model is found without waiting on a missing network, a directory that is not a model says so,
a cached hub id loads with no network, and the family registry picks the engine class (all fast, no network)."""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path

import pytest
import torch
import transformers as T

from kamera_engine import Engine, ModelLoadError, UnsupportedModelError
from kamera_engine.loading import engine_class_for, hub_unreachable, locate, resolve_dtype
from kamera_engine.vision import VisionEngine
from kamera_engine.vision.tiny import tiny_tokenizer
from tests.conftest import TINY_COMMON


def _fresh_id() -> str:
    return f"kamera-tests/no-such-model-{uuid.uuid4().hex[:12]}"


def _timed_failure(model: str | Path, error: type[Exception] = ModelLoadError) -> tuple[str, float]:
    t0 = time.perf_counter()
    with pytest.raises(error) as info:
        Engine.load(model, device="cpu")
    return str(info.value), time.perf_counter() - t0


def _save_tiny_llama(directory: Path) -> None:
    torch.manual_seed(0)
    cfg = T.LlamaConfig(num_key_value_heads=2, **TINY_COMMON)
    T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)


def test_an_uncached_id_fails_at_once_in_offline_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _fresh_id()
    message, seconds = _timed_failure(model)
    assert seconds < 2.0
    assert model in message and "not a local path" in message and "not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE" in message and "Engine.load('/path/to/model')" in message


def test_an_uncached_id_fails_at_once_when_the_hub_refuses_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    for proxy in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens there
    assert hub_unreachable() is not None
    message, seconds = _timed_failure(_fresh_id())
    assert seconds < 2.0
    assert "hub cannot be reached" in message and "127.0.0.1:9" in message


def test_a_cached_id_loads_with_no_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An id in the local cache loads from its snapshot directory when the hub cannot be reached: not one
    connection is tried (from_pretrained of the id would still ask the hub for a PEFT adapter config and the
    client's agent registry, and where name lookups fail slowly, as on a machine whose DNS answers "try again",
    wait through rounds of retries)."""
    repo, commit = "kamera-tests/tiny-llama", "0" * 40
    cache = tmp_path / "hub"
    snapshot = cache / "models--kamera-tests--tiny-llama" / "snapshots" / commit
    _save_tiny_llama(snapshot)
    (cache / "models--kamera-tests--tiny-llama" / "refs").mkdir()
    (cache / "models--kamera-tests--tiny-llama" / "refs" / "main").write_text(commit)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = locate(repo)
    assert source.offline and source.name == repo and Path(source.path) == snapshot
    tried: list[object] = []

    def no_network(host: object, *args: object, **kwargs: object) -> object:
        tried.append(host)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    t0 = time.perf_counter()
    engine = Engine.load(repo, device="cpu")
    assert time.perf_counter() - t0 < 2.0
    assert tried == []
    assert type(engine) is Engine and engine.name == repo and engine.num_layers == 2


def test_a_cached_config_without_weights_is_not_a_cached_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that holds an id's config but not its weights (a download cut short) is refused as such, at once,
    rather than handed to from_pretrained, whose error would name a file in the snapshot directory."""
    repo, commit = "kamera-tests/tiny-llama-config-only", "1" * 40
    cache = tmp_path / "hub"
    snapshot = cache / "models--kamera-tests--tiny-llama-config-only" / "snapshots" / commit
    _save_tiny_llama(snapshot)
    for weights in snapshot.glob("*.safetensors"):
        weights.unlink()
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(commit)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message, seconds = _timed_failure(repo)
    assert seconds < 2.0
    assert "its Hugging Face cache holds no weights" in message and "HF_HUB_CACHE" in message


def test_a_directory_that_is_not_a_model_says_so(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    message, seconds = _timed_failure(tmp_path)
    assert seconds < 2.0 and "not a model directory" in message and "no config.json" in message
    assert "sentencepiece" not in message
    message, _ = _timed_failure(tmp_path / "notes.txt")
    assert "is a file, not a model directory" in message


def test_paths_and_ids_that_cannot_be_anything() -> None:
    message, _ = _timed_failure("./no/such/dir")
    assert message == "model path not found: ./no/such/dir"
    message, _ = _timed_failure("a/b/c")
    assert "neither an existing local path nor a Hugging Face model id" in message


def test_a_model_type_without_adapter_is_refused_before_weights_are_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))  # no weights, no tokenizer
    message, seconds = _timed_failure(tmp_path, UnsupportedModelError)
    assert seconds < 2.0 and "'bert' has no Kamera adapter" in message


def test_vision_engine_refuses_a_text_model_before_weights_are_read(tmp_path: Path) -> None:
    T.LlamaConfig(num_key_value_heads=2, **TINY_COMMON).save_pretrained(tmp_path)  # config only
    with pytest.raises(UnsupportedModelError, match="no Kamera vision family"):
        VisionEngine.load(tmp_path, device="cpu")


def test_the_registry_picks_a_subclass_of_the_class_load_was_called_on() -> None:
    assert engine_class_for("qwen2_vl", Engine) is VisionEngine
    assert engine_class_for("qwen2_vl", VisionEngine) is VisionEngine
    assert engine_class_for("llama", Engine) is Engine
    assert engine_class_for("llama", VisionEngine) is VisionEngine  # VisionEngine.from_source refuses it


def test_dtype_names() -> None:
    assert resolve_dtype(None, torch.device("cpu")) is torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    assert resolve_dtype(None, torch.device("cuda")) is torch.bfloat16

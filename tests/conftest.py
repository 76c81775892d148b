"""Shared fixtures: tiny random models per attention family, and the real default model once per session."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import transformers as T

if not torch.cuda.is_available():  # Triton kernels run in its CPU interpreter; read when they are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kamera_engine import Engine

#: where the tiny engines run: ``KAMERA_TEST_DEVICE=cuda`` runs the tests built on them on a GPU
#: (docs/batching.md, "On a GPU"); CI has none and runs them on the CPU
TEST_DEVICE = torch.device(os.environ.get("KAMERA_TEST_DEVICE", "cpu"))

TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=128,
    max_position_embeddings=8192,
)
_THETA = 10000.0

#: name -> config factory. Every adapter and every supported RoPE scaling appears here.
TINY_CONFIGS = {
    "llama": lambda: T.LlamaConfig(num_key_value_heads=2, **TINY_COMMON),
    "llama-linear": lambda: T.LlamaConfig(
        num_key_value_heads=2,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": _THETA},
        **TINY_COMMON,
    ),
    "llama-llama3": lambda: T.LlamaConfig(
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
            "rope_theta": _THETA,
        },
        **TINY_COMMON,
    ),
    "llama-yarn": lambda: T.LlamaConfig(
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 256,
            "rope_theta": _THETA,
        },
        **TINY_COMMON,
    ),
    "mistral": lambda: T.MistralConfig(num_key_value_heads=2, **TINY_COMMON),
    "qwen2": lambda: T.Qwen2Config(num_key_value_heads=2, **TINY_COMMON),
    "qwen3": lambda: T.Qwen3Config(num_key_value_heads=2, head_dim=16, **TINY_COMMON),
    "phi3": lambda: T.Phi3Config(num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0, **TINY_COMMON),
    "gpt_neox": lambda: T.GPTNeoXConfig(rotary_pct=0.25, **TINY_COMMON),
    "phi": lambda: T.PhiConfig(partial_rotary_factor=0.5, **TINY_COMMON),
}

ANCHOR = [1, 2, 3, 4]


def tiny_chat_config(vocab_size: int, max_position_embeddings: int = 4096) -> T.LlamaConfig:
    """A 2-layer Llama config over a real vocabulary (the default model's tokenizer, chat template)."""
    sizes = dict(TINY_COMMON, vocab_size=vocab_size, max_position_embeddings=max_position_embeddings)
    return T.LlamaConfig(num_key_value_heads=2, **sizes)


def tiny_chat_engine() -> Engine:
    """A random 2-layer Llama behind the default model's tokenizer and chat template (no weights loaded)."""
    from kamera_engine.default_model import ensure_converted

    tokenizer = T.AutoTokenizer.from_pretrained(str(ensure_converted()))
    torch.manual_seed(0)
    cfg = tiny_chat_config(len(tokenizer))
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    return Engine(model.eval().to(TEST_DEVICE), tokenizer, name="tiny-llama-chat")


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = TINY_CONFIGS[name]()
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    # Random init is tiny; scale up so attention is far from uniform and conditioning is visible.
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name_:
                p.mul_(4.0)
    return model.eval().to(TEST_DEVICE)


def tiny_engine(name: str, seed: int = 0) -> Engine:
    return Engine(tiny_model(name, seed), None, name=f"tiny-{name}", anchor_ids=ANCHOR)


class CharTokenizer:
    """Token i decodes to chr(ord('a') + i % 26): text, streams and stop strings on a tiny model."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def char_engine() -> Engine:
    """A tiny Llama with ``CharTokenizer`` (answers as text, stop strings)."""
    return Engine(tiny_model("llama"), CharTokenizer(), name="tiny-llama", anchor_ids=ANCHOR)


@pytest.fixture(params=sorted(TINY_CONFIGS))
def tiny(request: pytest.FixtureRequest) -> Engine:
    """A tiny random engine for each family / RoPE variant."""
    return tiny_engine(request.param)


@pytest.fixture(scope="session")
def default_engine() -> Engine:
    """The real embedded default model (SmolLM2-135M-Instruct), loaded once, in float32 where the tests run
    (``KAMERA_TEST_DEVICE``): ``Engine.load()`` alone would pick bfloat16 on a GPU, and the references hold
    float32 tolerances."""
    return Engine.load(device=str(TEST_DEVICE), dtype="float32")


@pytest.fixture(scope="session")
def default_cpu_engine(default_engine: Engine) -> Engine:
    """The default model on the CPU, for tests of CPU machinery (oneDNN's packed weights, the thread pool)."""
    return default_engine if TEST_DEVICE.type == "cpu" else Engine.load(device="cpu", dtype="float32")


def reprefill_logprobs(win: Any, prompt: list[int]) -> torch.Tensor:
    """The reference for a window's answer: its chunks and ``prompt`` re-prefilled in one forward after the anchor, as
    a serving engine does it; the next token's log-probs in host memory, where the window hands its own out."""
    engine = win.engine
    ids = [t for c in win.chunks for t in win.chunk(c).token_ids]
    return engine.next_token_logprobs(engine.anchor_kv, ids + prompt, len(engine.anchor_ids))


def random_ids(n: int, seed: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()


def script(name: str) -> ModuleType:
    """``scripts/<name>.py`` loaded from its file as module ``name`` (``scripts/`` is not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

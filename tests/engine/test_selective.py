"""Partial re-prefill along the layer axis (``reprefill_from_layer``), checked against the model's own
forward: a plain re-prefill, and one whose layer ``k`` starts from the canonical's hidden state."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from kamera_engine import KV, Engine, InvalidInputError
from kamera_engine.kv import to_cache
from kamera_engine.runner import call_with_cache
from kamera_engine.selective import reprefill_from_layer
from tests.conftest import ANCHOR, TINY_COMMON, random_ids

A_LEN, B_LEN, C_LEN = 9, 7, 5
CONFIGS = {
    "llama": lambda: T.LlamaConfig(num_key_value_heads=2, **dict(TINY_COMMON, num_hidden_layers=4)),
    "qwen3": lambda: T.Qwen3Config(num_key_value_heads=2, head_dim=16, **dict(TINY_COMMON, num_hidden_layers=4)),
}


def _engine(family: str) -> Engine:
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # scale the tiny random init up so conditioning is visible
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(4.0)
    return Engine(model.eval(), None, name=f"tiny-{family}-4", anchor_ids=ANCHOR)


def _setup(family: str):  # type: ignore[no-untyped-def]
    """anchor + A + B + C; A exact, B and C their relocated canonicals (blind)."""
    e = _engine(family)
    a = len(ANCHOR)
    A, B, C = random_ids(A_LEN, 1), random_ids(B_LEN, 2), random_ids(C_LEN, 3)
    kv_a = e.forward(A, e.anchor_kv, a, logits="none").kv
    b0, c0 = a + A_LEN, a + A_LEN + B_LEN
    blind = KV.cat([e.anchor_kv, kv_a, e.apply(e.canonical(B), None, b0), e.apply(e.canonical(C), None, c0)])
    return e, blind, kv_a, (A, B, C), (b0, c0)


@torch.inference_mode()
def _reference(e: Engine, kv_a: KV, b: list[int], b0: int, k: int) -> KV:
    """B's K/V from the model's own forward over anchor + A, with layer ``k``'s input replaced by the hidden
    state B has there in its canonical forward (B right after the anchor)."""
    a = len(ANCHOR)
    canon = call_with_cache(
        e.model,
        to_cache(e.anchor_kv, e.model.config),
        input_ids=torch.tensor([b]),
        position_ids=torch.arange(a, a + len(b))[None],
        output_hidden_states=True,
    )
    hidden_k = canon.hidden_states[k]  # (1, T, hidden): the input of layer k

    def swap(module, args, kwargs):  # type: ignore[no-untyped-def]
        return (hidden_k, *args[1:]), kwargs

    handle = e.adapter.layers(e.model)[k].register_forward_pre_hook(swap, with_kwargs=True)
    cache = to_cache([e.anchor_kv, kv_a], e.model.config)
    try:
        call_with_cache(e.model, cache, input_ids=torch.tensor([b]), position_ids=torch.arange(b0, b0 + len(b))[None])
    finally:
        handle.remove()
    return KV.from_cache(cache, b0, b0 + len(b), torch.arange(b0, b0 + len(b)))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_from_layer_zero_is_a_reprefill_of_the_spans(family: str) -> None:
    e, blind, _, (A, B, C), (b0, c0) = _setup(family)
    got = reprefill_from_layer(e, blind, ANCHOR + A + B + C, [range(b0, c0), range(c0, c0 + C_LEN)], 0, len(ANCHOR))
    ref = e.forward(ANCHOR + A + B + C, None, 0, logits="none").kv
    torch.testing.assert_close(got.keys, ref.keys, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got.values, ref.values, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("k", [1, 2])
def test_deep_layers_start_from_the_canonical_hidden_state(family: str, k: int) -> None:
    """B re-prefilled from layer k, C (behind it, not a span) left alone."""
    e, blind, kv_a, (A, B, C), (b0, c0) = _setup(family)
    got = reprefill_from_layer(e, blind, ANCHOR + A + B + C, [range(b0, c0)], k, len(ANCHOR))
    # the shallow layers keep the canonical; everything outside the span is untouched
    assert torch.equal(got.keys[:k], blind.keys[:k]) and torch.equal(got.values[:k], blind.values[:k])
    for side in (slice(0, b0), slice(c0, None)):
        assert torch.equal(got.keys[:, side], blind.keys[:, side])
        assert torch.equal(got.values[:, side], blind.values[:, side])
    ref = _reference(e, kv_a, B, b0, k)
    span = slice(b0, c0)
    torch.testing.assert_close(got.keys[:, span], torch.cat([blind.keys[:k, span], ref.keys[k:]]), atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(
        got.values[:, span], torch.cat([blind.values[:k, span], ref.values[k:]]), atol=3e-5, rtol=1e-5
    )
    # layer k's K/V come from the canonical's hidden state (so they are the canonical's); the deeper ones
    # attended to A and moved away from blind, short of the full re-prefill
    torch.testing.assert_close(got.keys[k, span], blind.keys[k, span], atol=3e-5, rtol=1e-5)
    full = e.forward(ANCHOR + A + B, None, 0, logits="none").kv
    assert not torch.allclose(got.keys[k + 1, span], blind.keys[k + 1, span], atol=1e-3)
    assert not torch.allclose(got.keys[k + 1, span], full.keys[k + 1, span], atol=1e-3)


def test_from_the_last_layer_nothing_changes_and_bad_input_is_refused() -> None:
    e, blind, _, (A, B, C), (b0, c0) = _setup("llama")
    ids, spans = ANCHOR + A + B + C, [range(b0, c0), range(c0, c0 + C_LEN)]
    assert reprefill_from_layer(e, blind, ids, spans, e.num_layers, len(ANCHOR)) is blind
    with pytest.raises(InvalidInputError, match="from_layer must be in"):
        reprefill_from_layer(e, blind, ids, spans, e.num_layers + 1, len(ANCHOR))
    with pytest.raises(InvalidInputError, match="sorted, disjoint"):
        reprefill_from_layer(e, blind, ids, [spans[1], spans[0]], 1, len(ANCHOR))
    with pytest.raises(InvalidInputError, match="sorted, disjoint"):
        reprefill_from_layer(e, blind, ids, [range(1, 6)], 1, len(ANCHOR))  # inside the anchor
    with pytest.raises(InvalidInputError, match="anchor_len must be"):
        reprefill_from_layer(e, blind, ids, spans, 1, -1)
    with pytest.raises(InvalidInputError, match="token ids"):
        reprefill_from_layer(e, blind, ids[:-1], spans, 1, len(ANCHOR))

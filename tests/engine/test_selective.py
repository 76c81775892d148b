"""Partial re-prefill along the layer axis (``reprefill_from_layer``), checked against the model's own
forward: a plain re-prefill, and one under a 4D mask that hides the antecedent from the chunks."""

from __future__ import annotations

import pytest
import torch

from kamera_engine import KV, InvalidInputError
from kamera_engine.selective import reprefill_from_layer
from tests.conftest import ANCHOR, random_ids, tiny_engine

A_LEN, B_LEN, C_LEN = 9, 7, 5


def _setup(family: str):  # type: ignore[no-untyped-def]
    """anchor + A + B + C; A exact, B and C their relocated canonicals (blind)."""
    e = tiny_engine(family)
    a = len(ANCHOR)
    A, B, C = random_ids(A_LEN, 1), random_ids(B_LEN, 2), random_ids(C_LEN, 3)
    kv_a = e.forward(A, e.anchor_kv, a, logits="none").kv
    b0, c0 = a + A_LEN, a + A_LEN + B_LEN
    blind = KV.cat([e.anchor_kv, kv_a, e.apply(e.canonical(B), None, b0), e.apply(e.canonical(C), None, c0)])
    ids = ANCHOR + A + B + C
    spans = [range(b0, c0), range(c0, c0 + C_LEN)]
    return e, blind, ids, spans


def _isolated_reference(e, ids: list[int], spans: list[range]) -> KV:  # type: ignore[no-untyped-def]
    """The model's forward with each span seeing only the anchor and itself (causally)."""
    n = len(ids)
    keys = torch.arange(n)
    allowed = keys[None, :] <= keys[:, None]
    for s in spans:
        rows = torch.arange(s.start, s.stop)
        allowed[rows[:, None], keys[None, :]] &= (keys[None, :] < len(ANCHOR)) | (keys[None, :] >= s.start)
    mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    with torch.inference_mode():
        out = e.model(input_ids=torch.tensor([ids]), attention_mask=mask, use_cache=True)
    return KV.from_cache(out.past_key_values, 0, n, torch.arange(n))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_from_layer_zero_is_a_reprefill_of_the_spans(family: str) -> None:
    e, blind, ids, spans = _setup(family)
    got = reprefill_from_layer(e, blind, ids, spans, 0, len(ANCHOR))
    ref = e.forward(ids, None, 0, logits="none").kv
    torch.testing.assert_close(got.keys, ref.keys, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got.values, ref.values, atol=2e-5, rtol=1e-5)


def test_shallow_layers_keep_the_canonical_and_deep_layers_see_an_isolated_input() -> None:
    e, blind, ids, spans = _setup("llama")  # 2 layers: layer 0 kept, layer 1 re-prefilled
    got = reprefill_from_layer(e, blind, ids, spans, 1, len(ANCHOR))
    lo, hi = spans[0].start, spans[-1].stop
    assert torch.equal(got.keys[0], blind.keys[0]) and torch.equal(got.values[0], blind.values[0])
    assert torch.equal(got.keys[1, :lo], blind.keys[1, :lo])  # anchor and antecedent untouched
    # layer 1's K/V are projections of its input: the spans' layer-0 output with the antecedent hidden
    ref = _isolated_reference(e, ids, spans)
    torch.testing.assert_close(got.keys[1, lo:hi], ref.keys[1, lo:hi], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got.values[1, lo:hi], ref.values[1, lo:hi], atol=2e-5, rtol=1e-5)
    full = e.forward(ids, None, 0, logits="none").kv
    assert not torch.allclose(got.keys[1, lo:hi], full.keys[1, lo:hi], atol=1e-3)  # not the full re-prefill
    assert not torch.allclose(got.keys[1, lo:hi], blind.keys[1, lo:hi], atol=1e-3)  # nor blind


def test_from_the_last_layer_nothing_changes_and_bad_input_is_refused() -> None:
    e, blind, ids, spans = _setup("llama")
    assert reprefill_from_layer(e, blind, ids, spans, e.num_layers, len(ANCHOR)) is blind
    with pytest.raises(InvalidInputError, match="from_layer must be in"):
        reprefill_from_layer(e, blind, ids, spans, e.num_layers + 1, len(ANCHOR))
    with pytest.raises(InvalidInputError, match="sorted, disjoint"):
        reprefill_from_layer(e, blind, ids, [spans[1], spans[0]], 1, len(ANCHOR))
    with pytest.raises(InvalidInputError, match="sorted, disjoint"):
        reprefill_from_layer(e, blind, ids, [range(1, 6)], 1, len(ANCHOR))  # inside the anchor
    with pytest.raises(InvalidInputError, match="token ids"):
        reprefill_from_layer(e, blind, ids[:-1], spans, 1, len(ANCHOR))

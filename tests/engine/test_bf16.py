"""The operator in bfloat16 and float16, on tiny random models: relocation rounds once (within one ulp of the
exact rotation of the stored key), stays within a few ulps of the keys a bf16 prefill writes at the target,
and patches are applied in float32 and rounded once. Tolerances are in units of the dtype (ulps)."""

from __future__ import annotations

import pytest
import torch

from kamera_engine import Engine, Patch, rotate_keys
from kamera_engine.adapters.base import capture_pre_rope_keys, reference_rotate
from kamera_engine.operator import apply_patch
from tests.conftest import ANCHOR, TINY_CONFIGS, random_ids, tiny_model

HALF = {torch.bfloat16: 7, torch.float16: 10}  # explicit mantissa bits
TARGETS = [37, 1000, 5000]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at each value of ``x`` (x as float64)."""
    mag = x.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - HALF[dtype])


def half_engine(name: str, dtype: torch.dtype, seed: int = 0) -> Engine:
    return Engine(tiny_model(name, seed).to(dtype), None, name=f"tiny-{name}-{dtype}", anchor_ids=ANCHOR)


@pytest.mark.parametrize("dtype", list(HALF), ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_relocation_rounds_once(name: str, dtype: torch.dtype) -> None:
    """Serving (float32) and reference (float64) relocation of a 16-bit canonical: within one ulp of the exact
    rotation of the stored key; values and the unrotated features are carried bit for bit."""
    engine = half_engine(name, dtype)
    can = engine.canonical(random_ids(24, seed=2))
    assert can.keys.dtype == dtype
    r = engine.rope.rotary_dim
    for target in TARGETS:
        exact = rotate_keys(can.keys.double(), engine.rope, target, None)  # float64, never rounded
        for placed in (engine.apply(can, None, target), engine.relocate(can, target)):
            assert placed.keys.dtype == dtype
            err = (placed.keys.double() - exact).abs()
            worst = (err / ulp(exact, dtype)).max().item()
            assert worst <= 1.0, f"{name} @ {target}: {worst:.2f} ulp from the exact rotation"
            assert torch.equal(placed.values, can.values)
            assert torch.equal(placed.keys[..., r:], can.keys[..., r:])


@pytest.mark.parametrize("name", sorted(set(TINY_CONFIGS) - {"llama-yarn"}))
def test_bf16_relocation_against_a_bf16_prefill_at_the_target(name: str) -> None:
    """Against the keys a bf16 prefill writes at the target (the model's own bf16 RoPE on the same pre-RoPE
    keys): within 3 ulps of each key row's magnitude. transformers' bf16 RoPE rounds cos, sin and each
    product, so the prefill itself sits up to ~2 ulps from the exact rotation (checked here too); the stored
    canonical carries that once from its own prefill, the target prefill once more, relocation adds <= 1.
    (yarn is left out of the second check only: its mscale makes the prefill differ from a pure rotation.)"""
    engine = half_engine(name, torch.bfloat16)
    ids = random_ids(24, seed=2)
    _ = engine.anchor_kv
    with capture_pre_rope_keys(engine.model) as pre:
        can = engine.canonical(ids)
    r = engine.rope.rotary_dim
    for target in TARGETS:
        pos = torch.arange(target, target + len(ids))
        placed = engine.apply(can, None, target)
        for layer, k_pre in enumerate(pre):
            k_pre = k_pre[..., -len(ids) :, :]
            prefill = reference_rotate(engine.model, engine.adapter, k_pre, pos)[0].transpose(0, 1)  # (T, H, r)
            unit = ulp(prefill[..., :r].double().abs().amax(-1, keepdim=True), torch.bfloat16)
            got = (placed.keys[layer][..., :r].double() - prefill[..., :r].double()).abs() / unit
            assert got.max().item() <= 3.0, f"layer {layer} @ {target}: {got.max().item():.2f} ulp"
            exact = rotate_keys(k_pre[0].transpose(0, 1).double(), engine.rope, pos, None)[..., :r]
            own = (prefill[..., :r].double() - exact).abs() / unit
            assert own.max().item() <= 2.0


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16], ids=["f32-factors", "bf16-factors"])
@pytest.mark.parametrize("dtype", list(HALF), ids=["bf16", "fp16"])
def test_patched_apply_rounds_once(dtype: torch.dtype, factor_dtype: torch.dtype) -> None:
    """``R · (canonical + U V^T)`` on 16-bit KV: within one ulp of the float64 result on the same inputs, for
    keys and values; ``reconstruct`` likewise."""
    engine = half_engine("qwen2", dtype)
    a, b = random_ids(20, seed=1), random_ids(16, seed=2)
    can = engine.canonical(b)
    ids = ANCHOR + a + b
    cond = engine.forward(ids, None, 0, logits="none").kv.slice(len(ids) - len(b), len(ids))
    patch = engine.form_patch(cond, can, 8, dtype=factor_dtype)
    assert patch.k_u.dtype == factor_dtype
    c64 = type(can)(can.keys.double(), can.values.double(), None)
    p64 = Patch(*(t.double() for t in (patch.k_u, patch.k_vt, patch.v_u, patch.v_vt)), patch.layers)
    want = apply_patch(c64, p64, engine.rope, 300, exact=True)
    got = engine.apply(can, patch, 300)
    free = engine.reconstruct(can, patch)
    for g, w in ((got.keys, want.keys), (got.values, want.values), (free.values, want.values)):
        assert g.dtype == dtype
        worst = ((g.double() - w).abs() / ulp(w, dtype)).max().item()
        assert worst <= 1.0, f"{worst:.2f} ulp"


def test_float32_factors_keep_the_error_floor_of_a_bf16_kv() -> None:
    """At (near) full rank a bf16 KV's patch error is set by rounding: float32 factors leave only the final
    rounding of the served KV, bf16 factors add their own (about 1.7x the floor on these models). Below
    full rank truncation dominates and the factor dtype does not matter (docs/gpu.md, "bf16")."""
    engine = half_engine("llama", torch.bfloat16)
    a, b = random_ids(20, seed=1), random_ids(16, seed=2)
    can = engine.canonical(b)
    ids = ANCHOR + a + b
    free = engine.make_free(engine.forward(ids, None, 0, logits="none").kv.slice(len(ids) - len(b), len(ids)))
    full = engine.num_kv_heads * engine.key_dim

    def eta(rank: int, dtype: torch.dtype) -> float:
        served = engine.reconstruct(can, engine.form_patch(free, can, rank, dtype=dtype))
        delta = (free.keys.double() - can.keys.double()).norm()
        return ((served.keys.double() - free.keys.double()).norm() / delta).item()

    f32, bf16 = eta(full, torch.float32), eta(full, torch.bfloat16)
    assert f32 < 0.005 and bf16 < 0.01
    assert f32 < bf16
    low32, low16 = eta(2, torch.float32), eta(2, torch.bfloat16)
    assert abs(low32 - low16) <= 0.01 * low32

"""The operator in bfloat16 and float16, on tiny random models: relocation rounds once (within one ulp of the
exact rotation of the stored key), stays within a few ulps of the keys a bf16 prefill writes at the target,
and patches are applied in float32 and rounded once. Tolerances are in units of the dtype (ulps)."""

from __future__ import annotations

import pytest
import torch

from kamera_engine import KV, Engine, Patch, rotate_keys
from kamera_engine.adapters.base import capture_pre_rope_keys, reference_rotate
from kamera_engine.errors import InvalidInputError
from kamera_engine.operator import apply_patch
from kamera_engine.rope import rotate_like_model
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
    """Serving (float32, ``rotation="exact"``) and reference (float64) relocation of a 16-bit canonical: within
    one ulp of the exact rotation of the stored key; values and the unrotated features are carried bit for bit.
    (The 16-bit default, ``"model"``, is judged against the prefill instead: ``test_prerope_canonical.py``.)"""
    engine = half_engine(name, dtype)
    can = engine.canonical(random_ids(24, seed=2))
    assert can.keys.dtype == dtype
    r = engine.rope.rotary_dim
    for target in TARGETS:
        exact = rotate_keys(can.keys.double(), engine.rope, target, None)  # float64, never rounded
        for placed in (engine.apply(can, None, target, rotation="exact"), engine.relocate(can, target)):
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
            k_pre = k_pre[..., -len(ids) :, :].cpu()
            prefill = reference_rotate(engine.model, engine.adapter, k_pre, pos)[0].transpose(0, 1)  # (T, H, r)
            unit = ulp(prefill[..., :r].double().abs().amax(-1, keepdim=True), torch.bfloat16)
            got = (placed.keys[layer][..., :r].double() - prefill[..., :r].double()).abs() / unit
            assert got.max().item() <= 3.0, f"layer {layer} @ {target}: {got.max().item():.2f} ulp"
            exact = rotate_keys(k_pre[0].transpose(0, 1).double(), engine.rope, pos, None)[..., :r]
            own = (prefill[..., :r].double() - exact).abs() / unit
            assert own.max().item() <= 2.0


def _terms(can: KV, patch: Patch, rope_style: str, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The magnitude of the terms ``canonical + U V^T`` sums, per element, for keys and values (float64:
    ``|canonical| + |U| |V^T|``); a rotated key component mixes its pair's two, so it gets both."""
    out = []
    for c, u, vt in ((can.keys, patch.k_u, patch.k_vt), (can.values, patch.v_u, patch.v_vt)):
        mag = c.double().abs()
        idx = torch.tensor(patch.layers, dtype=torch.long)
        mag.index_add_(0, idx, torch.bmm(u.double().abs(), vt.double().abs()).view(len(idx), *c.shape[1:]))
        out.append(mag)
    keys = out[0].clone()
    assert rope_style == "half"
    half = rotary_dim // 2
    pair = out[0][..., :half] + out[0][..., half:rotary_dim]
    keys[..., :half], keys[..., half:rotary_dim] = pair, pair
    return keys, out[1]


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16], ids=["f32-factors", "bf16-factors"])
@pytest.mark.parametrize("dtype", list(HALF), ids=["bf16", "fp16"])
def test_patched_apply_rounds_once(dtype: torch.dtype, factor_dtype: torch.dtype) -> None:
    """``R · (canonical + U V^T)`` on 16-bit KV (``rotation="exact"``) is computed in float32 and rounded to
    16 bits once: within one ulp of the float64 result on the same inputs, plus float32's own error, a few
    float32 ulps of the terms it sums (where ``canonical`` and ``U V^T`` cancel, the result can be thousands
    of times smaller than they are, and that error alone a 16-bit ulp of it: 1.22 ulp once on an AVX2 host
    whose GEMM sums in another order). Rounding twice (a 16-bit product, then a 16-bit add) would be off by
    up to half a 16-bit ulp of the terms. Keys and values; ``reconstruct`` likewise."""
    engine = half_engine("qwen2", dtype)
    a, b = random_ids(20, seed=1), random_ids(16, seed=2)
    can = engine.canonical(b)
    ids = ANCHOR + a + b
    cond = engine.forward(ids, None, 0, logits="none").kv.slice(len(ids) - len(b), len(ids))
    rank = 8
    patch = engine.form_patch(cond, can, rank, dtype=factor_dtype)
    assert patch.k_u.dtype == factor_dtype
    c64 = type(can)(can.keys.double(), can.values.double(), None)
    p64 = Patch(*(t.double() for t in (patch.k_u, patch.k_vt, patch.v_u, patch.v_vt)), patch.layers)
    want = apply_patch(c64, p64, engine.rope, 300, exact=True)
    got = engine.apply(can, patch, 300, rotation="exact")
    free = engine.reconstruct(can, patch)
    key_terms, value_terms = _terms(can, patch, engine.rope.style, engine.rope.rotary_dim)
    f32 = (rank + 4) * 2.0**-24  # float32 rounding: the rank-m sum, the add, the rotation
    for g, w, terms in ((got.keys, want.keys, key_terms), (got.values, want.values, value_terms),
                        (free.values, want.values, value_terms)):  # fmt: skip
        assert g.dtype == dtype
        allowed = ulp(w, dtype) + f32 * terms
        worst = ((g.double() - w).abs() / allowed).max().item()
        assert worst <= 1.0, f"{worst:.2f} of the allowed error"
    # the bound tells the two apart: rounding twice (the product to 16 bits, then a 16-bit add) fails it
    idx = torch.tensor(patch.layers, dtype=torch.long)
    twice = can.values.clone()
    twice.index_add_(0, idx, torch.bmm(patch.v_u.to(dtype), patch.v_vt.to(dtype)).view(len(idx), *twice.shape[1:]))
    assert ((twice.double() - want.values).abs() / (ulp(want.values, dtype) + f32 * value_terms)).max() > 2


def test_float32_factors_keep_the_error_floor_of_a_bf16_kv() -> None:
    """At (near) full rank a bf16 KV's patch error is set by rounding: float32 factors leave only the final
    rounding of the served KV, bf16 factors add their own (about 1.7x the floor on these models). Below
    full rank truncation dominates and the factor dtype does not matter (docs/gpu.md, "bf16")."""
    engine = half_engine("llama", torch.bfloat16)
    a, b = random_ids(20, seed=1), random_ids(16, seed=2)
    can = engine.canonical(b)
    ids = ANCHOR + a + b
    free = engine.make_free(engine.forward(ids, None, 0, logits="none").kv.to("cpu").slice(len(ids) - len(b), len(ids)))
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


# --- rotation="model": the model's own RoPE arithmetic in the KV dtype (docs/gpu.md, "bf16 and fp16") -------------
MODEL_ROPE = sorted(set(TINY_CONFIGS) - {"llama-yarn"})  # yarn scales cos/sin inside the model: not a pure rotation
TARGETS_IN_WINDOW = [37, 1000, 4000]  # prefills at the target stay inside mistral's 4096-token sliding window


def pre_rope_rows(captured: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """Each layer's captured pre-RoPE keys (1, H, T, D) as the last ``n`` token rows (n, H, D)."""
    return [k[0, :, -n:, :].transpose(0, 1) for k in captured]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", MODEL_ROPE)
def test_model_rotation_writes_the_bits_of_a_prefill(name: str, dtype: torch.dtype) -> None:
    """``rotate_like_model`` on a forward's pre-RoPE keys is bit for bit the model's own RoPE at the target:
    0 ulps at every layer against ``apply_rotary_pos_emb`` on those keys, and 0 ulps at layer 0 against the
    keys a prefill of the chunk alone at the target writes (its layer-0 pre-RoPE keys are the same bits).
    Deeper layers of that prefill are not asserted: their pre-RoPE keys already differ from the canonical
    forward's by rounding (measured 2.5-6 ulps of the row in bf16, ``scripts/bf16_ulp.py``)."""
    engine = half_engine(name, dtype) if dtype in HALF else tiny_engine_of(name)
    ids = random_ids(24, seed=2)
    _ = engine.anchor_kv
    with capture_pre_rope_keys(engine.model) as captured:
        engine.canonical(ids, anchored=False)
    pre = pre_rope_rows(captured, len(ids))
    assert len(pre) == engine.num_layers
    for target in TARGETS_IN_WINDOW:
        pos = torch.arange(target, target + len(ids))
        prefill = engine.forward(ids, None, target, logits="none").kv.keys
        for layer, k_pre in enumerate(pre):
            ours = rotate_like_model(k_pre, engine.rope, target)
            theirs = reference_rotate(engine.model, engine.adapter, k_pre.transpose(0, 1)[None], pos)[0]
            assert torch.equal(ours, theirs.transpose(0, 1)), f"layer {layer} @ {target}"
        r = engine.rope.rotary_dim  # phi hands RoPE its rotary band only: compare the band
        got = rotate_like_model(pre[0], engine.rope, target)[..., :r]
        assert torch.equal(got, prefill[0][..., :r]), f"layer 0 @ {target}"


def tiny_engine_of(name: str) -> Engine:
    return Engine(tiny_model(name), None, name=f"tiny-{name}", anchor_ids=ANCHOR)


@pytest.mark.parametrize("name", MODEL_ROPE)
def test_bf16_relocated_canonical_against_a_bf16_prefill_at_layer_0(name: str) -> None:
    """A stored bf16 canonical relocated to the target, against the layer-0 keys a bf16 prefill of the chunk
    alone writes there (same pre-RoPE bits): within 3 ulps of the row, both rotations, and ``"model"`` is the
    bits of the prefill on most features. Not 1 ulp: the canonical is un-rotated from its own prefill's
    bf16 RoPE, which is up to ~2 ulps off the exact rotation and cannot be undone (measured max 2-3 ulps,
    mean 0.17-0.33 exact, 0.08-0.22 model; docs/gpu.md). ``test_model_rotation_writes_the_bits_of_a_prefill``
    is the 0-ulp figure on a canonical holding the pre-RoPE keys."""
    engine = half_engine(name, torch.bfloat16)
    ids = random_ids(24, seed=2)
    can = engine.canonical(ids, anchored=False)
    r = engine.rope.rotary_dim
    for target in TARGETS_IN_WINDOW:
        want = engine.forward(ids, None, target, logits="none").kv.keys[0][..., :r].cpu()
        unit = ulp(want.double().abs().amax(-1, keepdim=True), torch.bfloat16)
        equal = {}
        for rotation in ("exact", "model"):
            got = engine.apply(can, None, target, rotation=rotation).keys[0][..., :r]
            worst = ((got.double() - want.double()).abs() / unit).max().item()
            assert worst <= 3.0, f"{rotation} @ {target}: {worst:.2f} ulp of the row"
            equal[rotation] = (got == want).double().mean().item()
        assert equal["model"] > 0.6 and equal["model"] > equal["exact"], equal


@pytest.mark.parametrize("dtype", list(HALF), ids=["bf16", "fp16"])
def test_model_rotation_of_a_patched_canonical(dtype: torch.dtype) -> None:
    """``rotation="model"`` reproduces the model's rounding only where a prefill has the same pre-RoPE keys
    (no patch); a patched chunk is computed as ``"exact"`` does (float32, rounded once), into ``out`` too."""
    engine = half_engine("qwen2", dtype)
    a, b = random_ids(20, seed=1), random_ids(16, seed=2)
    can = engine.canonical(b)
    ids = ANCHOR + a + b
    patch = engine.form_patch(engine.forward(ids, None, 0, logits="none").kv.slice(len(ids) - len(b), len(ids)), can, 4)
    got = engine.apply(can, patch, 300, rotation="model")
    want = engine.apply(can, patch, 300, rotation="exact")
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert not torch.equal(got.keys, rotate_like_model(engine.reconstruct(can, patch).keys, engine.rope, 300))
    bare = engine.apply(can, None, 300, rotation="model")
    assert torch.equal(bare.keys, rotate_like_model(can.keys, engine.rope, 300))
    assert torch.equal(bare.values, can.values)
    out = KV(torch.empty_like(can.keys), torch.empty_like(can.values))
    into = apply_patch(can, patch, engine.rope, 300, out=out, rotation="model")
    assert into.keys.data_ptr() == out.keys.data_ptr()
    assert torch.equal(into.keys, got.keys) and torch.equal(into.values, got.values)
    out = KV(torch.empty_like(can.keys), torch.empty_like(can.values))
    into = apply_patch(can, None, engine.rope, 300, out=out, rotation="model")
    assert into.keys.data_ptr() == out.keys.data_ptr() and torch.equal(into.keys, bare.keys)


def test_rotation_setting() -> None:
    """The engine's ``rotation`` is what ``apply`` uses unless told otherwise (a 16-bit engine with pre-RoPE
    canonicals: ``"model"``); an unknown one is refused."""
    engine = half_engine("llama", torch.bfloat16)
    can = engine.canonical(random_ids(12, seed=3))
    assert engine.rotation == "model"
    exact, model = engine.apply(can, None, 999, rotation="exact"), engine.apply(can, None, 999, rotation="model")
    assert not torch.equal(exact.keys, model.keys)
    assert torch.equal(engine.apply(can, None, 999).keys, model.keys)
    engine.rotation = "exact"
    assert torch.equal(engine.apply(can, None, 999).keys, exact.keys)
    with pytest.raises(InvalidInputError, match="rotation"):
        engine.apply(can, None, 999, rotation="bf16")


def _mrope_config(family: str) -> object:
    import transformers as T

    sizes = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    if family == "qwen2_vl":
        return T.Qwen2VLTextConfig(rope_parameters=rope, **sizes)
    return T.Qwen3VLTextConfig(rope_parameters=rope, **sizes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_model_rotation_of_mrope_tokens_is_the_models_own(family: str, dtype: torch.dtype) -> None:
    """M-RoPE (contiguous sections, Qwen2-VL; interleaved, Qwen3-VL): ``rotate_like_model`` with the spec bound
    to the tokens' axis offsets writes the bits the model's rotary module and ``apply_rotary_pos_emb`` write
    for the same keys at the three-axis positions ``p + delta``: 0 ulps."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl as q2
    from transformers.models.qwen3_vl import modeling_qwen3_vl as q3

    from kamera_engine.rope import RopeSpec
    from kamera_engine.vision.mrope import MRopeSpec, interleaved_axes, section_axes

    module = q2 if family == "qwen2_vl" else q3
    rotary_cls = q2.Qwen2VLRotaryEmbedding if family == "qwen2_vl" else q3.Qwen3VLTextRotaryEmbedding
    rot = rotary_cls(config=_mrope_config(family))
    axes = (section_axes if family == "qwen2_vl" else interleaved_axes)([2, 3, 3], 8)
    spec = MRopeSpec.of(RopeSpec(rot.inv_freq.float().clone(), 16, 16), axes)
    g = torch.Generator().manual_seed(4)
    n = 12
    keys = (torch.randn(n, 2, 16, generator=g) * 3).to(dtype)  # (T, H, D) pre-RoPE
    deltas = torch.randint(-3, 9, (n, 3), generator=g)
    deltas[:4] = 0  # text tokens: all axes at the linear position
    for target in (37, 1000, 5000):
        pos = torch.arange(target, target + n)
        cos, sin = rot(keys, (pos[:, None] + deltas).T[:, None, :])  # position ids (3, 1, T)
        _, want = module.apply_rotary_pos_emb(keys.transpose(0, 1)[None], keys.transpose(0, 1)[None], cos, sin)
        got = rotate_like_model(keys, spec.bind(deltas), target)
        assert torch.equal(got, want[0].transpose(0, 1)), f"{family} @ {target}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_model_rotation_of_an_mla_band_is_the_models_own(dtype: torch.dtype) -> None:
    """MLA (DeepSeek-V3, Kimi-K2.5): the model de-interleaves the ``k_pe`` band and rotates it into rotate-half
    layout, which is what the cache holds; ``rotate_like_model`` on the de-interleaved pre-RoPE band (the
    position-free frame of that layout) writes the model's bits: 0 ulps."""
    import transformers as T
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    from kamera_engine.rope import RopeSpec

    cfg = T.DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16, vocab_size=128)
    rot = ds.DeepseekV3RotaryEmbedding(config=cfg)
    spec = RopeSpec(rot.inv_freq.float().clone(), 16, 16)
    band = (torch.randn(10, 1, 16, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)  # interleaved pairs
    free = torch.cat([band[..., 0::2], band[..., 1::2]], dim=-1)  # the cache's layout at angle 0
    for target in (37, 1000, 5000):
        cos, sin = rot(band, torch.arange(target, target + 10)[None])
        b = band.transpose(0, 1)[None]
        _, want = ds.apply_rotary_pos_emb_interleave(b, b, cos, sin)
        assert torch.equal(rotate_like_model(free, spec, target), want[0].transpose(0, 1)), f"@ {target}"

"""Relocation is exact: relocated keys equal keys prefilled at the target position, for every adapter
and every supported RoPE scaling; values are untouched; a direct rotation equals a round trip."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from kamera_engine import Engine, InvalidInputError, UnsupportedModelError, rotate_keys
from kamera_engine.adapters.base import capture_pre_rope_keys, reference_rotate
from tests.conftest import ANCHOR, TINY_COMMON, random_ids

TARGETS = [len(ANCHOR), 37, 1000, 5000]


def _canonical_with_reference(engine: Engine, ids: list[int]):
    """Canonical of ``ids`` and the pre-RoPE keys its forward produced (per layer)."""
    _ = engine.anchor_kv  # computed outside the capture
    with capture_pre_rope_keys(engine.model) as pre:
        can = engine.canonical(ids)
    assert len(pre) == engine.num_layers
    n = len(ids)
    # each (1, H, n, D'), D' = D, or the rotary slice for families that rotate only a slice (Phi)
    return can, [k[..., -n:, :] for k in pre]


@pytest.mark.parametrize("target", TARGETS)
def test_relocated_keys_equal_keys_rotated_by_the_model(tiny: Engine, target: int) -> None:
    ids = random_ids(24, seed=1)
    can, pre = _canonical_with_reference(tiny, ids)
    positions = torch.arange(target, target + len(ids))
    placed = tiny.relocate(can, positions)
    for layer, k_pre in enumerate(pre):
        ref = reference_rotate(tiny.model, tiny.adapter, k_pre, positions)[0].transpose(0, 1).cpu()  # (T, H, D')
        err = (placed.keys[layer][..., : ref.shape[-1]] - ref).abs().max().item()
        assert err <= 1e-5, f"layer {layer}: max abs error {err:.2e}"
    assert torch.equal(placed.values, can.values)


@pytest.mark.parametrize("target", [37, 1000])
def test_relocation_matches_a_real_prefill_at_the_target(tiny: Engine, target: int) -> None:
    """End to end: prefill [anchor, chunk] shifted so the chunk starts at ``target``."""
    ids = random_ids(24, seed=2)
    can = tiny.canonical(ids)
    a = len(ANCHOR)
    ref = tiny.forward(ANCHOR + ids, None, target - a, logits="none").kv.to("cpu").slice(a, a + len(ids))
    placed = tiny.relocate(can, target)
    assert (placed.keys - ref.keys).abs().max().item() <= 1e-4
    assert (placed.values - ref.values).abs().max().item() <= 1e-4


def test_direct_rotation_equals_round_trip(tiny: Engine) -> None:
    can = tiny.canonical(random_ids(16, seed=3))
    direct = tiny.relocate(can, 900)
    via = tiny.relocate(tiny.relocate(tiny.relocate(can, 4000), 17), 900)
    assert (direct.keys - via.keys).abs().max().item() <= 1e-5
    back = tiny.make_free(direct)
    assert (back.keys - can.keys).abs().max().item() <= 1e-5


def test_partial_rotary_leaves_pass_through_features_alone() -> None:
    from tests.conftest import tiny_engine

    engine = tiny_engine("gpt_neox")
    can = engine.canonical(random_ids(8, seed=4))
    placed = engine.relocate(can, 321)
    r = engine.rope.rotary_dim
    assert r < engine.key_dim
    assert torch.equal(placed.keys[..., r:], can.keys[..., r:])
    assert not torch.allclose(placed.keys[..., :r], can.keys[..., :r])


def test_yarn_attention_factor_is_not_applied_twice() -> None:
    """yarn scales cos/sin by mscale > 1: relocation must keep the key norm (pure rotation)."""
    from tests.conftest import tiny_engine

    engine = tiny_engine("llama-yarn")
    can = engine.canonical(random_ids(8, seed=5))
    placed = engine.relocate(can, 2048)
    assert torch.allclose(placed.keys.norm(dim=-1), can.keys.norm(dim=-1), rtol=1e-5)


_SMALL = dict(TINY_COMMON, num_hidden_layers=1, num_key_value_heads=2)


@pytest.mark.parametrize(
    ("family", "rope"),
    [
        (T.LlamaConfig, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        (
            T.Phi3Config,
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 256,
            },
        ),
    ],
)
def test_length_dependent_rope_is_refused_with_the_model_and_type_named(family: type, rope: dict) -> None:
    model = T.AutoModelForCausalLM.from_config(family(rope_parameters=rope, pad_token_id=0, **_SMALL))
    with pytest.raises(UnsupportedModelError, match=rope["rope_type"]) as info:
        Engine(model, None, name="tiny-scaled", anchor_ids=ANCHOR)
    assert "tiny-scaled" in str(info.value)


def test_unknown_family_is_refused() -> None:
    cfg = T.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        Engine(T.AutoModelForCausalLM.from_config(cfg), None, anchor_ids=[1])


def test_bad_positions_are_rejected(tiny: Engine) -> None:
    can = tiny.canonical(random_ids(6, seed=6))
    with pytest.raises(InvalidInputError, match="positions"):
        rotate_keys(can.keys, tiny.rope, torch.arange(5))


def test_angles_are_taken_where_the_positions_are(tiny: Engine) -> None:
    # a KV moved to a GPU carries its positions there while the spec's inv_freq stays in host memory (an H200 ran
    # the operator bench's form_patch into the two); the meta device stands in for the GPU
    spec = tiny.rope
    on_host = spec.angles(torch.arange(40, 52))
    elsewhere = spec.angles(torch.arange(40, 52, device="meta"))
    assert spec.inv_freq.device.type == "cpu"
    assert elsewhere.device.type == "meta" and elsewhere.shape == on_host.shape and elsewhere.dtype == on_host.dtype

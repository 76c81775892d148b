"""``rope_in_values`` is an adapter capability, not a vision one: a text-only MLA model (DeepSeek-V3, whose cache
holds the RoPE-free latent in the key slot and the rotated ``k_pe`` band in the value slot) relocates exactly
through the base ``Engine`` once its adapter declares it."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from kamera_engine import Engine, ModelAdapter
from kamera_engine.adapters import ADAPTERS

IDS = list(range(10, 34))


class TextMLAAdapter(ModelAdapter):
    name = "deepseek_v3_text"
    model_types = ("deepseek_v3",)
    rope_in_values = True


def _model() -> torch.nn.Module:
    cfg = T.DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,
        max_position_embeddings=4096,
        rope_interleave=True,
    )
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # scaled up so positions matter visibly
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(4.0)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return _model()


def _engine(model: torch.nn.Module, adapter: type[ModelAdapter], monkeypatch: pytest.MonkeyPatch) -> Engine:
    monkeypatch.setitem(ADAPTERS, "deepseek_v3", adapter)
    return Engine(model, anchor_ids=[1, 2, 3])


def test_a_text_mla_model_relocates_exactly_when_its_adapter_declares_rope_in_values(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = _engine(model, TextMLAAdapter, monkeypatch)
    assert e.rope_in_values and (e.key_dim, e.value_dim, e.num_kv_heads) == (32, 8, 1)
    assert e.operator_rope.rotary_dim == e.operator_rope.head_dim == 8
    at_0 = e.forward(IDS, None, 0, logits="none").kv
    for target in (40, 900):
        at_target = e.forward(IDS, None, target, logits="none").kv  # the model's own forward at the target
        moved = e.relocate(at_0, target)
        assert torch.equal(moved.keys, at_0.keys)  # the latent carries no position: byte for byte
        assert (at_target.values - at_0.values).abs().max() > 1e-2  # the band does
        assert (moved.values - at_target.values).abs().max() <= 1e-5
        assert (moved.keys - at_target.keys).abs().max() <= 1e-5
    # the patch covers both channels: full rank reproduces latent and band of a conditioned chunk
    ids = [*e.anchor_ids, *range(40, 52), *IDS]
    start = len(ids) - len(IDS)
    cond = e.forward(ids, None, 0, logits="none").kv.slice(start, len(ids))
    can = e.canonical(IDS)
    patch = e.form_patch(cond, can, rank=len(IDS))
    served = e.apply(can, patch, start, exact=True)
    assert (served.keys - cond.keys).abs().max() <= 1e-4 and (served.values - cond.values).abs().max() <= 1e-4


def test_without_the_capability_relocation_rotates_the_wrong_slot(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = type("PlainDeepseekAdapter", (TextMLAAdapter,), {"rope_in_values": False})
    e = _engine(model, plain, monkeypatch)
    at_0 = e.forward(IDS, None, 0, logits="none").kv
    at_target = e.forward(IDS, None, 900, logits="none").kv
    moved = e.relocate(at_0, 900)
    assert (moved.values - at_target.values).abs().max() > 1e-2  # the band was not rotated


def test_a_slots_position_free_kv_keeps_nothing_of_the_forwards_output(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``slots.FreeLater`` copies whatever ``make_free`` leaves pointing into the forward's output: here the keys
    (the latent, which carries no position), where a plain model's are rotated into a new tensor."""
    from kamera_sdk.slots import FreeLater

    e = _engine(model, TextMLAAdapter, monkeypatch)
    out = e.forward(IDS, e.anchor_kv, 3, logits="none").kv
    placed = out.slice(4, 12)
    free = FreeLater(placed, e.make_free).get()
    forward = {out.keys.untyped_storage().data_ptr(), out.values.untyped_storage().data_ptr()}
    assert not {free.keys.untyped_storage().data_ptr(), free.values.untyped_storage().data_ptr()} & forward
    expect = e.make_free(placed)
    assert torch.equal(free.keys, expect.keys) and torch.equal(free.values, expect.values)

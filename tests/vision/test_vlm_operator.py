"""The operator on image chunks, per VLM family (tiny random configs loaded through from_pretrained):
placeholder counts, relocation against re-prefill at the target, survivors, full-rank patch, blind vs
patched KL, and one vision-tower run per distinct image."""

from __future__ import annotations

import sys

import pytest
import torch

from kamera_engine import KV, InvalidInputError
from kamera_engine.adapters.base import capture_pre_rope_keys
from kamera_engine.vision import VisionEngine
from kamera_engine.vision.mechanics import measure, noise_image


def _tok(engine: VisionEngine, token: str) -> int:
    return int(engine.tokenizer.convert_tokens_to_ids(token))


@pytest.mark.parametrize("size", [(60, 40), (100, 80), (150, 120)])
def test_processor_puts_the_right_number_of_placeholders(family_engine: VisionEngine, size) -> None:
    e = family_engine
    img = noise_image(7, size)
    entry = e.register_image(img, f"count-{size}")
    media = e.family.prepare_image(img)  # what the engine registered (it keeps no pixels once the tower has run)
    n = entry.rows
    assert n == media.num_features == int(e.vision_cache.get(entry.cache_key).embeds.shape[0])
    assert entry.grid == media.grid
    virtual = [t for t in entry.token_ids if t >= e.vocab_size]
    assert virtual == list(range(entry.base, entry.base + n))  # one virtual id per feature row
    fam = e.family.name
    if fam in ("qwen2_vl", "qwen3_vl"):
        t, h, w = media.grid
        assert n == t * h * w // 4  # the processor's rule: grid product / merge^2
        assert media.token_ids == [
            _tok(e, "<|vision_start|>"),
            *[_tok(e, "<|image_pad|>")] * n,
            _tok(e, "<|vision_end|>"),
        ]
        # the image processor's own grid for this size
        out = e.processor.image_processor(images=[img], return_tensors="pt")
        assert int(out["image_grid_thw"].prod()) // 4 == n
    elif fam == "llava":
        assert n == (42 // 14) ** 2  # CLIP patches of the 42x42 crop (class token dropped)
        assert media.token_ids == [int(e.model.config.image_token_id)] * n
        # transformers' LlavaProcessor expanded "<image>" to exactly the tower's rows
        out = e.processor(text="w1 <image> w2", images=[img], return_tensors="pt")
        assert int((out["input_ids"][0] == e.model.config.image_token_id).sum()) == n
    elif fam == "idefics3":
        out = e.processor(text="<image>", images=[[img]], return_tensors="pt")
        tiles = int(out["pixel_values"].shape[1])  # split tiles + the global view
        assert n == 4 * tiles  # image_seq_len per tile
        assert int((out["input_ids"][0] == e.model.config.image_token_id).sum()) == n
        if max(size) > 56:
            assert tiles > 1 and _tok(e, "<row_1_col_1>") in media.token_ids
    elif fam == "kimi_k25":
        # NaViT budget (8 x 8 patches of 14 px, never upscale), padded to the 2 x 2 merge grid
        w_, h_ = size
        scale = min(1.0, (64 / max(1, h_ // 14) / max(1, w_ // 14)) ** 0.5, 112 / h_, 112 / w_)
        nh, nw = min(int(h_ * scale), 112), min(int(w_ * scale), 112)
        gh, gw = -(-nh // 28) * 2, -(-nw // 28) * 2
        assert media.grid == (1, gh, gw) and n == gh * gw // 4
        head = [_tok(e, "<|media_begin|>"), _tok(e, "image"), _tok(e, "<|media_content|>")]
        assert media.token_ids == [*head, *[int(e.model.config.image_token_id)] * n, _tok(e, "<|media_end|>")]
    else:
        raise AssertionError(f"no placeholder check for {fam}")


def test_image_chunk_operator_mechanics(family_engine: VisionEngine) -> None:
    assert family_engine.context_length == 32768  # the language model's max_position_embeddings
    r = measure(family_engine)
    assert 30000 in r["relocation_max_abs_err"]  # the farthest placement fits that context
    for d, err in r["rotation_max_abs_err"].items():  # layer 0: the rotation alone, M-RoPE included
        assert err <= 1e-5, f"rotation to {d}: {err:.2e}"
    # every layer: also the prefill's own float32 drift with absolute position (as for text tokens)
    for d, err in r["relocation_max_abs_err"].items():
        assert err <= (1e-4 if d <= 4000 else 5e-4), f"relocation to {d}: {err:.2e}"
    for d, err in r["survivor_max_abs_err"].items():
        assert err <= (1e-4 if d <= 4000 else 5e-4), f"survivor shifted by {d}: {err:.2e}"
    assert r["full_rank_max_abs_err"] <= 1e-4
    assert r["blind_kl"] > 1e-5  # conditioning is visible on these weights
    assert abs(r["patch_kl"][32]) <= 1e-5  # rank 32 = every key feature of the tiny model: exact
    assert r["patch_kl"][4] < r["blind_kl"]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_relocation_is_exact_at_any_distance(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """M-RoPE: a relocated image chunk's keys equal, at every layer, the model's own rotation of the same
    pre-RoPE keys at the target's 3-axis positions, to float rounding at any distance (each frequency's
    float32 angle is taken on its own axis, as transformers does); values are untouched. Also from a
    placed source, on the serving path, and back to the position-free frame."""
    from tests.vision.conftest import vlm

    e = vlm(family, tmp_path_factory.getbasetemp() / "vlm")
    ids = e.register_image(noise_image(2), "exact-2").token_ids
    n = len(ids)
    _ = e.anchor_kv  # computed outside the capture
    with capture_pre_rope_keys(e.model) as pre:
        can = e.canonical(ids)
    assert can.deltas is not None and can.deltas.abs().sum() > 0
    rotary = e.adapter.rotary_module(e.model)
    module = sys.modules[type(e.model).__module__]

    def reference(start: int) -> list[torch.Tensor]:
        pos = e.family.position_ids(torch.arange(start, start + n), can.deltas)  # (3, 1, T)
        out = []
        for k in pre:
            cos, sin = rotary(k, pos)
            out.append(module.apply_rotary_pos_emb(k, k, cos, sin)[1][0, :, -n:].transpose(0, 1))  # (T, H, D)
        return out

    def worst(kv: KV, ref: list[torch.Tensor]) -> float:
        return max((kv.keys[layer] - r).abs().max().item() for layer, r in enumerate(ref))

    for d in (37, 1000, 4000, 30000):
        ref = reference(d)
        placed = e.apply(can, None, d, exact=True)
        assert worst(placed, ref) <= 1e-5, f"relocation to {d}: {worst(placed, ref):.2e}"
        assert torch.equal(placed.values, can.values) and torch.equal(placed.deltas, can.deltas)
        served = e.apply(can, None, d)  # the serving path (rotation in the KV dtype)
        assert worst(served, ref) <= 1e-5, f"served at {d}: {worst(served, ref):.2e}"
        moved = e.relocate(e.apply(can, None, 1234, exact=True), d)  # placed -> placed, one rotation
        assert worst(moved, ref) <= 1e-5, f"moved to {d}: {worst(moved, ref):.2e}"
        assert (e.make_free(placed).keys - can.keys).abs().max().item() <= 1e-5


def test_mrope_vision_tokens_take_3d_positions(family_engine: VisionEngine) -> None:
    """Vision tokens of M-RoPE families are placed on a 2-D grid: their deltas are not all zero, and the
    prefill with the deltas differs from one with plain 1-D positions (so the test above is not vacuous)."""
    e = family_engine
    entry = e.register_image(noise_image(3), "grid-3")
    if not e.family.mrope:
        assert entry.deltas is None
        return
    assert entry.deltas is not None and entry.deltas.abs().sum() > 0
    assert entry.grid is not None
    _t, h, w = entry.grid
    hh, ww = h // 2, w // 2
    # rows run over (h, w): height advances every ww rows, width cycles
    k = torch.arange(entry.rows)
    idx = k + 1  # position of row k in the chunk (after <|vision_start|>)
    assert torch.equal(entry.deltas[:, 1] + idx, 1 + k // ww)
    assert torch.equal(entry.deltas[:, 2] + idx, 1 + k % ww)
    assert hh * ww == entry.rows


def test_vision_tower_runs_once_per_distinct_image(family_engine: VisionEngine) -> None:
    e = family_engine
    runs = e.tower_runs
    a = e.register_image(noise_image(11), "img-11")
    b = e.register_image(noise_image(11), "img-11")  # same digest: no new run, same tokens
    assert a is b and e.tower_runs == runs + 1
    ids = e.anchor_ids + a.token_ids
    e.canonical(a.token_ids)
    e.forward(ids, None, 0, logits="none")
    assert e.tower_runs == runs + 1  # forwards read the embedding cache
    disk = e.vision_cache.stats.disk_hits
    e.vision_cache.clear_memory()  # out of memory, onto disk: the next use loads the rows back, no tower run
    e.forward(ids, None, 0, logits="none")
    assert e.tower_runs == runs + 1 and e.vision_cache.stats.disk_hits == disk + 1


def test_unknown_virtual_ids_are_refused(family_engine: VisionEngine) -> None:
    e = family_engine
    with pytest.raises(InvalidInputError, match="virtual"):
        e.forward([e.vocab_size + 10_000], None, 0)


def test_video_segment_relocates_exactly(family_engine: VisionEngine) -> None:
    e = family_engine
    frames = [noise_image(40 + i, (84, 56)) for i in range(3)]
    entry = e.register_video(frames, 2.0, "clip-0")
    assert entry.kind == "video" and entry.rows > 0
    anchor = e.anchor_ids
    can = e.canonical(entry.token_ids)
    for d in (19, 500):
        ref = e.forward(anchor + entry.token_ids, None, d, logits="none").kv.slice(
            len(anchor), len(anchor) + len(entry.token_ids)
        )
        got = e.apply(can, None, d + len(anchor), exact=True)
        err = max((got.keys - ref.keys).abs().max().item(), (got.values - ref.values).abs().max().item())
        assert err <= 1e-4, f"video segment at {d}: {err:.2e}"
    if e.family.name == "qwen2_vl":
        assert entry.grid is not None and entry.grid[0] == 2  # 3 frames padded to 4, temporal patch 2
        assert _tok(e, "<|video_pad|>") in e.family.prepare_video(frames, 2.0).token_ids
    blind = KV.cat([e.anchor_kv, e.apply(can, None, len(anchor))])
    assert len(blind) == len(anchor) + len(entry.token_ids)


def test_deepstack_rows_are_injected(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen3-VL: the cached features carry one row set per deepstack level, and the canonical of an image
    chunk depends on them from the first decoder layer's output on (layer 0 keys do not)."""
    from tests.vision.conftest import vlm

    e = vlm("qwen3_vl", tmp_path_factory.getbasetemp() / "vlm")
    entry = e.register_image(noise_image(21), "deep-21")
    feats = e.vision_cache.get(entry.cache_key)
    assert feats.deepstack is not None and feats.deepstack.shape[:2] == (2, entry.rows)
    ids = e.anchor_ids + entry.token_ids
    with_deep = e.forward(ids, None, 0, logits="none").kv
    original = e.family.forward_kwargs
    e.family.forward_kwargs = lambda *a: {}  # type: ignore[method-assign]
    try:
        without = e.forward(ids, None, 0, logits="none").kv
    finally:
        e.family.forward_kwargs = original  # type: ignore[method-assign]
    assert torch.equal(with_deep.keys[0], without.keys[0])
    assert (with_deep.keys[1] - without.keys[1]).abs().max() > 1e-3


def test_mla_relocation_rotates_only_the_rope_band(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Kimi-K2.5 (DeepSeek-V3 MLA): the cache holds the RoPE-free latent (key slot) and the decoupled k_pe
    band (value slot); relocation carries the latent byte for byte and rotates the band exactly."""
    from tests.vision.conftest import vlm

    e = vlm("kimi_k25", tmp_path_factory.getbasetemp() / "vlm")
    text = e.model.config.text_config
    assert (e.key_dim, e.value_dim, e.num_kv_heads) == (text.kv_lora_rank, text.qk_rope_head_dim, 1)
    entry = e.register_image(noise_image(31), "mla-31")
    can = e.canonical(entry.token_ids)
    for d in (40, 900):
        placed = e.apply(can, None, d, exact=True)
        assert torch.equal(placed.keys, can.keys)  # the latent carries no position
        assert (placed.values - can.values).abs().max() > 1e-3
        back = e.make_free(placed)
        assert (back.values - can.values).abs().max() <= 1e-6
    # the patch covers both channels: a full-rank patch reproduces latent and band of a conditioned chunk
    other = e.register_image(noise_image(32), "mla-32").token_ids
    ids = e.anchor_ids + other + entry.token_ids
    start = len(e.anchor_ids) + len(other)
    cond = e.forward(ids, None, 0, logits="none").kv.slice(start, len(ids))
    patch = e.form_patch(cond, can, rank=len(entry.token_ids))
    served = e.apply(can, patch, start, exact=True)
    assert (served.keys - cond.keys).abs().max() <= 1e-4 and (served.values - cond.values).abs().max() <= 1e-4
    assert (patch.k_u.abs().sum() > 0) and (patch.v_u.abs().sum() > 0)


def test_vision_cache_persists_across_engines(tmp_path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """With a cache directory, a second engine on the same weights reads the features from disk."""
    from kamera_engine.vision.mechanics import tiny_engine

    d = tmp_path_factory.getbasetemp() / "vlm-disk"
    first = tiny_engine("llava", str(d), cache_dir=tmp_path / "vc")
    a = first.register_image(noise_image(61), "disk-61")
    assert first.tower_runs == 1
    second = tiny_engine("llava", str(d), cache_dir=tmp_path / "vc")  # same checkpoint, same fingerprint
    assert second.fingerprint == first.fingerprint
    b = second.register_image(noise_image(61), "disk-61")
    assert second.tower_runs == 0 and second.vision_cache.stats.disk_hits == 1
    ids = second.anchor_ids + b.token_ids
    assert torch.equal(
        first.forward(first.anchor_ids + a.token_ids, None, 0).logits, second.forward(ids, None, 0).logits
    )


@pytest.mark.parametrize(
    ("family", "fps", "step"), [("qwen2_vl", 2.0, 1), ("qwen2_5_vl", 2.0, 2), ("qwen2_5_vl", 0.5, 8)]
)
def test_video_temporal_axis_follows_the_model(family: str, fps: float, step: int, tmp_path_factory) -> None:
    """Qwen2.5-VL scales the temporal axis by tokens_per_second * seconds per temporal patch (2 frames /
    fps); Qwen2-VL advances it by one per temporal patch. The chunk-relative offsets carry it, so a relocated
    video segment keeps it (and relocation shifts all three axes alike)."""
    from tests.vision.conftest import vlm

    e = vlm(family, tmp_path_factory.getbasetemp() / "vlm")
    entry = e.register_video([noise_image(80 + i, (84, 56)) for i in range(4)], fps, f"temporal-{fps}")
    assert entry.grid is not None
    t, h, w = entry.grid
    per_t = h * w // 4
    assert t == 2 and entry.rows == 2 * per_t
    temporal = entry.deltas[:, 0] + torch.arange(entry.rows) + 1  # chunk-relative temporal position
    assert torch.equal(temporal[:per_t], torch.ones(per_t, dtype=torch.long))
    assert torch.equal(temporal[per_t:], torch.full((per_t,), 1 + step, dtype=torch.long))
    can = e.canonical(entry.token_ids)
    ref = e.forward(e.anchor_ids + entry.token_ids, None, 250, logits="none").kv.slice(len(e.anchor_ids), None)
    got = e.apply(can, None, 250 + len(e.anchor_ids), exact=True)
    assert (got.keys - ref.keys).abs().max() <= 1e-4

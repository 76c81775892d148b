"""The forward runner takes the past as parts, copied once into a cache with room for the new tokens."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import transformers
from packaging.version import Version

from kamera_engine import KV, InvalidInputError, SamplingParams, UnsupportedModelError
from kamera_engine.kv import to_cache
from kamera_engine.runner import cache_keyword, call_with_cache
from tests.conftest import ANCHOR, TINY_COMMON, random_ids, tiny_engine


def _parts(engine, sizes: list[int]) -> tuple[list[KV], list[int]]:
    """A prefilled past cut into parts of ``sizes`` tokens (after the anchor), and its token ids."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (sum(sizes),), generator=gen).tolist()
    kv = KV.cat([engine.anchor_kv, engine.forward(ids, engine.anchor_kv, len(ANCHOR), logits="none").kv.to("cpu")])
    cuts, at = [], 0
    for n in [len(ANCHOR), *sizes]:
        cuts.append(kv.slice(at, at + n))
        at += n
    return cuts, ids


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_neox"])
def test_forward_over_parts_equals_forward_over_the_joined_past(family: str) -> None:
    engine = tiny_engine(family)
    parts, ids = _parts(engine, [7, 1, 12])
    new = [11, 12, 13, 14, 15]
    start = len(ANCHOR) + len(ids)
    joined = engine.forward(new, KV.cat(parts), start, logits="all")
    split = engine.forward(new, parts, start, logits="all")
    assert torch.equal(split.logits, joined.logits)
    assert torch.equal(split.kv.keys, joined.kv.keys) and torch.equal(split.kv.values, joined.kv.values)
    assert torch.equal(split.kv.positions, joined.kv.positions)


def test_the_cache_reserve_is_filled_in_place_then_grows() -> None:
    engine = tiny_engine("llama")
    parts, _ = _parts(engine, [4, 6])
    n = sum(len(p) for p in parts)
    cache = to_cache(parts, engine.model.config, reserve=3)
    layer = cache.layers[0]
    buffer = layer.keys.untyped_storage().data_ptr()
    assert layer.get_seq_length() == n
    k = torch.randn(1, layer.keys.shape[1], 3, layer.keys.shape[3])
    keys, _ = layer.update(k, k.clone())
    assert keys.untyped_storage().data_ptr() == buffer  # written into the reserve, nothing re-allocated
    assert torch.equal(keys[:, :, n:], k) and keys.shape[2] == n + 3
    before = keys
    more, _ = layer.update(k[:, :, :1], k[:, :, :1].clone())  # past the reserve: a new tensor
    assert more.shape[2] == n + 4 and more.untyped_storage().data_ptr() != buffer
    assert torch.equal(more[:, :, : n + 3], before)


def test_a_forwards_kv_is_a_copy_of_its_own() -> None:
    """``ForwardResult.kv`` never shares memory with the cache (or a window buffer lent to it): a window keeps
    views of it for its slots until it makes them position-free (``slots.FreeLater``)."""
    engine = tiny_engine("llama")
    parts, _ = _parts(engine, [4, 6])
    res = engine.forward([11, 12, 13], parts, len(ANCHOR) + 10, logits="last")
    own = {res.kv.keys.untyped_storage().data_ptr(), res.kv.values.untyped_storage().data_ptr()}
    lent = {t.untyped_storage().data_ptr() for layer in res.cache.layers for t in (layer.keys, layer.values)}
    lent |= {t.untyped_storage().data_ptr() for p in parts for t in (p.keys, p.values)}
    assert not own & lent


def test_decoding_after_a_forward_over_parts_matches_the_joined_past() -> None:
    engine = tiny_engine("llama")
    parts, ids = _parts(engine, [5, 9])
    start = len(ANCHOR) + len(ids)
    greedy = SamplingParams(max_new_tokens=5)
    assert list(engine.generate_ids(parts, [20, 21], start, greedy)) == list(
        engine.generate_ids(KV.cat(parts), [20, 21], start, greedy)
    )


def test_parts_whose_positions_sit_on_other_devices_join_on_the_first_parts() -> None:
    # a GPU's forward hands its positions out in host memory while ``KV.to`` moved the anchor's to the device
    # (``kamera bench gpu`` joined the two on an H200); the meta device stands in for the GPU here
    engine = tiny_engine("llama")
    head = engine.anchor_kv
    tail = engine.forward([5, 6, 7], head, len(ANCHOR), logits="none").kv.to("cpu")
    moved = KV(head.keys, head.values, head.positions.to("meta"))
    joined = KV.cat([moved, tail])
    assert joined.positions.device.type == "meta" and joined.positions.shape == (len(ANCHOR) + 3,)
    assert torch.equal(KV.cat([head, tail]).positions, torch.arange(len(ANCHOR) + 3))


def test_a_position_free_part_is_refused() -> None:
    engine = tiny_engine("llama")
    parts, ids = _parts(engine, [4])
    free = KV(parts[1].keys, parts[1].values, None)
    with pytest.raises(InvalidInputError, match="placed"):
        engine.forward([1, 2], [parts[0], free], len(ANCHOR) + len(ids))


def test_a_cropped_reserved_layer_grows_from_what_it_holds() -> None:
    engine = tiny_engine("llama")
    parts, _ = _parts(engine, [6])
    n = sum(len(p) for p in parts)
    cache = to_cache(parts, engine.model.config, reserve=4)
    cache.crop(-2)  # drop the last two tokens
    layer = cache.layers[0]
    k = torch.randn(1, layer.keys.shape[1], 1, layer.keys.shape[3])
    keys, _ = layer.update(k, k.clone())
    assert keys.shape[2] == n - 1
    assert torch.equal(keys[:, :, -1:], k)
    assert torch.equal(keys[0, :, : n - 2], KV.cat(parts).keys[0, : n - 2].transpose(0, 1))


def test_a_sliding_window_model_serves_windows_up_to_its_cache() -> None:
    import transformers as T

    from kamera_engine import Engine, UnsupportedModelError

    torch.manual_seed(0)
    cfg = T.MistralConfig(num_key_value_heads=2, sliding_window=32, **TINY_COMMON)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    e = Engine(model, None, anchor_ids=ANCHOR)
    ids = random_ids(31 - len(ANCHOR), seed=1)  # 31 tokens: all of them stay in the sliding cache
    kv = e.forward(ids, e.anchor_kv, len(ANCHOR), logits="none").kv
    assert len(kv) == len(ids)
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        e.forward([*ids, 5], e.anchor_kv, len(ANCHOR))  # 32: the cache would keep only 31


def test_forward_refuses_bad_ids_and_logits_clearly() -> None:
    e = tiny_engine("llama")
    with pytest.raises(InvalidInputError, match="out of range"):
        e.forward([1, 10**6], e.anchor_kv, len(ANCHOR))
    with pytest.raises(InvalidInputError, match="out of range"):
        e.canonical([-1, 2])
    with pytest.raises(InvalidInputError, match="logits must be one of"):
        e.forward([1, 2], e.anchor_kv, len(ANCHOR), logits="bogus")


def test_context_length_reads_the_config_and_its_rope_scaling() -> None:
    import transformers as T

    from kamera_engine import ContextLengthError, Engine

    def engine(**kw: object) -> Engine:
        torch.manual_seed(0)
        cfg = T.LlamaConfig(num_key_value_heads=2, **{**TINY_COMMON, **kw})
        model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
        return Engine(model, None, anchor_ids=ANCHOR)

    assert engine(max_position_embeddings=512).context_length == 512
    # yarn stating only the original length: factor x original, as the scaling extends it
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 1e4}
    e = engine(max_position_embeddings=512, rope_parameters=yarn)
    assert e.context_length == 2048
    e.forward(random_ids(2048, seed=1), None, 0, logits="none")  # the whole extended context is served
    with pytest.raises(ContextLengthError, match="2049 tokens exceed the model's context length of 2048"):
        e.forward(random_ids(2049, seed=1), None, 0, logits="none")
    # llama3 configs state the extended length themselves (here larger than factor x original)
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 1e4,
    }
    assert engine(max_position_embeddings=8192, rope_parameters=llama3).context_length == 8192


def _taking(keyword: str | None) -> torch.nn.Module:
    params = f", {keyword}=None" if keyword else ""
    body = f"{{'x': x, '{keyword}': {keyword}}}" if keyword else "{'x': x}"
    ns: dict[str, object] = {}
    exec(f"def forward(self, x{params}):\n    return {body}", ns)  # a distinct signature per class
    cls = type(f"Takes_{keyword}", (torch.nn.Module,), {"forward": ns["forward"]})
    return cls()


@pytest.mark.parametrize("keyword", ["cache", "past_key_values", "layer_past"])
def test_the_cache_goes_under_the_name_the_forward_takes(keyword: str) -> None:
    module = _taking(keyword)
    assert cache_keyword(type(module)) == keyword
    assert call_with_cache(module, "C", 1) == {"x": 1, keyword: "C"}


def test_a_forward_without_a_cache_argument_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="takes no cache argument"):
        call_with_cache(_taking(None), "C", 1)


def test_the_installed_transformers_gets_its_current_name() -> None:
    """``cache`` from 5.24 on (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    engine = tiny_engine("llama")
    current = Version(transformers.__version__) >= Version("5.24")
    assert cache_keyword(type(engine.model)) == ("cache" if current else "past_key_values")


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_no_forward_warns_about_a_deprecated_cache_argument(family: str) -> None:
    """Prefill, decode, compressed scoring and layer-by-layer recompute with every warning an error, and
    nothing logged about ``past_key_values`` by transformers."""
    from kamera_engine.compressed import AttentionStatsSpec
    from kamera_engine.selective import recompute_tokens

    engine = tiny_engine(family)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ids = random_ids(6, seed=4)
            res = engine.forward(ids, engine.anchor_kv, len(ANCHOR), logits="last")
            past = KV.cat([engine.anchor_kv, res.kv.to("cpu")])
            list(engine.generate_ids(past, [7, 8], len(past), SamplingParams(max_new_tokens=3)))
            pre = engine.prefill_with_stats(past, ANCHOR + ids, [7, 8], AttentionStatsSpec(), 2)
            engine.score_on(pre.kv, pre.logits, pre.next_position, [9, 10, 11])
            recompute_tokens(engine, past, ANCHOR + ids, torch.tensor([len(ANCHOR) + 1]))
    finally:
        hf_logger.removeHandler(handler)
    assert not [r for r in records if "past_key_values" in r.getMessage() or "deprecated" in r.getMessage()]

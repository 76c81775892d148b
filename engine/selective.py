"""Selective recompute: rerun chosen tokens, or chosen layers, of an assembled window in context.

The token-axis baselines start from the same relocated canonical KV as Kamera and recompute a subset of
tokens *in context*: each selected token runs through the layers attending to the whole window, and its
fresh K/V overwrite the cached ones. Two selections:

* fixed positions (MPIC-k: the first k tokens of every reused span), recomputed at every layer;
* KV deviation (CacheBlend): all candidate tokens run the layers before ``check_layer`` (their fresh K/V
  used for attention there but not stored), the ``ratio`` of candidates whose fresh key at
  ``check_layer`` deviates most from the cached key is kept, and only those continue; their K/V overwrite
  the cache from ``check_layer`` on.

Along the layer axis, ``reprefill_from_layer`` is the paper's partial re-prefill (appendices B-D: keep a
chunk's shallow layers, re-prefill the deep ones in context), measured by ``kamera bench operator``.

The layers are driven one by one with a cache object that scatters the selected rows into the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from .errors import InvalidInputError
from .kv import KV
from .runner import call_with_cache
from .scheduler import exclusive


class ScatterCache:
    """Per-layer window K/V (1, H, N, D); ``update`` writes the running tokens' rows at ``index``.

    Layers below ``persist_from`` substitute the fresh rows into a temporary copy (used for attention,
    not kept), layers from ``persist_from`` on write them into the window.
    """

    def __init__(self, kv: KV, index: torch.Tensor, persist_from: int) -> None:
        # (L, N, H, D) -> per layer (1, H, N, D)
        self.keys = [kv.keys[layer].transpose(0, 1).unsqueeze(0).clone() for layer in range(kv.num_layers)]
        self.values = [kv.values[layer].transpose(0, 1).unsqueeze(0).clone() for layer in range(kv.num_layers)]
        self.index = index
        self.persist_from = persist_from
        self.captured: dict[int, torch.Tensor] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object):
        self.captured[layer_idx] = key
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if layer_idx < self.persist_from:
            keys, values = keys.clone(), values.clone()
        keys[:, :, self.index] = key.to(keys.dtype)
        values[:, :, self.index] = value.to(values.dtype)
        return keys, values

    def to_kv(self, positions: torch.Tensor) -> KV:
        keys = torch.cat(self.keys).transpose(1, 2).contiguous()  # (L, H, N, D) -> (L, N, H, D)
        values = torch.cat(self.values).transpose(1, 2).contiguous()
        return KV(keys, values, positions)


@dataclass(slots=True)
class RecomputeResult:
    kv: KV  # the window with the selected tokens' K/V recomputed in context
    selected: torch.Tensor  # absolute positions that were recomputed (at ``check_layer`` and deeper)


def _mask(
    query_pos: torch.Tensor, n_keys: int, dtype: torch.dtype, *, isolate: tuple[int, torch.Tensor] | None = None
) -> torch.Tensor:
    """Additive causal mask (1, 1, q, N): a query attends to every key at or before its position.

    ``isolate=(anchor_len, span_start)``: a query also sees nothing between the anchor and the start of
    its own span (``span_start``: (q,) per query), as if its chunk followed the anchor alone.
    """
    keys = torch.arange(n_keys)
    allowed = keys[None, :] <= query_pos[:, None]  # (q, N)
    if isolate is not None:
        anchor_len, span_start = isolate
        allowed &= (keys[None, :] < anchor_len) | (keys[None, :] >= span_start[:, None])
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def recompute_tokens(
    engine: object,
    window: KV,
    token_ids: Sequence[int],
    candidates: torch.Tensor,
    *,
    ratio: float = 1.0,
    check_layer: int | None = None,
) -> RecomputeResult:
    """Recompute ``candidates`` (absolute positions) of ``window`` in context.

    window: placed KV of the whole window at positions 0..N-1 (anchor included); token_ids: the N
    token ids; ``check_layer=None`` recomputes every candidate at every layer; otherwise CacheBlend's
    selection of ``ratio`` of them by key deviation at ``check_layer``. Under a scheduler it runs between two
    of its steps (``scheduler.exclusive``), never beside one.
    """
    run = partial(_recompute_tokens, engine, window, token_ids, candidates, ratio=ratio, check_layer=check_layer)
    return exclusive(engine, run)


@torch.inference_mode()
def _recompute_tokens(
    engine: object,
    window: KV,
    token_ids: Sequence[int],
    candidates: torch.Tensor,
    *,
    ratio: float,
    check_layer: int | None,
) -> RecomputeResult:
    model = engine.model  # type: ignore[attr-defined]
    adapter = engine.adapter  # type: ignore[attr-defined]
    n = _check_window(window, token_ids, "selective recompute")
    if not 0.0 <= ratio <= 1.0:
        raise InvalidInputError(f"recompute ratio must be in [0, 1], got {ratio}")
    cand = torch.as_tensor(candidates, dtype=torch.long).sort().values
    layers = adapter.layers(model)
    if check_layer is not None and not 0 <= check_layer < len(layers):
        raise InvalidInputError(f"check_layer must be in [0, {len(layers)}), got {check_layer}")
    if cand.numel() == 0 or (check_layer is not None and round(ratio * cand.numel()) == 0):
        return RecomputeResult(window, cand[:0])
    device = next(model.parameters()).device
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    hidden = model.get_input_embeddings()(ids[cand].to(device))[None]  # (1, n, hidden)
    cache = ScatterCache(window.to(device), cand.to(device), persist_from=0 if check_layer is None else check_layer)
    rotary = adapter.rotary_module(model)
    pos = cand
    mask = _mask(pos, n, hidden.dtype).to(device)
    first = 0
    if check_layer is not None:
        for layer in range(check_layer):
            hidden = _run(layers[layer], hidden, pos, mask, cache, rotary, device)
        # probe the check layer with every candidate (not stored) to measure key deviation
        cache.persist_from = check_layer + 1
        _run(layers[check_layer], hidden, pos, mask, cache, rotary, device)
        fresh = cache.captured[check_layer][0]  # (H, n, D)
        cached = window.keys[check_layer][cand].transpose(0, 1).to(fresh.device)  # (n, H, D) -> (H, n, D)
        deviation = (fresh.float() - cached.float()).norm(dim=(0, 2))  # (n,)
        keep = max(1, round(ratio * cand.numel()))
        top = torch.topk(deviation, keep).indices.sort().values.cpu()
        pos = cand[top]
        mask = _mask(pos, n, hidden.dtype).to(device)
        hidden = hidden[:, top.to(device)]
        cache.index = pos.to(device)
        cache.persist_from = check_layer
        first = check_layer
    for layer in range(first, len(layers)):
        hidden = _run(layers[layer], hidden, pos, mask, cache, rotary, device)
    return RecomputeResult(cache.to_kv(torch.arange(n)), pos)


def reprefill_from_layer(
    engine: object, window: KV, token_ids: Sequence[int], spans: Sequence[range], from_layer: int, anchor_len: int
) -> KV:
    """Partial re-prefill: ``spans`` keep the K/V ``window`` holds for them (their relocated canonicals)
    in the layers below ``from_layer`` and are re-prefilled in context from ``from_layer`` on.

    Below ``from_layer`` a span's tokens replay their canonical's forward: they see only the anchor and
    their own span, rotated at the canonical's positions (right after the anchor), so ``from_layer``
    receives the chunk's context-free hidden state (and its K/V there are the canonical's); from there on
    they run at their window positions, attend to the whole window and overwrite their K/V. A serving
    path would store that hidden state at compile time and skip the shallow layers; this function runs
    them, to measure what skipping them costs in fidelity. ``from_layer=0`` is a re-prefill of the spans,
    ``from_layer`` = the number of layers changes nothing. window: placed at 0..N-1 (anchor included);
    token_ids: its N ids; spans: sorted, disjoint, behind the anchor. Returns the window with the spans'
    K/V replaced. Under a scheduler it runs between two of its steps (``scheduler.exclusive``).
    """
    run = partial(_reprefill_from_layer, engine, window, token_ids, spans, from_layer, anchor_len)
    return exclusive(engine, run)


@torch.inference_mode()
def _reprefill_from_layer(
    engine: object, window: KV, token_ids: Sequence[int], spans: Sequence[range], from_layer: int, anchor_len: int
) -> KV:
    model = engine.model  # type: ignore[attr-defined]
    adapter = engine.adapter  # type: ignore[attr-defined]
    layers = adapter.layers(model)
    n = _check_window(window, token_ids, "partial re-prefill")
    if not 0 <= from_layer <= len(layers):
        raise InvalidInputError(f"from_layer must be in [0, {len(layers)}], got {from_layer}")
    ordered = [s for s in spans if len(s)]
    if any(s.step != 1 for s in ordered):
        raise InvalidInputError("spans must be contiguous ranges")
    if anchor_len < 0:
        raise InvalidInputError(f"anchor_len must be >= 0, got {anchor_len}")
    bounds = [anchor_len] + [b for s in ordered for b in (s.start, s.stop)] + [n]
    if bounds != sorted(bounds):
        raise InvalidInputError(f"spans must be sorted, disjoint and inside [{anchor_len}, {n}), got {list(spans)}")
    if not ordered or from_layer == len(layers):
        return window
    pos = torch.cat([torch.arange(s.start, s.stop) for s in ordered])
    span_start = torch.cat([torch.full((len(s),), s.start) for s in ordered])
    canonical_pos = anchor_len + pos - span_start  # where each token sat in its canonical's forward
    device = next(model.parameters()).device
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    hidden = model.get_input_embeddings()(ids[pos].to(device))[None]  # (1, n_span, hidden)
    cache = ScatterCache(window.to(device), pos.to(device), persist_from=from_layer)
    rotary = adapter.rotary_module(model)
    isolated = _mask(pos, n, hidden.dtype, isolate=(anchor_len, span_start)).to(device)
    in_context = _mask(pos, n, hidden.dtype).to(device)
    for layer in range(len(layers)):
        if layer < from_layer:
            hidden = _run(layers[layer], hidden, canonical_pos, isolated, cache, rotary, device)
        else:
            hidden = _run(layers[layer], hidden, pos, in_context, cache, rotary, device)
    return cache.to_kv(torch.arange(n))


def _check_window(window: KV, token_ids: Sequence[int], what: str) -> int:
    """The window's length, after checking it is placed at 0..N-1 and has one token id per row."""
    n = len(window)
    if window.positions is None or not torch.equal(window.positions.cpu(), torch.arange(n)):
        raise InvalidInputError(f"{what} wants a window placed at positions 0..N-1")
    if len(token_ids) != n:
        raise InvalidInputError(f"need {n} token ids for the window, got {len(token_ids)}")
    return n


def _run(layer, hidden, pos, mask, cache, rotary, device):  # type: ignore[no-untyped-def]
    """One decoder layer over the running tokens, rotated at positions ``pos`` (``mask``: additive,
    (1, 1, q, N), over the window's rows)."""
    position_ids = pos[None].to(device)
    pe = rotary(hidden, position_ids)
    out = call_with_cache(
        layer,
        cache,
        hidden,
        attention_mask=mask,
        position_ids=position_ids,
        position_embeddings=pe,
        use_cache=True,
    )
    return out[0] if isinstance(out, tuple) else out

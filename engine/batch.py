"""Batched forwards: several independent requests in one model call, in a ragged (packed) layout.

Each request (a *row*) brings its own past KV, its own new token ids and its own explicit positions.
The rows' new tokens are packed into one sequence (no padding), so every weight GEMM of the model reads
its weights once for all rows; attention is the only part that must not mix rows, and it runs per row:
a registered transformers attention function slices the packed queries, keys and values by the rows'
cumulative lengths, appends each row's new keys and values to that row's own cache, and calls the
model's own attention implementation (SDPA on CPU) on exactly the shapes a single-request forward
would use. See ``docs/batching.md`` for why this layout and what it costs.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .errors import InvalidInputError
from .kv import KV, Past, past_parts

#: The attention implementation name a batched forward switches the model to for its duration.
ROWS_ATTENTION = "kamera_rows"


class RowCache:
    """One request's KV on the model's device: per layer ``(1, H, capacity, D)`` buffers, filled in place.

    A forward appends its new tokens in place while they fit and grows the buffer (one copy) when they
    do not; views handed to attention never outlive the forward. ``nbytes`` is what the row holds on
    the device, capacity included, which is what a memory budget must count.
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], filled: int) -> None:
        self._keys: list[torch.Tensor | None] = [k for k, _ in layers]
        self._values: list[torch.Tensor | None] = [v for _, v in layers]
        self._filled = [filled] * len(layers)
        self._reserve = 0  # room a first allocation makes (a row that starts empty)

    @classmethod
    def from_past(
        cls, past: Past, num_layers: int, *, reserve: int = 0, device: torch.device | str | None = None
    ) -> RowCache:
        """A row over ``past`` (a placed KV or its parts in order), copied once, with room for ``reserve``
        more tokens. An empty past allocates on the first forward."""
        parts = past_parts(past)
        if not parts:
            return _empty(num_layers, reserve)
        n = sum(len(p) for p in parts)
        first = parts[0]
        dev = first.keys.device if device is None else torch.device(device)
        layers = []
        for layer in range(first.num_layers):
            k = torch.empty(
                1, first.keys.shape[2], n + reserve, first.keys.shape[3], dtype=first.keys.dtype, device=dev
            )
            v = torch.empty(
                1, first.values.shape[2], n + reserve, first.values.shape[3], dtype=first.values.dtype, device=dev
            )
            at = 0
            for p in parts:
                k[0, :, at : at + len(p)].copy_(p.keys[layer].transpose(0, 1))
                v[0, :, at : at + len(p)].copy_(p.values[layer].transpose(0, 1))
                at += len(p)
            layers.append((k, v))
        return cls(layers, n)

    @classmethod
    def from_layers(cls, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], *, reserve: int = 0) -> RowCache:
        """A row over per-layer ``(1, H, T, D)`` keys and values (a transformers cache's layout), copied once
        with room for ``reserve`` more tokens."""
        if not layers:
            raise InvalidInputError("a row needs at least one layer")
        n = int(layers[0][0].shape[2])
        out = []
        for k, v in layers:
            kk = k.new_empty(1, k.shape[1], n + reserve, k.shape[3])
            vv = v.new_empty(1, v.shape[1], n + reserve, v.shape[3])
            kk[:, :, :n].copy_(k)
            vv[:, :, :n].copy_(v)
            out.append((kk, vv))
        return cls(out, n)

    def __len__(self) -> int:
        return self._filled[-1] if self._filled else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._keys, *self._values) if t is not None)

    def mark(self) -> list[int]:
        """The fill of every layer (to roll back a forward that failed part-way)."""
        return list(self._filled)

    def rollback(self, mark: list[int]) -> None:
        self._filled = list(mark)

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``(1, H, n, D)`` new keys and values after the layer's fill; the layer's keys and values so far."""
        n, at = int(keys.shape[2]), self._filled[layer]
        buf_k, buf_v = self._keys[layer], self._values[layer]
        if buf_k is None or at + n > buf_k.shape[2]:
            room = max(at + n, self._reserve) if buf_k is None else 2 * (at + n)
            new_k = keys.new_empty(1, keys.shape[1], room, keys.shape[3])
            new_v = values.new_empty(1, values.shape[1], room, values.shape[3])
            if buf_k is not None and at:
                new_k[:, :, :at].copy_(buf_k[:, :, :at])
                new_v[:, :, :at].copy_(buf_v[:, :, :at])  # type: ignore[index]
            self._keys[layer], self._values[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, :, at : at + n].copy_(keys)
        buf_v[:, :, at : at + n].copy_(values)  # type: ignore[index]
        self._filled[layer] = at + n
        return buf_k[:, :, : at + n], buf_v[:, :, : at + n]  # type: ignore[index]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(1, H, T, D)`` views of what the row holds."""
        return [(k[:, :, :n], v[:, :, :n]) for k, v, n in zip(self._keys, self._values, self._filled, strict=True)]

    def kv(self, start: int, stop: int, positions: torch.Tensor | None) -> KV:
        """Tokens ``[start, stop)`` as a placed ``KV`` (``(L, T, H, D)``, copied)."""
        keys = torch.stack([k[0, :, start:stop] for k, _ in self.layers()]).transpose(1, 2).contiguous()
        values = torch.stack([v[0, :, start:stop] for _, v in self.layers()]).transpose(1, 2).contiguous()
        return KV(keys, values, positions)


def _empty(num_layers: int, reserve: int) -> RowCache:
    cache = RowCache([], 0)
    cache._keys = [None] * num_layers
    cache._values = [None] * num_layers
    cache._filled = [0] * num_layers
    cache._reserve = reserve
    return cache


@dataclass(slots=True)
class Row:
    """One request's part of a batched forward: new ``ids`` (N,) at ``positions`` (N,) after ``cache``."""

    cache: RowCache
    ids: torch.Tensor
    positions: torch.Tensor
    logits: str = "last"  # "last", "all" or "none"

    def __post_init__(self) -> None:
        if self.ids.ndim != 1 or self.ids.numel() == 0:
            raise InvalidInputError(f"a row's ids must be a non-empty 1-D tensor, got shape {tuple(self.ids.shape)}")
        if self.positions.shape != self.ids.shape:
            raise InvalidInputError(f"positions {tuple(self.positions.shape)} != ids {tuple(self.ids.shape)}")
        if self.logits not in ("last", "all", "none"):
            raise InvalidInputError(f"logits must be 'last', 'all' or 'none', got {self.logits!r}")

    @classmethod
    def at(cls, cache: RowCache, ids: Sequence[int] | torch.Tensor, start: int, logits: str = "last") -> Row:
        """A row whose tokens sit at ``start, start+1, ...``."""
        t = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        return cls(cache, t, torch.arange(start, start + t.numel(), dtype=torch.long), logits)


@dataclass(slots=True)
class _Rows:
    """What the attention function needs to split a packed forward into its rows."""

    caches: list[RowCache]
    spans: list[tuple[int, int]]  # [a, b) of each row in the packed sequence
    base: str  # the model's own attention implementation
    masks: dict[tuple[int, int, str], torch.Tensor | None] = field(default_factory=dict)


_local = threading.local()


def _row_mask(past: int, n: int, base: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask a single-request forward over ``past`` tokens would get (None where it gets none)."""
    if base.startswith("flash") or n == 1 or past == 0:
        return None  # decode, or a causal run from the start: SDPA's is_causal / flash's causal flag
    q = torch.arange(n, device=device)[:, None] + past
    k = torch.arange(past + n, device=device)[None, :]
    allowed = (k <= q)[None, None]
    if base == "eager":  # an additive mask
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


def _base_attention(module: nn.Module, base: str) -> Any:
    if base == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(base, None)


def _rows_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a packed batch: per row, its new keys and values join the row's cache and its queries
    attend to that row alone, through the model's own implementation."""
    rows: _Rows | None = getattr(_local, "rows", None)
    if rows is None:  # a forward on another path while the name is set: behave as SDPA would
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    fn = _base_attention(module, rows.base)
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    outs = []
    for cache, (a, b) in zip(rows.caches, rows.spans, strict=True):
        past = cache._filled[layer]
        k_all, v_all = cache.append(layer, key[:, :, a:b], value[:, :, a:b])
        mask_key = (past, b - a, str(query.device))
        if mask_key not in rows.masks:
            rows.masks[mask_key] = _row_mask(past, b - a, rows.base, query.device, query.dtype)
        out, _ = fn(module, query[:, :, a:b], k_all, v_all, rows.masks[mask_key], **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


ALL_ATTENTION_FUNCTIONS.register(ROWS_ATTENTION, _rows_attention)
# a single-request forward that meets the name (another thread) still gets SDPA's mask
ALL_MASK_ATTENTION_FUNCTIONS.register(ROWS_ATTENTION, sdpa_mask)

_switch = threading.Lock()


@contextmanager
def _rows_attention_on(model: nn.Module, rows: _Rows) -> Iterator[None]:
    config = model.config
    with _switch:
        config._attn_implementation = ROWS_ATTENTION
        _local.rows = rows
        try:
            yield
        finally:
            _local.rows = None
            config._attn_implementation = rows.base


@torch.inference_mode()
def batched_forward(model: nn.Module, rows: Sequence[Row]) -> list[torch.Tensor | None]:
    """Run every row's new tokens after its own cache in one model call; the caches grow in place.

    Returns per row its logits as float32: ``(vocab,)`` for ``"last"``, ``(N, vocab)`` for ``"all"``,
    None for ``"none"``. A forward that raises leaves every row's cache as it was.
    """
    if not rows:
        return []
    base = str(getattr(model.config, "_attn_implementation", None) or "sdpa")
    if base == ROWS_ATTENTION:
        raise InvalidInputError("batched forwards do not nest")
    device = next(model.parameters()).device
    spans, at = [], 0
    for row in rows:
        spans.append((at, at + int(row.ids.numel())))
        at += int(row.ids.numel())
    keep: list[int] = []
    for row, (a, b) in zip(rows, spans, strict=True):
        if row.logits == "all":
            keep.extend(range(a, b))
        elif row.logits == "last":
            keep.append(b - 1)
    ids = torch.cat([r.ids for r in rows]).to(device)[None]
    positions = torch.cat([r.positions for r in rows]).to(device)[None]
    marks = [r.cache.mark() for r in rows]
    state = _Rows([r.cache for r in rows], spans, base)
    try:
        with _rows_attention_on(model, state):
            out = model(
                input_ids=ids,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=torch.tensor(keep or [at - 1], dtype=torch.long, device=device),
            )
    except BaseException:
        for row, mark in zip(rows, marks, strict=True):
            row.cache.rollback(mark)
        raise
    logits = out.logits[0].float()
    result: list[torch.Tensor | None] = []
    i = 0
    for row, (a, b) in zip(rows, spans, strict=True):
        if row.logits == "all":
            result.append(logits[i : i + b - a])
            i += b - a
        elif row.logits == "last":
            result.append(logits[i])
            i += 1
        else:
            result.append(None)
    return result

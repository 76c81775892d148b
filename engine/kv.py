"""The KV container the engine and the SDK pass around.

Layout is token-major and stacked over layers: ``keys (L, T, H, Dk)``, ``values (L, T, H, Dv)``.
Token-major makes chunk concatenation and slicing a single ``cat``/view over all layers, and lets the
rank-m patch be one batched GEMM over ``(L, T, H * D)``. transformers' caches are ``(B, H, T, D)`` per
layer; :func:`to_cache` / :func:`KV.from_cache` convert at the boundary.

``positions`` says which frame the keys are in: ``None`` = position-free (every key rotated to angle 0,
what Kamera stores), otherwise the (T,) absolute positions the keys are rotated to.

``deltas`` (M-RoPE vision tokens only) is a property of the tokens, not of the frame: per token, its
(t, h, w) position minus its linear position. A token at linear position ``p`` sits at ``p + delta`` on
each axis, so placing it needs the deltas; they travel with the KV through slice, cat, clone and ``to``
(``None``: every delta is 0, as for text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .errors import InvalidInputError


@dataclass(slots=True)
class KV:
    """Keys and values of a run of tokens, all layers stacked."""

    keys: torch.Tensor  # (L, T, H, Dk)
    values: torch.Tensor  # (L, T, H, Dv)
    positions: torch.Tensor | None = None  # (T,) long, or None when position-free
    deltas: torch.Tensor | None = None  # (T, 3) long: M-RoPE axis offsets per token, or None (all 0)

    def __post_init__(self) -> None:
        if self.keys.ndim != 4 or self.values.ndim != 4:
            raise InvalidInputError(
                f"KV wants (L, T, H, D) tensors, got keys {tuple(self.keys.shape)}, values {tuple(self.values.shape)}"
            )
        if self.keys.shape[:3] != self.values.shape[:3]:
            raise InvalidInputError(
                f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} disagree on (L, T, H)"
            )
        if self.positions is not None and self.positions.shape != (self.keys.shape[1],):
            raise InvalidInputError(f"positions shape {tuple(self.positions.shape)} != ({self.keys.shape[1]},)")
        if self.deltas is not None and self.deltas.shape != (self.keys.shape[1], 3):
            raise InvalidInputError(f"deltas shape {tuple(self.deltas.shape)} != ({self.keys.shape[1]}, 3)")

    def __len__(self) -> int:
        return int(self.keys.shape[1])

    @property
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    @property
    def is_free(self) -> bool:
        return self.positions is None

    def slice(self, start: int, stop: int) -> KV:
        """Tokens ``[start, stop)`` as views (no copy)."""
        pos = None if self.positions is None else self.positions[start:stop]
        deltas = None if self.deltas is None else self.deltas[start:stop]
        return KV(self.keys[:, start:stop], self.values[:, start:stop], pos, deltas)

    def clone(self) -> KV:
        pos = None if self.positions is None else self.positions.clone()
        deltas = None if self.deltas is None else self.deltas.clone()
        return KV(self.keys.clone(), self.values.clone(), pos, deltas)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KV:
        pos = None if self.positions is None else self.positions.to(device) if device else self.positions
        deltas = None if self.deltas is None else self.deltas.to(device) if device else self.deltas
        return KV(self.keys.to(device=device, dtype=dtype), self.values.to(device=device, dtype=dtype), pos, deltas)

    @staticmethod
    def cat(parts: Sequence[KV]) -> KV:
        """Concatenate placed KVs along tokens (one copy over all layers)."""
        if not parts:
            raise InvalidInputError("KV.cat needs at least one part")
        if any(p.positions is None for p in parts) and not all(p.positions is None for p in parts):
            raise InvalidInputError("cannot concatenate placed and position-free KV")
        keys = torch.cat([p.keys for p in parts], dim=1)
        values = torch.cat([p.values for p in parts], dim=1)
        # positions are bookkeeping beside the tensors: a forward hands its own out in host memory while a part
        # moved to a GPU (``to``) carries them there, so they are joined on the first part's device
        first = parts[0].positions
        pos = None if first is None else torch.cat([p.positions.to(first.device) for p in parts])  # type: ignore[union-attr]
        deltas = None
        ref = next((p.deltas for p in parts if p.deltas is not None), None)
        if ref is not None:  # parts without deltas (text) carry zeros
            deltas = torch.cat(
                [ref.new_zeros(len(p), 3) if p.deltas is None else p.deltas.to(ref.device) for p in parts]
            )
        return KV(keys, values, pos, deltas)

    @staticmethod
    def from_cache(
        cache: DynamicCache, start: int, stop: int, positions: torch.Tensor | None, deltas: torch.Tensor | None = None
    ) -> KV:
        """Tokens ``[start, stop)`` of a transformers cache (batch 0), as a placed KV (with the tokens'
        M-RoPE ``deltas``, if any)."""
        keys = torch.stack([layer.keys[0, :, start:stop] for layer in cache.layers])  # (L, H, T, D)
        values = torch.stack([layer.values[0, :, start:stop] for layer in cache.layers])
        # (L, H, T, D) -> (L, T, H, D)
        return KV(keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous(), positions, deltas)


Past = KV | Sequence[KV] | None  # what a forward runs after: one placed KV, or its parts in order


def past_parts(past: Past, *, placed: bool = True) -> list[KV]:
    """The non-empty parts of ``past`` in order; with ``placed``, every part must carry positions."""
    parts = [] if past is None else [past] if isinstance(past, KV) else list(past)
    if placed and any(p.positions is None for p in parts):
        raise InvalidInputError("past KV must be placed (positions set), not position-free")
    return [p for p in parts if len(p)]


class _ReservedLayer(DynamicLayer):
    """A cache layer whose buffer already has room for the tokens about to be prefilled.

    transformers' ``DynamicLayer`` grows by ``torch.cat`` on every update: a forward over a long past
    copies the whole past once more per layer. Here the past is written once into a buffer sized for
    past + reserve, the forward's update writes the new tokens in place, and an update past the
    reserve falls back to growing by concatenation (a new tensor: views handed out earlier never
    change).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
        super().__init__()
        self._k, self._v, self._n = keys, values, filled
        self.dtype, self.device = keys.dtype, keys.device
        self.keys, self.values = keys[:, :, :filled], values[:, :, :filled]
        self.is_initialized = True

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        ours = self._k is not None and self.keys is not None and self.keys.data_ptr() == self._k.data_ptr()
        if not ours or self.keys.shape[-2] != self._n or self._n + n > self._k.shape[-2]:
            # beyond the reserve, or the layer was edited behind our back (crop, ...): grow like DynamicLayer
            self._k = self._v = None
            return super().update(key_states, value_states, *args, **kwargs)
        self._k[:, :, self._n : self._n + n].copy_(key_states)
        self._v[:, :, self._n : self._n + n].copy_(value_states)
        self._n += n
        self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]
        return self.keys, self.values


def drop_tokens(cache: DynamicCache, rows: Sequence[int] | None) -> None:
    """Drop cache rows ``rows`` (token indices) from every layer and head of ``cache``, in place: the one
    edit a decode-time eviction makes to a transformers cache. Rows outside the cache are refused before
    any layer changes."""
    if not rows or not cache.layers:
        return
    n = int(cache.layers[0].keys.shape[-2])
    bad = [r for r in rows if not -n <= r < n]
    if bad:
        raise InvalidInputError(f"cannot drop cache rows {bad[:5]}: the cache holds {n} tokens")
    keep = torch.ones(n, dtype=torch.bool)
    keep[list(rows)] = False
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, keep]
        layer.values = layer.values[:, :, keep]


def to_cache(past: Past, config: Any, *, reserve: int = 0, device: torch.device | str | None = None) -> DynamicCache:
    """A transformers ``DynamicCache`` holding ``past`` (one KV or its parts, in order; empty when None).

    The parts are copied once, straight into the cache's (1, H, T, D) layout on ``device`` (default: the
    parts' own). ``reserve``: room for that many more tokens, written in place by the next forward, so
    appending does not copy the past again (layers of the model's own kind, e.g. sliding, get none).
    """
    cache = DynamicCache(config=config)
    parts = past_parts(past, placed=False)
    if not parts:
        return cache
    n = sum(len(p) for p in parts)
    first = parts[0]
    dev = first.keys.device if device is None else torch.device(device)
    for layer in range(first.num_layers):
        reserved = layer < len(cache.layers) and type(cache.layers[layer]) is DynamicLayer
        room = n + (reserve if reserved else 0)
        k = torch.empty(1, first.keys.shape[2], room, first.keys.shape[3], dtype=first.keys.dtype, device=dev)
        v = torch.empty(1, first.values.shape[2], room, first.values.shape[3], dtype=first.values.dtype, device=dev)
        at = 0
        for p in parts:
            k[0, :, at : at + len(p)].copy_(p.keys[layer].transpose(0, 1))
            v[0, :, at : at + len(p)].copy_(p.values[layer].transpose(0, 1))
            at += len(p)
        if reserved:
            cache.layers[layer] = _ReservedLayer(k, v, n)
        else:  # a layer type of the model's own (sliding, ...): let it take the tokens its way
            cache.update(k, v, layer)
    return cache


def reserved_cache(
    keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], filled: int, config: Any
) -> DynamicCache | None:
    """A transformers cache over existing per-layer ``(1, H, rows, D)`` tensors (any strides), read and
    written in place: the first ``filled`` rows are the past, the rest is room the next forward writes
    its tokens into (growing past it by concatenation, as :func:`to_cache`'s reserve does). None when
    the model's cache has layers of its own kind (sliding, ...), which take their tokens their own way."""
    cache = DynamicCache(config=config)
    if len(cache.layers) != len(keys) or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.layers[i] = _ReservedLayer(k, v, filled)
    return cache

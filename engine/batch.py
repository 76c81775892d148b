"""Batched forwards: several independent requests in one model call, in a ragged (packed) layout.

Each request (a *row*) brings its own past KV, its own new token ids and its own explicit positions.
The rows' new tokens are packed into one sequence (no padding between rows; on a CPU with BLAS's linears a
short step may get one filler token at the end, ``packed_length``), so every weight GEMM of the model reads
its weights once for all rows; attention is the only part that must not mix rows. A registered transformers
attention function splits it by the rows' cumulative lengths:

* decode rows (one new token each) whose caches live in one :class:`DecodeSlab` (their KV side by side
  in per-layer ``(S, H, C, D)`` buffers) write their new keys and values in place and attend in **one**
  call of the model's attention over the slab, a per-row length mask hiding each row's padding;
* every other row (a prompt chunk, a window's page, a decode row outside a slab) appends to its own
  cache and runs the model's own attention on exactly the shapes a single-request forward would use (on a
  CPU with SDPA, a masked row calls SDPA itself with grouped heads: the same result, bit for bit, without
  the model's function repeating the key and value heads).

A forward of a few hundred tokens on a CPU runs its small kernels inline and its linears and attention on the
thread pool (:func:`inlines_small_kernels`, ``threads.small_kernels_inline``).

See ``docs/batching.md`` for why this layout and what it costs.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .errors import InvalidInputError
from .kv import KV, Past, past_parts
from .packed_linear import runs_onednn
from .threads import pooled, small_kernels_inline

#: The attention implementation name a batched forward switches the model to for its duration.
ROWS_ATTENTION = "kamera_rows"


class RowCache:
    """One request's KV on the model's device: per layer ``(1, H, capacity, D)`` buffers, filled in place.

    A forward appends its new tokens in place while they fit and grows the buffer (one copy) when they
    do not; views handed to attention never outlive the forward. ``nbytes`` is what the row holds on
    the device, capacity included, which is what a memory budget must count. A row admitted to a
    :class:`DecodeSlab` keeps its buffers there (views of its slot) until it is released.
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], filled: int) -> None:
        self._keys: list[torch.Tensor | None] = [k for k, _ in layers]
        self._values: list[torch.Tensor | None] = [v for _, v in layers]
        self._filled = [filled] * len(layers)
        self._reserve = 0  # room a first allocation makes (a row that starts empty)
        self._slab: DecodeSlab | None = None  # the slab whose slot ``_slot`` holds this row's buffers, if any
        self._slot = -1

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
    def borrowing(cls, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> RowCache:
        """A row over per-layer ``(1, H, T, D)`` keys and values as they are, nothing copied, to be admitted to a
        :class:`DecodeSlab` (which copies it into a slot). The row is exactly full, so a forward on it copies
        it into buffers of its own before writing: the lender's tensors are only ever read."""
        if not layers:
            raise InvalidInputError("a row needs at least one layer")
        n = int(layers[0][0].shape[2])
        if any(int(k.shape[2]) != n or int(v.shape[2]) != n for k, v in layers):
            raise InvalidInputError("a borrowed row's layers must all hold the same number of tokens")
        return cls(list(layers), n)

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

    @property
    def slab(self) -> DecodeSlab | None:
        """The decode slab holding this row's KV, if it was admitted to one."""
        return self._slab

    @property
    def slot(self) -> int:
        """The row's slot in its decode slab (-1 outside one)."""
        return self._slot

    def mark(self) -> list[int]:
        """The fill of every layer (to roll back a forward that failed part-way)."""
        return list(self._filled)

    def rollback(self, mark: list[int]) -> None:
        self._filled = list(mark)

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``(1, H, n, D)`` new keys and values after the layer's fill; the layer's keys and values so far."""
        n, at = int(keys.shape[2]), self._filled[layer]
        if self._slab is not None and at + n > self._slab.capacity:
            self._slab.reserve(at + n)  # the slab grows for every row (its buffers are views of it)
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


class DecodeSlab:
    """Decode rows' KV side by side, so one attention call serves every decode row of a step.

    Per layer one ``(S, H, C, D)`` key buffer and one value buffer (zero-filled, so padding is finite);
    an admitted row's ``RowCache`` buffers become views of its slot, and a forward's appends land in
    the slab in place. Rows hold slots ``0 .. n-1`` (a leaving row's slot is taken by the last row), so a
    step over every resident reads the slab's first ``n`` slots without a copy. A row joins with one
    copy of its KV (``admit``) and a leaving row moves at most one other row (``release``). ``S`` and
    ``C`` grow geometrically; an empty slab frees its buffers. ``nbytes`` is what the slab holds,
    padding included: what a memory budget must count for its rows.
    """

    def __init__(self) -> None:
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._rows: list[RowCache] = []

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def slots(self) -> int:
        return int(self._keys[0].shape[0]) if self._keys else 0

    @property
    def capacity(self) -> int:
        return int(self._keys[0].shape[2]) if self._keys else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._keys, *self._values))

    def nbytes_with(self, cache: RowCache, capacity: int) -> int:
        """What the slab would hold after ``admit(cache, capacity)``."""
        slots, cap = self._grown(len(self._rows) + 1, max(capacity, len(cache)))
        per_token = sum(
            t.shape[1] * t.shape[3] * t.element_size() for t in (*cache._keys, *cache._values) if t is not None
        )
        return slots * cap * per_token

    def _grown(self, rows: int, capacity: int) -> tuple[int, int]:
        slots = self.slots if rows <= self.slots else max(rows, 2 * self.slots, 4)
        cap = self.capacity
        if capacity > cap:
            cap = -(-max(capacity, cap + cap // 4) // 64) * 64  # a quarter more, in steps of 64 tokens
        return slots, cap

    def admit(self, cache: RowCache, capacity: int) -> None:
        """Move ``cache``'s KV into a slot with room for ``capacity`` tokens (one copy); the cache now
        reads and writes the slab."""
        if cache._slab is not None:
            raise InvalidInputError("the row is already in a decode slab")
        if not cache._keys or any(k is None for k in cache._keys):
            raise InvalidInputError("an empty row cannot join a decode slab (prefill it first)")
        if self._rows and not self._compatible(cache):
            raise InvalidInputError("the row's KV shapes, dtype or device differ from the slab's rows")
        self._resize(*self._grown(len(self._rows) + 1, max(capacity, max(cache._filled))), like=cache)
        slot = len(self._rows)
        for layer, (k, v) in enumerate(zip(cache._keys, cache._values, strict=True)):
            n = cache._filled[layer]
            self._keys[layer][slot, :, :n].copy_(k[0, :, :n])  # type: ignore[index]
            self._values[layer][slot, :, :n].copy_(v[0, :, :n])  # type: ignore[index]
        self._rows.append(cache)
        cache._slab, cache._slot = self, slot
        self._point(cache)

    def release(self, cache: RowCache, *, keep: bool = False) -> None:
        """Take ``cache`` out of the slab; the last row moves into its slot. ``keep``: the cache gets its KV
        back in buffers of its own (one copy); otherwise it is left empty (a finished request's row)."""
        if cache._slab is not self:
            return
        slot = cache._slot
        if keep:
            own = RowCache.from_layers(cache.layers())
            cache._keys, cache._values = own._keys, own._values
        else:
            cache._keys = [None] * len(cache._keys)
            cache._values = [None] * len(cache._values)
            cache._filled = [0] * len(cache._filled)
        cache._slab, cache._slot = None, -1
        last = self._rows.pop()
        if last is not cache:
            self._rows[slot] = last
            for layer, n in enumerate(last._filled):
                self._keys[layer][slot, :, :n].copy_(self._keys[layer][last._slot, :, :n])
                self._values[layer][slot, :, :n].copy_(self._values[layer][last._slot, :, :n])
            last._slot = slot
            self._point(last)
        if not self._rows:
            self._keys, self._values = [], []

    def reserve(self, capacity: int) -> None:
        """Room for ``capacity`` tokens in every slot (a row outgrowing the slab grows it for all)."""
        if self._rows and capacity > self.capacity:
            self._resize(self.slots, self._grown(len(self._rows), capacity)[1])

    def _compatible(self, cache: RowCache) -> bool:
        for mine, theirs in zip((*self._keys, *self._values), (*cache._keys, *cache._values), strict=True):
            assert theirs is not None
            if (mine.shape[1], mine.shape[3], mine.dtype, mine.device) != (
                theirs.shape[1],
                theirs.shape[3],
                theirs.dtype,
                theirs.device,
            ):
                return False
        return len(cache._keys) == len(self._keys)

    def _resize(self, slots: int, cap: int, *, like: RowCache | None = None) -> None:
        if self._keys and (slots, cap) == (self.slots, self.capacity):
            return
        if not self._keys:
            assert like is not None
            src_k, src_v = like._keys, like._values
            self._keys = [k.new_zeros(slots, k.shape[1], cap, k.shape[3]) for k in src_k]  # type: ignore[union-attr]
            self._values = [v.new_zeros(slots, v.shape[1], cap, v.shape[3]) for v in src_v]  # type: ignore[union-attr]
            return
        old_slots, old_cap = self.slots, self.capacity
        for bufs in (self._keys, self._values):
            for layer, old in enumerate(bufs):
                # the old slab copied over, everything else zero (masked keys and values must stay finite)
                new = old.new_empty(slots, old.shape[1], cap, old.shape[3])
                new[:old_slots, :, :old_cap].copy_(old)
                new[:old_slots, :, old_cap:].zero_()
                new[old_slots:].zero_()
                bufs[layer] = new
        for row in self._rows:
            self._point(row)

    def _point(self, cache: RowCache) -> None:
        s = cache._slot
        cache._keys = [k[s : s + 1] for k in self._keys]
        cache._values = [v[s : s + 1] for v in self._values]


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
class _Together:
    """Decode rows attended in one call: their row indices, slots and packed positions, in slot order, and what
    every layer of the forward shares (their lengths before it, the mask)."""

    slab: DecodeSlab
    members: list[int]  # indices into the forward's rows
    slots: torch.Tensor  # (B,) long
    at: torch.Tensor  # (B,) each row's token in the packed sequence
    in_place: bool  # slots are 0..B-1: the slab's first B slots are read as they lie
    pasts: list[int]  # each row's length before this forward (the same in every layer)
    where: torch.Tensor  # (B,) long: ``pasts``, where each row's new key and value go
    first: int | None  # the rows' tokens sit at ``first .. first+B-1`` in the packed sequence: slices, no gathers
    masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # additive, per score dtype


@dataclass(slots=True)
class _Rows:
    """What the attention function needs to split a packed forward into its rows."""

    caches: list[RowCache]
    spans: list[tuple[int, int]]  # [a, b) of each row in the packed sequence
    base: str  # the model's own attention implementation
    together: _Together | None = None
    padding: int = 0  # filler tokens after the last row (``packed_length``): they attend to nothing
    masks: dict[tuple[int, int, str, torch.dtype, bool], torch.Tensor | None] = field(default_factory=dict)


_local = threading.local()


def _row_mask(past: int, n: int, base: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask a single-request forward over ``past`` tokens would get (None where it gets none)."""
    if base.startswith("flash") or n == 1 or (past == 0 and base != "eager"):
        return None  # decode, or a causal run from the start: SDPA's is_causal / flash's causal flag (eager has none)
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
    """Attention of a packed batch: the slab's decode rows in one call; every other row's new keys and
    values join its cache and its queries attend to that row alone, through the model's own implementation."""
    rows: _Rows | None = getattr(_local, "rows", None)
    if rows is None:
        if getattr(_local, "single", False):  # a single forward with its small kernels inline (``inline_forward``)
            return pooled(ALL_ATTENTION_FUNCTIONS["sdpa"], module, query, key, value, attention_mask, **kwargs)
        # a forward on another path while the name is set: behave as SDPA would
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    fn = _base_attention(module, rows.base)
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    # per row its output, or a block of consecutive rows' outputs at the block's first row (``_COVERED`` after it)
    outs: list[torch.Tensor | None] = [None] * len(rows.caches)
    if rows.together is not None:
        _together_attention(module, fn, query, key, value, rows, layer, outs, kwargs)
    # a masked row on a CPU calls SDPA itself with grouped heads and an additive mask: bit for bit what the model's
    # own SDPA function computes there (which repeats the key and value heads first: a copy of each, per layer)
    direct = rows.base == "sdpa" and query.device.type == "cpu" and not (_UNUSUAL & kwargs.keys())
    for i, (cache, (a, b)) in enumerate(zip(rows.caches, rows.spans, strict=True)):
        if outs[i] is not None:
            continue
        past = cache._filled[layer]
        k_all, v_all = cache.append(layer, key[:, :, a:b], value[:, :, a:b])
        mask_key = (past, b - a, str(query.device), query.dtype, direct)
        if mask_key not in rows.masks:
            mask = _row_mask(past, b - a, rows.base, query.device, query.dtype)
            if direct and mask is not None:
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
            rows.masks[mask_key] = mask
        mask = rows.masks[mask_key]
        if direct and mask is not None:
            outs[i] = _sdpa(query[:, :, a:b], k_all, v_all, mask, kwargs).transpose(1, 2)
        else:
            outs[i], _ = pooled(fn, module, query[:, :, a:b], k_all, v_all, mask, **kwargs)
    parts = [o for o in outs if o is not _COVERED]
    if rows.padding:
        first = parts[0]
        assert first is not None
        parts.append(first.new_zeros(first.shape[0], rows.padding, *first.shape[2:]))
    if len(parts) == 1:  # a step of decode rows only: their block is the whole output
        return parts[0], None  # type: ignore[return-value]
    return torch.cat(parts, dim=1), None  # type: ignore[arg-type]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, kwargs: dict[str, Any]
) -> torch.Tensor:
    """SDPA itself on the thread's pool, with grouped key and value heads and an additive mask: ``(B, H, T, D)``."""
    return pooled(
        F.scaled_dot_product_attention,
        q,
        k,
        v,
        attn_mask=mask,
        scale=kwargs.get("scaling"),
        enable_gqa=q.shape[1] != k.shape[1],
    )


#: marks a row whose output is part of a block held at an earlier row (``_together_attention``)
_COVERED = torch.empty(0)

#: decode rows in a slab attend a key length rounded up to a multiple of this on the devices in
#: ``KEY_BUCKET_DEVICES``: on a CUDA GPU of compute capability 9.0 or 10.x, recent PyTorch puts cuDNN first among
#: SDPA's backends, and cuDNN's attention builds a graph per shape and caches it per thread, so a key length that grows
#: by one every step would build a graph every step (``docs/batching.md``, "On a GPU"). The extra keys are the
#: slab's own padding, hidden by the mask; on a CPU they would only be read for nothing
KEY_BUCKET = 64
KEY_BUCKET_DEVICES = frozenset({"cuda"})


def attended_keys(longest: int, capacity: int, device: torch.device) -> int:
    """The key length the slab's decode rows attend: ``longest`` (the longest row's keys, its new one included),
    rounded up to a multiple of ``KEY_BUCKET`` on the devices in ``KEY_BUCKET_DEVICES``, never past ``capacity``."""
    if device.type not in KEY_BUCKET_DEVICES:
        return longest
    return min(capacity, -(-longest // KEY_BUCKET) * KEY_BUCKET)


#: attention keywords the direct SDPA call does not honour: those calls go through the model's own function
_UNUSUAL = frozenset({"softcap", "position_bias", "s_aux", "sinks", "output_attentions", "head_mask"})


def _together_attention(
    module: nn.Module,
    fn: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rows: _Rows,
    layer: int,
    outs: list[torch.Tensor | None],
    kwargs: dict[str, Any],
) -> None:
    """One attention call for the slab's decode rows: each row's new key and value are written in place
    at its own length, then a ``(B, H, L, D)`` view of the slab is attended with a mask that shows each row its
    own ``length + 1`` keys (``L``: the longest row's, rounded up where :func:`attended_keys` says)."""
    group = rows.together
    assert group is not None
    slab, pasts, n = group.slab, group.pasts, len(group.members)
    longest = max(pasts) + 1
    if longest > slab.capacity:
        slab.reserve(longest)
    k_buf, v_buf = slab._keys[layer], slab._values[layer]
    span = attended_keys(longest, slab.capacity, k_buf.device)  # keys past a row's own are masked
    if group.first is not None:  # the rows' tokens are consecutive in the packed sequence, in slot order: views
        a = group.first
        q = query[0, :, a : a + n].transpose(0, 1)[:, :, None]  # (B, H, 1, D)
        new_k, new_v = key[0, :, a : a + n].transpose(0, 1), value[0, :, a : a + n].transpose(0, 1)
    else:
        q = query[0, :, group.at].transpose(0, 1)[:, :, None]
        new_k, new_v = key[0, :, group.at].transpose(0, 1), value[0, :, group.at].transpose(0, 1)
    k_buf[group.slots, :, group.where] = new_k
    v_buf[group.slots, :, group.where] = new_v
    for i, p in zip(group.members, pasts, strict=True):
        rows.caches[i]._filled[layer] = p + 1
    if group.in_place:
        k_all, v_all = k_buf[:n, :, :span], v_buf[:n, :, :span]
    else:
        k_all = k_buf.index_select(0, group.slots)[:, :, :span]
        v_all = v_buf.index_select(0, group.slots)[:, :, :span]
    mask = group.masks.get(query.dtype)
    if mask is None:  # additive, once per forward: SDPA would turn a boolean mask into this in every layer
        allowed = (torch.arange(span, device=k_buf.device)[None, :] <= group.where[:, None])[:, None, None, :]
        fill = torch.finfo(query.dtype).min if rows.base == "eager" else float("-inf")  # -inf: SDPA's own fill
        mask = torch.zeros(allowed.shape, dtype=query.dtype, device=k_buf.device).masked_fill(~allowed, fill)
        group.masks[query.dtype] = mask
    if rows.base == "sdpa" and not (_UNUSUAL & kwargs.keys()):
        # SDPA itself, with grouped heads as the single decode runs them (transformers' wrapper packs the
        # heads differently once a mask is given, which rounds further from the single path)
        out = _sdpa(q, k_all, v_all, mask, kwargs).transpose(1, 2)
    else:
        out, _ = pooled(fn, module, q, k_all, v_all, mask, **kwargs)  # (B, 1, H, D)
    if group.first is not None:  # one block: (B, 1, H, D) is laid out as (1, B, H, D)
        outs[group.first] = out.reshape(1, n, *out.shape[2:])
        for j in range(group.first + 1, group.first + n):
            outs[j] = _COVERED
        return
    for j, i in enumerate(group.members):
        outs[i] = out[j : j + 1]


def _together(rows: Sequence[Row], base: str, spans: list[tuple[int, int]]) -> _Together | None:
    """The decode rows of a forward that can attend in one call: one-token rows in the same slab (the slab
    most of them are in), at least two of them, on an attention implementation that takes a mask."""
    if base not in ("sdpa", "eager"):
        return None
    by_slab: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        slab = row.cache._slab
        if slab is not None and row.ids.numel() == 1:
            by_slab.setdefault(id(slab), []).append(i)
    if not by_slab:
        return None
    members = max(by_slab.values(), key=len)
    if len(members) < 2 or len({id(rows[i].cache) for i in members}) != len(members):
        return None
    members.sort(key=lambda i: rows[i].cache._slot)
    slots = [rows[i].cache._slot for i in members]
    slab = rows[members[0]].cache._slab
    assert slab is not None
    device = slab._keys[0].device
    at = [spans[i][0] for i in members]
    pasts = [rows[i].cache._filled[0] for i in members]
    if any(rows[i].cache._filled.count(p) != len(rows[i].cache._filled) for i, p in zip(members, pasts, strict=True)):
        return None  # a row whose layers hold different lengths (never after a whole forward): one at a time
    consecutive = at == list(range(at[0], at[0] + len(at)))
    return _Together(
        slab,
        members,
        torch.tensor(slots, dtype=torch.long, device=device),
        torch.tensor(at, dtype=torch.long, device=device),
        slots == list(range(len(slots))),
        pasts,
        torch.tensor(pasts, dtype=torch.long, device=device),
        at[0] if consecutive else None,
    )


ALL_ATTENTION_FUNCTIONS.register(ROWS_ATTENTION, _rows_attention)
# a single-request forward that meets the name (another thread) still gets SDPA's mask
ALL_MASK_ATTENTION_FUNCTIONS.register(ROWS_ATTENTION, sdpa_mask)

_switch = threading.Lock()


#: kept rows whose logits a batched forward computes as ``(W @ h^T)^T`` on a CPU (``_column_head``)
COLUMN_HEAD_ROWS = range(2, 9)


def column_logits(head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``head(x)`` for ``x`` of shape ``(1, k, H)`` computed as ``(W @ h^T)^T`` (``_column_head``)."""
    out = torch.matmul(head.weight, x[0].T).T
    if head.bias is not None:
        out = out + head.bias
    return out[None]


def _column_forward(head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    inside = getattr(_local, "rows", None) is not None  # a batched forward on this thread
    if inside and x.device.type == "cpu" and x.dim() == 3 and x.shape[0] == 1 and x.shape[1] in COLUMN_HEAD_ROWS:
        return column_logits(head, x)
    return nn.Linear.forward(head, x)


def _column_head(model: nn.Module) -> None:
    """Once per CPU model whose head is a plain ``nn.Linear`` (an engine with ``linear_backend="native"``; a packed
    head, ``packed_linear.py``, reads its weights once for any row count and keeps its own form): the head
    computes the logits of 2 to 8 rows as ``(W @ h^T)^T`` inside a batched forward. MKL runs ``h @ W^T`` for a
    few rows as that many matrix-vector products over the vocabulary's weights; a decode step of 2-8 rows of the
    default model took 8-29% less with the column form (``docs/batching.md``). Any forward outside
    ``batched_forward`` (or with other row counts) runs ``nn.Linear``'s own. The two forms differ by float
    rounding (about 4e-5 on logits of the default model), within the batching tolerance. The head's ``forward``
    becomes a bound method of a module-level function, so a deep copy or a pickle of the model stays consistent."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.weight.device.type != "cpu" or "forward" in vars(head):
        return
    head.forward = types.MethodType(_column_forward, head)  # type: ignore[method-assign]


@contextmanager
def _rows_attention_on(model: nn.Module, rows: _Rows) -> Iterator[None]:
    config = model.config
    with _switch:
        _column_head(model)
        config._attn_implementation = ROWS_ATTENTION
        _local.rows = rows
        try:
            yield
        finally:
            _local.rows = None
            config._attn_implementation = rows.base


@contextmanager
def _single_on(model: nn.Module) -> Iterator[None]:
    config = model.config
    with _switch:
        config._attn_implementation = ROWS_ATTENTION
        _local.single = True
        try:
            yield
        finally:
            _local.single = False
            config._attn_implementation = "sdpa"


def inline_forward(model: nn.Module, tokens: int) -> AbstractContextManager[None]:
    """What a single (unbatched) forward of ``tokens`` new tokens on ``model`` runs in: where a batched one would
    run its small kernels inline (:func:`inlines_small_kernels`), the same, with the model's own SDPA function on
    the pool (the model's attention name is switched to this module's for the forward, as a batched forward does,
    so its kernels can be told apart: the same function, bit for bit the same results); elsewhere nothing. Only
    for a model on SDPA (an eager model's mask would be built another way under the switched name); forwards in
    such a block exclude each other and batched forwards, as batched forwards do each other."""
    base = str(getattr(model.config, "_attn_implementation", None) or "sdpa")
    if base != "sdpa" or not inlines_small_kernels(model, tokens):
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(_single_on(model))
    stack.enter_context(small_kernels_inline())
    return stack


def packed_length(tokens: int, model: nn.Module) -> int:
    """How long the packed sequence of a batched forward of ``tokens`` new tokens is on ``model``. On a CPU
    whose linears run on BLAS (``nn.Linear``'s own: an engine with ``linear_backend="native"``), a short step
    of 3, 7, 11 or 15 tokens (decode rows, mostly) gets one filler token: MKL multiplies the rows of the
    model's GEMMs in blocks of four, and a block of three left over can cost more than a full one (a decode
    step over the default model, 2-core AMD EPYC: 3 rows 119-121 ms, filled to 4 103-104 ms; at 7, 11 and 15
    rows up to 11% in one run, level in another; at 5 or 13 rows filling up to the next multiple of four
    costs more, so it stops at one token; ``docs/batching.md``). oneDNN's packed linears (the CPU default,
    ``packed_linear.py``) gain nothing from it (the same machine, best of 18: 3 rows 41.7 ms either way, 7
    rows 50.2 filled against 48.6), so they get none. The filler attends to nothing, lands in no cache and no
    logits are read from it. Elsewhere, ``tokens``."""
    if tokens > 16 or tokens % 4 != 3 or next(model.parameters()).device.type != "cpu":
        return tokens
    # the head is packed with the rest of the model's linears (``pack_linears``)
    return tokens if runs_onednn(model.get_output_embeddings()) else tokens + 1


#: a batched forward on a CPU with packed linears runs its small kernels inline (``threads.small_kernels_inline``;
#: linears and attention keep the pool) when its widest activation, new tokens x the MLP's width, is more than
#: torch's parallel grain (32,768 elements: below it nothing is split anyway) and at most this many elements.
#: The default model (MLP width 1,536), the 2-core VM while its host was busy, one prompt row, best of 8, pool
#: against inline: 57 tokens 133 / 112 ms, 142 tokens 243 / 219 ms, 300 tokens 509 / 469 ms, 512 tokens 869 / 916 ms
#: (on the quiet host the two are level within a few percent: ``docs/batching.md``)
INLINE_MAX_ELEMENTS = 600_000


def inlines_small_kernels(model: nn.Module, tokens: int) -> bool:
    """Whether a batched forward of ``tokens`` new tokens on ``model`` runs its small kernels inline: a text model on
    a CPU whose linears run on oneDNN's packed weights (BLAS's would take the thread's count of one), with its
    widest activation within (32,768, :data:`INLINE_MAX_ELEMENTS`] elements."""
    config = model.config
    if getattr(config, "sub_configs", None) or not runs_onednn(model.get_output_embeddings()):
        return False  # a composite (vision-language) model, or linears on BLAS
    width = getattr(config, "intermediate_size", None) or 4 * int(config.hidden_size)
    return 32_768 < tokens * int(width) <= INLINE_MAX_ELEMENTS


def row_spans(rows: Sequence[Row]) -> list[tuple[int, int]]:
    """Each row's ``[start, stop)`` in the packed sequence of a batched forward (rows in order)."""
    spans, at = [], 0
    for row in rows:
        n = int(row.ids.numel())
        spans.append((at, at + n))
        at += n
    return spans


@torch.inference_mode()
def batched_forward(model: nn.Module, rows: Sequence[Row], *, fill: bool = True) -> list[torch.Tensor | None]:
    """Run every row's new tokens after its own cache in one model call; the caches grow in place.
    ``fill``: pack a short step on BLAS's CPU linears with its filler token (``packed_length``; False only to
    measure it).

    Returns per row its logits as float32: ``(vocab,)`` for ``"last"``, ``(N, vocab)`` for ``"all"``,
    None for ``"none"``. A forward that raises leaves every row's cache as it was.
    """
    if not rows:
        return []
    base = str(getattr(model.config, "_attn_implementation", None) or "sdpa")
    if base == ROWS_ATTENTION:
        raise InvalidInputError("batched forwards do not nest")
    device = next(model.parameters()).device
    spans = row_spans(rows)
    at = spans[-1][1]
    keep: list[int] = []
    for row, (a, b) in zip(rows, spans, strict=True):
        if row.logits == "all":
            keep.extend(range(a, b))
        elif row.logits == "last":
            keep.append(b - 1)
    ids = torch.cat([r.ids for r in rows]).to(device)[None]
    positions = torch.cat([r.positions for r in rows]).to(device)[None]
    padding = packed_length(at, model) - at if fill else 0
    if padding:  # filler: token 0 at position 0, attending to nothing
        ids, positions = F.pad(ids, (0, padding)), F.pad(positions, (0, padding))
    marks = [r.cache.mark() for r in rows]
    state = _Rows([r.cache for r in rows], spans, base, _together(rows, base, spans), padding)
    inline = small_kernels_inline() if inlines_small_kernels(model, at + padding) else nullcontext()
    try:
        with _rows_attention_on(model, state), inline:
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

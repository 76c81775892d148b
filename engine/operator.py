"""The position-free KV operator (core paper §3 and appendix A).

    KV^(B | A) = R(p) · [ KV(B | ∅) + U_m V_m^T ]

* ``KV(B | ∅)`` is the chunk's canonical, stored position-free (keys un-rotated to angle 0);
* ``R(p)`` rotates the rotary features of the keys to the target positions, exactly (see ``rope``);
* ``U_m V_m^T`` is the rank-m conditioning patch: per layer, the top-m SVD factors of
  ``Delta = KV(B | A) - KV(B | ∅)`` taken in the position-free frame, with the KV heads stacked into the
  feature axis, separately for K and V. Because Delta is formed position-free, one patch serves any
  target position; it depends on the antecedent's content only.

Forming costs one conditioned forward (done by the caller); applying costs a rotation and a batched
GEMM, no forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import fused_apply as fused
from .errors import InvalidInputError
from .kernels import dispatch as gpu_kernels
from .kv import KV
from .rope import RopeSpec, apply_rotation_, check_rotation, rotate_keys, rotate_like_model, rotation_table, work_dtype
from .threads import lapack_on_one_thread


@dataclass(slots=True)
class Patch:
    """Rank-m conditioning patch of one chunk, position-free.

    Factors cover ``layers`` (all layers, or only the deepest ones): ``k_u (Lp, T, m)`` already scaled
    by the singular values, ``k_vt (Lp, m, H * Dk)``; likewise ``v_u``, ``v_vt`` for values.
    """

    k_u: torch.Tensor  # (Lp, T, m)
    k_vt: torch.Tensor  # (Lp, m, H*Dk)
    v_u: torch.Tensor  # (Lp, T, m)
    v_vt: torch.Tensor  # (Lp, m, H*Dv)
    layers: tuple[int, ...]

    @property
    def rank(self) -> int:
        return int(self.k_u.shape[-1])

    @property
    def num_tokens(self) -> int:
        return int(self.k_u.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_u, self.k_vt, self.v_u, self.v_vt))

    def truncate(self, rank: int) -> Patch:
        """The same patch at a lower rank (SVD factors are ordered by singular value)."""
        if rank > self.rank:
            raise InvalidInputError(f"cannot raise a rank-{self.rank} patch to rank {rank}")
        return Patch(self.k_u[..., :rank], self.k_vt[:, :rank], self.v_u[..., :rank], self.v_vt[:, :rank], self.layers)

    def to(self, device: torch.device | str) -> Patch:
        """The same patch on ``device`` (itself when it is there already)."""
        dev = torch.device(device)
        if self.k_u.device == dev:
            return self
        return Patch(self.k_u.to(dev), self.k_vt.to(dev), self.v_u.to(dev), self.v_vt.to(dev), self.layers)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat dict for storage (safetensors)."""
        return {
            "k_u": self.k_u.contiguous(),
            "k_vt": self.k_vt.contiguous(),
            "v_u": self.v_u.contiguous(),
            "v_vt": self.v_vt.contiguous(),
            "layers": torch.tensor(self.layers, dtype=torch.int64),
        }

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor]) -> Patch:
        return Patch(t["k_u"], t["k_vt"], t["v_u"], t["v_vt"], tuple(int(x) for x in t["layers"].tolist()))


def make_free(kv: KV, spec: RopeSpec) -> KV:
    """Un-rotate a placed KV to the position-free frame, every rotary pair at angle 0 (exact, float64).

    Angle 0 rather than "position 0": the same for text, not for an M-RoPE vision token, whose axes sit
    at its deltas' offsets from its linear position. Like every function here, keeps ``kv.deltas``.
    """
    if kv.positions is None:
        return kv
    keys = rotate_keys(kv.keys, spec, None, kv.positions)
    return KV(keys, kv.values, None, kv.deltas)


def relocate(kv: KV, spec: RopeSpec, target: torch.Tensor | int, *, exact: bool = True) -> KV:
    """Move a KV to ``target`` positions with one rotation from its current frame (never chained).

    ``target`` is the (T,) absolute positions or the first position of a contiguous run.
    """
    n = len(kv)
    tgt = torch.arange(target, target + n) if isinstance(target, int) else target.to(torch.long)
    keys = rotate_keys(kv.keys, spec, tgt, kv.positions, exact=exact)
    return KV(keys, kv.values, tgt, kv.deltas)


def _stack_heads(x: torch.Tensor) -> torch.Tensor:
    # (L, T, H, D) -> (L, T, H*D)
    return x.reshape(x.shape[0], x.shape[1], -1)


def conditioning_delta(conditioned: KV | Sequence[KV], canonical: KV, spec: RopeSpec) -> KV:
    """Delta = KV(B|A) - KV(B|∅) in the position-free frame, averaged over ``conditioned`` (orbit).

    ``conditioned``: one placed KV of B after its antecedent, or several (one per ordering of the
    antecedent set: the orbit patch of §5). ``canonical``: B's position-free canonical.
    """
    if not canonical.is_free:
        raise InvalidInputError("canonical must be position-free")
    items = [conditioned] if isinstance(conditioned, KV) else list(conditioned)
    if not items:
        raise InvalidInputError("conditioning_delta needs at least one conditioned KV")
    for item in items:
        if len(item) != len(canonical):
            raise InvalidInputError(f"conditioned KV has {len(item)} tokens, canonical {len(canonical)}")
    if len(items) == 1:
        # one subtraction, rounded once in the KV's dtype: the same bits as the float64 path below
        # (float64 carries more than twice the mantissa, so its extra rounding is innocuous)
        free = make_free(items[0], spec)
        keys, values = free.keys - canonical.keys, free.values - canonical.values
        return KV(keys.to(canonical.keys.dtype), values.to(canonical.values.dtype), None)
    dk = torch.zeros(canonical.keys.shape, dtype=torch.float64, device=canonical.keys.device)
    dv = torch.zeros(canonical.values.shape, dtype=torch.float64, device=canonical.values.device)
    for item in items:
        free = make_free(item, spec)
        dk += free.keys.double() - canonical.keys.double()
        dv += free.values.double() - canonical.values.double()
    dk /= len(items)
    dv /= len(items)
    return KV(dk.to(canonical.keys.dtype), dv.to(canonical.values.dtype), None)


def _top_factors(delta: torch.Tensor, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``rank`` SVD factors of each layer's (T, F) matrix: ``U_m S_m`` (Lp, T, m) and ``V_m^T`` (Lp, m, F).

    Through one of the two Gram matrices, never a full (T, F) SVD:

    * T <= 0.75 F (F = heads x head dim), below full rank: the (T, T) Gram matrix in float64; its top
      eigenvectors span ``U_m``, and ``V_m`` is ``Delta^T U_m`` orthonormalised (a QR, which also covers a
      layer whose Delta is zero). Past 0.75 F its float64 eigh costs more than the (F, F) route's float32 one
      (timings in docs/operator.md);
    * otherwise the (F, F) Gram matrix, formed in float64 and diagonalised in float32 below full rank (the
      leading directions are well separated); at full rank everything stays float64, so a full-rank patch
      is exact.

    In both ``U_m S_m = Delta V_m``.
    """
    mat = delta.to(torch.float64)  # (Lp, T, F)
    tokens, features = mat.shape[1], mat.shape[2]
    m = min(rank, tokens, features)
    full = m >= min(tokens, features)
    # small factorisations on one thread and one layer at a time: a threaded or batched eigh stalls for
    # seconds when another thread (the model's, in a server) holds a core, and gains nothing on matrices
    # this size (threads.py)
    with lapack_on_one_thread():
        if 4 * tokens <= 3 * features and not full:
            gram = mat @ mat.transpose(1, 2)  # (Lp, T, T)
            left = [torch.linalg.eigh(gram[i])[1][:, -m:].flip(-1) for i in range(gram.shape[0])]  # largest first
            right = mat.transpose(1, 2) @ torch.stack(left)  # (Lp, F, m): V_m S_m
            v = torch.stack([torch.linalg.qr(right[i])[0] for i in range(right.shape[0])])
        else:
            gram = mat.transpose(1, 2) @ mat  # (Lp, F, F)
            g = gram if full else gram.to(torch.float32)
            vecs = torch.stack([torch.linalg.eigh(g[i])[1] for i in range(g.shape[0])])  # ascending eigenvalues
            v = vecs[..., -m:].flip(-1).to(torch.float64)  # (Lp, F, m), largest first
        us = mat @ v  # (Lp, T, m)
    return us.to(dtype).contiguous(), v.transpose(1, 2).to(dtype).contiguous()


def form_patch(
    conditioned: KV | Sequence[KV],
    canonical: KV,
    spec: RopeSpec,
    rank: int,
    *,
    layers: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
) -> Patch:
    """Form a rank-``rank`` patch from conditioned KV(s) of a chunk and its canonical.

    ``layers``: which layers to patch (default all; the deep-only variant passes the deepest half).
    ``dtype``: storage dtype of the factors (default: the canonical's dtype).
    """
    if rank < 1:
        raise InvalidInputError(f"patch rank must be >= 1, got {rank}")
    delta = conditioning_delta(conditioned, canonical, spec)
    n_layers = canonical.num_layers
    chosen = tuple(range(n_layers)) if layers is None else tuple(sorted(set(int(i) for i in layers)))
    if not chosen or chosen[0] < 0 or chosen[-1] >= n_layers:
        raise InvalidInputError(f"patch layers must be within [0, {n_layers}), got {layers}")
    idx = torch.tensor(chosen, dtype=torch.long, device=delta.keys.device)
    out_dtype = dtype or canonical.keys.dtype
    k_u, k_vt = _top_factors(_stack_heads(delta.keys.index_select(0, idx)), rank, out_dtype)
    v_u, v_vt = _top_factors(_stack_heads(delta.values.index_select(0, idx)), rank, out_dtype)
    return Patch(k_u, k_vt, v_u, v_vt, chosen)


def patch_delta(patch: Patch, num_layers: int, shape_k: torch.Size, shape_v: torch.Size) -> KV:
    """The dense Delta a patch reconstructs (zeros on unpatched layers), position-free. For analysis."""
    dk = torch.zeros(shape_k, dtype=patch.k_u.dtype)
    dv = torch.zeros(shape_v, dtype=patch.v_u.dtype)
    idx = list(patch.layers)
    dk[idx] = torch.bmm(patch.k_u, patch.k_vt).reshape(len(idx), *shape_k[1:])
    dv[idx] = torch.bmm(patch.v_u, patch.v_vt).reshape(len(idx), *shape_v[1:])
    return KV(dk, dv, None)


def _patch_rows(patch: Patch | None, n_layers: int) -> torch.Tensor | None:
    """(L,) int64: each layer's row in the patch factors, -1 where the patch does not cover it."""
    if patch is None:
        return None
    rows = torch.full((n_layers,), -1, dtype=torch.int64)
    rows[list(patch.layers)] = torch.arange(len(patch.layers), dtype=torch.int64)
    return rows


def _fused(
    src: KV,
    patch: Patch | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    rotation: tuple[RopeSpec, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``keys, values = R · (src + U V^T)`` with the fused kernel; ``rotation``: (spec, cos, sin), or None
    to stay in the source frame."""
    rows = _patch_rows(patch, src.num_layers)
    k_f = None if patch is None else (patch.k_u, patch.k_vt)
    v_f = None if patch is None else (patch.v_u, patch.v_vt)
    if rotation is None:
        fused.run(src.keys, keys, k_f, rows, None, None)
    else:
        spec, cos, sin = rotation
        fused.run(
            src.keys, keys, k_f, rows, cos.contiguous(), sin.contiguous(), rotary_dim=spec.rotary_dim, style=spec.style
        )
    fused.run(src.values, values, v_f, rows, None, None)


def reconstruct(canonical: KV, patch: Patch | None) -> KV:
    """``canonical + U V^T`` in the position-free frame (the chunk's conditioned KV, rank-m)."""
    if not canonical.is_free:
        raise InvalidInputError("reconstruct wants a position-free canonical")
    if patch is None:
        return canonical
    n_tok = canonical.keys.shape[1]
    if patch.num_tokens != n_tok:
        raise InvalidInputError(f"patch covers {patch.num_tokens} tokens, canonical has {n_tok}")
    if fused.usable(canonical.keys, canonical.values):
        keys, values = torch.empty_like(canonical.keys), torch.empty_like(canonical.values)
        _fused(canonical, patch, keys, values)
        return KV(keys, values, None, canonical.deltas)
    # 16-bit KV: canonical + U V^T in float32, rounded once (a bf16 GEMM and a bf16 add would round twice)
    work = work_dtype(canonical.keys.dtype)
    keys, values = canonical.keys.to(work, copy=True), canonical.values.to(work, copy=True)
    idx = torch.tensor(patch.layers, dtype=torch.long, device=keys.device)
    # (Lp, T, m) @ (Lp, m, H*D) -> (Lp, T, H*D), added into the patched layers
    dk = torch.bmm(patch.k_u.to(work), patch.k_vt.to(work)).view(len(idx), n_tok, *keys.shape[2:])
    dv = torch.bmm(patch.v_u.to(work), patch.v_vt.to(work)).view(len(idx), n_tok, *values.shape[2:])
    keys.index_add_(0, idx, dk)
    values.index_add_(0, idx, dv)
    dtype_k, dtype_v = canonical.keys.dtype, canonical.values.dtype
    return KV(keys.to(dtype_k), values.to(dtype_v), None, canonical.deltas)


def apply_patch(
    canonical: KV,
    patch: Patch | None,
    spec: RopeSpec,
    target: torch.Tensor | int,
    *,
    exact: bool = False,
    out: KV | None = None,
    rotation: str = "exact",
) -> KV:
    """Serve a chunk: ``R(target) · (canonical + U V^T)``; no forward pass.

    canonical: position-free KV (L, T, H, D). ``patch=None`` gives blind reuse (relocation only).
    ``exact=False`` rotates in the KV dtype (serving path); ``True`` rotates in float64 (reference).
    ``out``: optional preallocated placed KV (same shapes) to write into, e.g. a slot of the window.
    ``rotation`` (serving path only): ``"exact"`` computes in float32 and rounds once; ``"model"`` relocates
    a chunk served without a patch with the model's own arithmetic in the KV dtype
    (``rope.rotate_like_model``, torch's path): the bits a prefill at ``target`` writes from the same
    pre-RoPE keys. A patched chunk has no such model counterpart, so under ``"model"`` it is still computed
    as ``"exact"`` does (``canonical + U V^T`` and the rotation in float32, rounded once), which is the
    closer of the two to the conditioned keys (docs/gpu.md).

    The serving path runs the fused CPU kernel (``fused_apply``: one pass per row) when it can, on CUDA
    the Triton kernel (``kernels.place``, chosen by ``kernels.dispatch``), else torch layer by layer, so
    each layer's GEMM output is rotated while it is still in cache.
    """
    if not canonical.is_free:
        raise InvalidInputError("apply_patch wants a position-free canonical")
    n_layers, n_tok = canonical.keys.shape[:2]
    tgt = torch.arange(target, target + n_tok) if isinstance(target, int) else target.to(torch.long)
    if tgt.shape != (n_tok,):
        raise InvalidInputError(f"target positions shape {tuple(tgt.shape)} != ({n_tok},)")
    if patch is not None and patch.num_tokens != n_tok:
        raise InvalidInputError(f"patch covers {patch.num_tokens} tokens, canonical has {n_tok}")
    if check_rotation(rotation) == "model" and not exact and patch is None:
        keys = rotate_like_model(canonical.keys, spec, tgt)
        if out is None:
            return KV(keys, canonical.values.clone(), tgt, canonical.deltas)
        out.keys.copy_(keys)
        out.values.copy_(canonical.values)
        return KV(out.keys, out.values, tgt, canonical.deltas)
    if exact:
        free = reconstruct(canonical, patch)
        keys = rotate_keys(free.keys, spec, tgt, None, exact=True)
        if out is not None:
            out.keys.copy_(keys)
            out.values.copy_(free.values)
            return KV(out.keys, out.values, tgt, canonical.deltas)
        return KV(keys, free.values.clone() if patch is None else free.values, tgt, canonical.deltas)
    keys = out.keys if out is not None else torch.empty_like(canonical.keys)
    values = out.values if out is not None else torch.empty_like(canonical.values)
    if gpu_kernels.serves(canonical.keys, canonical.values, keys, values):
        _apply_on_gpu(canonical, patch, spec, tgt, keys, values)
        return KV(keys, values, tgt, canonical.deltas)
    # bf16 / fp16: every layer is computed in float32 and rounded once, on the store into ``keys``/``values``
    work = work_dtype(keys.dtype)
    cos, sin = rotation_table(spec, tgt, None, dtype=work, device=keys.device)
    if fused.usable(canonical.keys, canonical.values, keys, values):
        _fused(canonical, patch, keys, values, (spec, cos, sin))
        return KV(keys, values, tgt, canonical.deltas)
    if work != keys.dtype:
        _apply_widened(canonical, patch, spec, cos, sin, keys, values)
        return KV(keys, values, tgt, canonical.deltas)
    fast = spec.style == "half" and spec.rotary_dim == canonical.keys.shape[-1]
    if fast:
        # rotate-half as one multiply-add: x * [c, c] + roll(x, r/2) * [-s, s]
        cc = torch.cat([cos, cos], dim=-1)[:, None, :]  # (T, 1, D)
        ss = torch.cat([-sin, sin], dim=-1)[:, None, :]
    half = spec.rotary_dim // 2
    k_rows = dict(zip(patch.layers, range(len(patch.layers)), strict=True)) if patch is not None else {}
    for layer in range(n_layers):
        k_src, v_src = canonical.keys[layer], canonical.values[layer]  # (T, H, D)
        j = k_rows.get(layer)
        if j is not None:
            assert patch is not None
            # (T, H*D) + (T, m) @ (m, H*D)
            k_src = torch.addmm(k_src.reshape(n_tok, -1), patch.k_u[j].to(keys.dtype), patch.k_vt[j].to(keys.dtype))
            k_src = k_src.view_as(keys[layer])
            torch.addmm(
                v_src.reshape(n_tok, -1),
                patch.v_u[j].to(values.dtype),
                patch.v_vt[j].to(values.dtype),
                out=values[layer].view(n_tok, -1),
            )
        else:
            values[layer].copy_(v_src)
        if fast:
            torch.mul(k_src, cc, out=keys[layer])
            keys[layer].addcmul_(k_src.roll(half, -1), ss)
        else:
            keys[layer].copy_(k_src)
            apply_rotation_(keys[layer], cos, sin, spec)
    return KV(keys, values, tgt, canonical.deltas)


def _apply_widened(
    canonical: KV,
    patch: Patch | None,
    spec: RopeSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """``keys, values = R · (canonical + U V^T)`` for 16-bit KV: each layer widened to ``cos``'s dtype
    (float32), patched and rotated there, and rounded once when it is written (what the Triton kernel
    does in registers). Values without a patch are copied bit for bit."""
    work = cos.dtype
    n_tok = canonical.keys.shape[1]
    rows = dict(zip(patch.layers, range(len(patch.layers)), strict=True)) if patch is not None else {}
    for layer in range(canonical.keys.shape[0]):
        k = canonical.keys[layer].to(work)  # (T, H, D)
        j = rows.get(layer)
        if j is not None:
            assert patch is not None
            k = torch.addmm(k.reshape(n_tok, -1), patch.k_u[j].to(work), patch.k_vt[j].to(work)).view_as(k)
            v = torch.addmm(
                canonical.values[layer].reshape(n_tok, -1).to(work), patch.v_u[j].to(work), patch.v_vt[j].to(work)
            )
            values[layer].copy_(v.view_as(values[layer]))
        else:
            values[layer].copy_(canonical.values[layer])
        keys[layer].copy_(apply_rotation_(k, cos, sin, spec))  # ``k`` is a float32 copy: rotated in place


# --- CUDA: the Triton kernels (engine/kernels), chosen by kernels.dispatch; torch's path above is the fallback
def _apply_on_gpu(
    canonical: KV, patch: Patch | None, spec: RopeSpec, target: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """One fused Triton pass per tensor: ``keys, values = R(target) · (canonical + U V^T)``."""
    from .kernels.place import place_chunk  # imports triton: only ever reached on CUDA

    place_chunk(canonical, patch, spec, target, KV(keys, values), slot=0)

"""Fused placement of canonical rows: ``dst[slot + t] = R(p_t) · (canonical[t] + U[t] V^T)`` in one pass.

Each program reads a block of a chunk's rows of one layer once, accumulates the rank-m patch on top of
them in registers (float32, one outer product per rank), rotates the rotary band of each head from
angle 0 to the row's target position and writes the result straight into a destination KV buffer at
the chunk's slot: no intermediate tensor, no second pass over the keys.

The features of a row are split into rotary pairs (``(i, i + r/2)`` for rotate-half, ``(2i, 2i + 1)``
interleaved) and the pass-through tail of partial rotary (``r .. D - 1`` of each head): a program
loads both members of its pairs, so the rotation needs no shuffle. Values, and MLA's latent, run the
same kernel with ``r = 0`` (every feature passes through). Angles come from a float32 cos/sin table
indexed by position (``tables``), so M-RoPE tokens gather each frequency's angle at its own axis.

Arithmetic is float32 throughout with one rounding to the destination dtype at the store: on bf16 KV
that is closer to the float64 reference than torch's bf16 path, which rounds after every op.

The same kernel serves one chunk (:func:`place_chunk`) and many chunks in one launch
(``relocate_many.place_chunks``): the grid's third axis walks a (C, 4) table of chunks.
Language features are those of Triton 3.x (checked on 3.6 and 3.9; the CPU interpreter runs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..errors import InvalidInputError
from ..kv import KV
from ..rope import RopeSpec
from .tables import position_table

if TYPE_CHECKING:
    from ..operator import Patch

BLOCK_T = 16  # rows per program
BLOCK_F = 64  # rotary pairs (and pass-through features) per program
_STYLES = {"half": 0, "interleaved": 1}


@triton.jit
def _place_kernel(
    src_ptr,  # (L, N, H*D) rows of every chunk, packed along N
    dst_ptr,  # (L, S, H*D) destination buffer
    u_ptr,  # (Lp, N, M) patch row factors, packed along N like src
    vt_ptr,  # (C, Lp, M, H*D) each chunk's right factors (chunk stride 0 when shared)
    rows_ptr,  # (L,) int64: layer -> row of the factors, -1 when the layer is not patched
    cos_ptr,  # (P, R/2) float32, row q is position q + table base
    sin_ptr,
    pos_ptr,  # (N,) int64 row positions relative to the chunk's first position (HAS_POS)
    delta_ptr,  # (N, 3) int64 M-RoPE axis offsets (HAS_DELTAS)
    axes_ptr,  # (R/2,) int64 axis of each frequency (HAS_DELTAS)
    meta_ptr,  # (C, 4) int64: src row, length, dst row, first position minus table base
    stride_src_l,
    stride_dst_l,
    stride_u_l,
    stride_vt_c,
    stride_vt_l,
    n_fblocks,
    M,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    STYLE: tl.constexpr,
    HAS_PATCH: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_DELTAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    F: tl.constexpr = H * D
    HR: tl.constexpr = R // 2
    pid_t = tl.program_id(0)
    pid_lf = tl.program_id(1)
    c = tl.program_id(2)
    layer = (pid_lf // n_fblocks).to(tl.int64)
    fb = pid_lf % n_fblocks

    src_row = tl.load(meta_ptr + c * 4 + 0)
    length = tl.load(meta_ptr + c * 4 + 1)
    dst_row = tl.load(meta_ptr + c * 4 + 2)
    pos0 = tl.load(meta_ptr + c * 4 + 3)

    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < length
    srow = src_row + t  # int64
    drow = dst_row + t
    src_base = src_ptr + layer * stride_src_l + srow * F
    dst_base = dst_ptr + layer * stride_dst_l + drow * F

    # patch: the layer's factor row, or no rank-1 updates at all when it is not patched
    n_rank = 0
    prow = 0
    if HAS_PATCH:
        prow = tl.load(rows_ptr + layer)
        n_rank = tl.where(prow >= 0, M, 0)
        prow = tl.maximum(prow, 0)
    u_base = u_ptr + prow * stride_u_l + srow * M
    vt_base = vt_ptr + c * stride_vt_c + prow * stride_vt_l

    if R > 0:
        j = fb * BLOCK_F + tl.arange(0, BLOCK_F)
        jmask = j < H * HR
        head = j // HR
        i = j % HR
        if STYLE == 0:
            f1 = head * D + i
            f2 = f1 + HR
        else:
            f1 = head * D + 2 * i
            f2 = f1 + 1
        m2 = tmask[:, None] & jmask[None, :]
        x1 = tl.load(src_base[:, None] + f1[None, :], mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(src_base[:, None] + f2[None, :], mask=m2, other=0.0).to(tl.float32)
        for k in range(0, n_rank):
            a = tl.load(u_base + k, mask=tmask, other=0.0).to(tl.float32)
            w1 = tl.load(vt_base + k * F + f1, mask=jmask, other=0.0).to(tl.float32)
            w2 = tl.load(vt_base + k * F + f2, mask=jmask, other=0.0).to(tl.float32)
            x1 += a[:, None] * w1[None, :]
            x2 += a[:, None] * w2[None, :]
        if HAS_POS:
            pos = pos0 + tl.load(pos_ptr + srow, mask=tmask, other=0)
        else:
            pos = pos0 + t
        q = pos[:, None] + tl.zeros([BLOCK_T, BLOCK_F], dtype=tl.int64)
        if HAS_DELTAS:
            axis = tl.load(axes_ptr + i, mask=jmask, other=0)
            q += tl.load(delta_ptr + srow[:, None] * 3 + axis[None, :], mask=m2, other=0)
        cs = tl.load(cos_ptr + q * HR + i[None, :], mask=m2, other=1.0)
        sn = tl.load(sin_ptr + q * HR + i[None, :], mask=m2, other=0.0)
        y1 = x1 * cs - x2 * sn
        y2 = x2 * cs + x1 * sn
        tl.store(dst_base[:, None] + f1[None, :], y1.to(dst_ptr.dtype.element_ty), mask=m2)
        tl.store(dst_base[:, None] + f2[None, :], y2.to(dst_ptr.dtype.element_ty), mask=m2)

    if R < D:
        e = fb * BLOCK_F + tl.arange(0, BLOCK_F)
        emask = e < H * (D - R)
        f = (e // (D - R)) * D + R + e % (D - R)
        m2 = tmask[:, None] & emask[None, :]
        x = tl.load(src_base[:, None] + f[None, :], mask=m2, other=0.0).to(tl.float32)
        for k in range(0, n_rank):
            a = tl.load(u_base + k, mask=tmask, other=0.0).to(tl.float32)
            w = tl.load(vt_base + k * F + f, mask=emask, other=0.0).to(tl.float32)
            x += a[:, None] * w[None, :]
        tl.store(dst_base[:, None] + f[None, :], x.to(dst_ptr.dtype.element_ty), mask=m2)


def _rows(patch: Patch | None, n_layers: int, device: torch.device) -> torch.Tensor | None:
    if patch is None:
        return None
    rows = torch.full((n_layers,), -1, dtype=torch.int64)
    rows[list(patch.layers)] = torch.arange(len(patch.layers), dtype=torch.int64)
    return rows.to(device)


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.ndim != 4 or x.stride(3) != 1 or x.stride(2) != x.shape[3] or x.stride(1) != x.shape[2] * x.shape[3]:
        raise InvalidInputError(f"{name}: expected (L, T, H, D) with contiguous rows, got strides {x.stride()}")


def launch(
    src: torch.Tensor,
    dst: torch.Tensor,
    meta: torch.Tensor,
    max_len: int,
    *,
    rotary_dim: int,
    style: str,
    table: tuple[torch.Tensor, torch.Tensor] | None,
    factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rel_pos: torch.Tensor | None = None,
    deltas: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One launch of the placement kernel over the C chunks described by ``meta`` (C, 4) int64.

    ``src`` (L, N, H, D) packed rows, ``dst`` (L, S, H, D); ``factors``: ``(u (Lp, N, m), vt (C or 1, Lp, m, F),
    rows (L,) int64)``; ``table``: float32 cos/sin by position (None with ``rotary_dim == 0``); ``rel_pos``
    (N,) int64 row offsets from each chunk's first position (default ``t``); ``deltas``: M-RoPE
    ``((N, 3) int64, (r/2,) int64 axes)``.
    """
    _check_rows(src, "source")
    _check_rows(dst, "destination")
    n_layers, _, heads, dim = src.shape
    if dst.shape[0] != n_layers or dst.shape[2:] != src.shape[2:]:
        raise InvalidInputError(f"destination {tuple(dst.shape)} does not match source {tuple(src.shape)}")
    if rotary_dim % 2 or not 0 <= rotary_dim <= dim or style not in _STYLES:
        raise InvalidInputError(f"bad rotary layout: rotary_dim {rotary_dim} of head dim {dim}, style {style!r}")
    n_chunks = int(meta.shape[0])
    if n_chunks == 0 or max_len == 0 or n_layers == 0:
        return
    rotated = heads * (rotary_dim // 2)
    n_fblocks = max(triton.cdiv(rotated, BLOCK_F), triton.cdiv(heads * (dim - rotary_dim), BLOCK_F))
    dummy = meta  # stands in for absent pointers; never read (its constexpr flag is off)
    cos, sin = table if table is not None else (dummy, dummy)
    if factors is not None:
        u, vt, rows = factors
        rank = int(u.shape[-1])
        stride_u, stride_vc, stride_vl = u.stride(0), (vt.stride(0) if vt.shape[0] > 1 else 0), vt.stride(1)
    else:
        u = vt = rows = dummy
        rank, stride_u, stride_vc, stride_vl = 0, 0, 0, 0
    delta, axes = deltas if deltas is not None else (dummy, dummy)
    grid = (triton.cdiv(max_len, BLOCK_T), n_layers * n_fblocks, n_chunks)
    _place_kernel[grid](
        src,
        dst,
        u,
        vt,
        rows,
        cos,
        sin,
        rel_pos if rel_pos is not None else dummy,
        delta,
        axes,
        meta,
        src.stride(0),
        dst.stride(0),
        stride_u,
        stride_vc,
        stride_vl,
        n_fblocks,
        rank,
        H=heads,
        D=dim,
        R=rotary_dim,
        STYLE=_STYLES[style],
        HAS_PATCH=factors is not None,
        HAS_POS=rel_pos is not None,
        HAS_DELTAS=deltas is not None,
        BLOCK_T=BLOCK_T,
        BLOCK_F=BLOCK_F,
    )


def _span(positions: torch.Tensor, deltas: torch.Tensor | None) -> tuple[int, int]:
    """The position range [lo, hi) the table must cover (M-RoPE axes included)."""
    lo, hi = int(positions.min()), int(positions.max()) + 1
    if deltas is not None:
        lo += min(0, int(deltas.min()))
        hi += max(0, int(deltas.max()))
    return lo, hi


def place_chunk(
    canonical: KV,
    patch: Patch | None,
    spec: RopeSpec,
    target: torch.Tensor,
    out: KV,
    slot: int = 0,
) -> None:
    """Write ``R(target) · (canonical + U V^T)`` into ``out``'s rows ``slot .. slot + T - 1``, keys and values.

    ``target`` (T,) int64 positions; ``spec`` may be an M-RoPE spec bound to the canonical's deltas; a
    value-slot RoPE band (MLA) is served by passing the swapped view, as the engine's operator does.
    """
    n_layers, n_tok = canonical.keys.shape[:2]
    if slot < 0 or slot + n_tok > out.keys.shape[1]:
        raise InvalidInputError(f"slot {slot} + {n_tok} rows does not fit a buffer of {out.keys.shape[1]}")
    device = canonical.keys.device
    tgt = target.to(device=device, dtype=torch.long)
    axes_deltas = _mrope(spec, canonical, device)
    lo, hi = _span(tgt, axes_deltas[0] if axes_deltas is not None else None)
    table = position_table(spec, lo, hi, device)
    first = int(tgt[0])
    contiguous = bool(torch.equal(tgt, torch.arange(first, first + n_tok, device=device)))
    rel = None if contiguous else (tgt - first).contiguous()
    meta = torch.tensor([[0, n_tok, slot, first - lo]], dtype=torch.int64, device=device)
    rows = _rows(patch, n_layers, device)
    k_f = v_f = None
    if patch is not None:
        assert rows is not None
        k_f = (patch.k_u.to(device).contiguous(), patch.k_vt.to(device).contiguous()[None], rows)
        v_f = (patch.v_u.to(device).contiguous(), patch.v_vt.to(device).contiguous()[None], rows)
    launch(
        canonical.keys,
        out.keys,
        meta,
        n_tok,
        rotary_dim=spec.rotary_dim,
        style=spec.style,
        table=table,
        factors=k_f,
        rel_pos=rel,
        deltas=axes_deltas,
    )
    launch(canonical.values, out.values, meta, n_tok, rotary_dim=0, style="half", table=None, factors=v_f)


def _mrope(spec: RopeSpec, canonical: KV, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """M-RoPE's (deltas (T, 3), axes (r/2,)) when ``spec`` is bound to per-token axis offsets, else None."""
    deltas = getattr(spec, "deltas", None)
    axes = getattr(spec, "axes", None)
    if deltas is None or axes is None:
        return None
    if deltas.shape != (canonical.keys.shape[1], 3):
        raise InvalidInputError(f"deltas {tuple(deltas.shape)} do not match {canonical.keys.shape[1]} tokens")
    return deltas.to(device, torch.long).contiguous(), axes.to(device, torch.long).contiguous()

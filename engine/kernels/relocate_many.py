"""Many chunks placed in one launch, each at its own slot and target position.

Assembling a window places every chunk that moved: one launch per chunk costs a launch latency each
(tens of microseconds on a GPU, more than a short chunk's copy). Here the chunks' canonicals are packed
along the token axis of one source tensor (as a store loads them into a staging buffer) and a (C, 4)
table tells the placement kernel (``place``) where each chunk's rows start, how many there are, which
destination slot they go to and the first target position. One cos/sin table covers all positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InvalidInputError
from ..kv import KV
from ..operator import Patch
from ..rope import RopeSpec
from .place import _rows, launch
from .tables import position_table


def place_chunks(
    packed: KV,
    lengths: Sequence[int],
    targets: Sequence[int],
    slots: Sequence[int],
    spec: RopeSpec,
    out: KV,
    patches: Sequence[Patch] | None = None,
) -> None:
    """Place C packed position-free chunks into ``out`` in one launch for keys and one for values.

    ``packed``: (L, sum(lengths), H, D) canonicals back to back; chunk ``c`` goes to rows
    ``slots[c] ..`` of ``out`` at positions ``targets[c] ..``. ``patches``: one per chunk or None
    (relocation only); they must share rank and patched layers (one factor layout for the launch).
    Text chunks only (M-RoPE chunks carry per-token deltas: place them with ``place.place_chunk``).
    """
    n = len(lengths)
    if not (len(targets) == len(slots) == n) or n == 0:
        raise InvalidInputError(f"{n} lengths, {len(targets)} targets, {len(slots)} slots: one of each per chunk")
    if any(x <= 0 for x in lengths) or sum(lengths) != packed.keys.shape[1]:
        raise InvalidInputError(f"lengths {list(lengths)} do not tile {packed.keys.shape[1]} packed rows")
    size = out.keys.shape[1]
    if any(s < 0 or s + x > size for s, x in zip(slots, lengths, strict=True)):
        raise InvalidInputError(f"a slot run does not fit the destination's {size} rows")
    device = packed.keys.device
    starts = [0]
    for x in lengths[:-1]:
        starts.append(starts[-1] + x)
    lo = min(targets)
    hi = max(t + x for t, x in zip(targets, lengths, strict=True))
    meta = torch.tensor(
        [[s, x, d, t - lo] for s, x, d, t in zip(starts, lengths, slots, targets, strict=True)],
        dtype=torch.int64,
        device=device,
    )
    k_f = v_f = None
    if patches is not None:
        if len(patches) != n:
            raise InvalidInputError(f"{len(patches)} patches for {n} chunks")
        first = patches[0]
        if any(p.layers != first.layers or p.rank != first.rank for p in patches):
            raise InvalidInputError("patches placed in one launch must share rank and patched layers")
        if any(p.num_tokens != x for p, x in zip(patches, lengths, strict=True)):
            raise InvalidInputError("each patch must cover its chunk's tokens")
        rows = _rows(first, packed.num_layers, device)
        assert rows is not None
        k_f = (torch.cat([p.k_u for p in patches], dim=1), torch.stack([p.k_vt for p in patches]), rows)
        v_f = (torch.cat([p.v_u for p in patches], dim=1), torch.stack([p.v_vt for p in patches]), rows)
    table = position_table(spec, lo, hi, device)
    longest = max(lengths)
    launch(packed.keys, out.keys, meta, longest, rotary_dim=spec.rotary_dim, style=spec.style, table=table, factors=k_f)
    launch(packed.values, out.values, meta, longest, rotary_dim=0, style="half", table=None, factors=v_f)

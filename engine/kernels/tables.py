"""cos/sin of RoPE angles by absolute position, for the GPU kernels.

The kernels look each key's rotation up in a table indexed by position instead of computing angles
themselves, so they rotate by exactly the angles the torch path uses: ``fl32(p * inv_freq)`` as
transformers computes it, cos/sin taken in float64 and rounded to float32 (``rope.rotation_table``).
M-RoPE needs nothing more: frequency ``i`` of a token at linear position ``p`` with axis offsets
``delta`` has the 1-D angle of position ``p + delta[axis(i)]``, one gather from the same table.
"""

from __future__ import annotations

import torch

from ..rope import RopeSpec, rotation_table


def plain(spec: RopeSpec) -> RopeSpec:
    """``spec``'s frequencies with 1-D angles (an M-RoPE spec without its per-token binding)."""
    return RopeSpec(spec.inv_freq, spec.rotary_dim, spec.head_dim, spec.rope_type, spec.style)


def position_table(spec: RopeSpec, lo: int, hi: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin for positions ``lo .. hi - 1``: two (hi - lo, rotary_dim // 2) tensors on ``device``."""
    positions = torch.arange(lo, hi, dtype=torch.long)
    cos, sin = rotation_table(plain(spec), positions, None, dtype=torch.float32, device=device)
    return cos.contiguous(), sin.contiguous()

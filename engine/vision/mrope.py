"""Exact M-RoPE angles for vision tokens (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

M-RoPE gives each token three positions (temporal, height, width) and assigns every rotary frequency to
one of them: in contiguous sections (Qwen2-VL, Qwen2.5-VL: ``mrope_section[0]`` frequencies on t, then
``mrope_section[1]`` on h, then w) or interleaved (Qwen3-VL: t, h, w, t, h, w, ... over the first
``3 * mrope_section[1|2]`` frequencies, t after). transformers computes the angle of frequency ``i`` of a
token in float32: ``fl32(pos_axis(i) * inv_freq_i)``.

Kamera places a vision token at linear position ``p`` at ``p + delta`` on each axis (``engine.py``), so
its angles are ``fl32((p + delta_axis(i)) * inv_freq_i)``. Rotating by ``fl32(p * inv_freq)`` instead
is the same rotation in real arithmetic but not the same float32 rounding: the two differ by up to an
ulp of the angle (2.4e-4 rad near ``p = 4000``). :class:`MRopeSpec` reproduces the per-axis float32
angles token by token, with the same ``angles(positions)`` interface as :class:`~kamera_engine.rope.RopeSpec`,
so relocating and un-rotating vision tokens is as exact as text (``rope.py``), and the position-free
frame is the same for every token: every rotary pair at angle 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError, UnsupportedModelError
from ..rope import RopeSpec


def section_axes(section: Sequence[int], n_freq: int) -> torch.Tensor:
    """Axis of each rotary frequency for contiguous sections (Qwen2-VL, Qwen2.5-VL): (n_freq,) long."""
    if len(section) != 3 or sum(section) != n_freq:
        raise UnsupportedModelError(f"mrope_section {list(section)} does not cover {n_freq} rotary frequencies")
    return torch.repeat_interleave(torch.arange(3), torch.tensor(list(section)))


def interleaved_axes(section: Sequence[int], n_freq: int) -> torch.Tensor:
    """Axis of each rotary frequency for interleaved M-RoPE (Qwen3-VL): h at 1, 4, ... below
    ``3 * section[1]``, w at 2, 5, ... below ``3 * section[2]``, t everywhere else. (n_freq,) long."""
    if len(section) != 3 or sum(section) != n_freq:
        raise UnsupportedModelError(f"mrope_section {list(section)} does not cover {n_freq} rotary frequencies")
    axes = torch.zeros(n_freq, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * int(section[axis]) : 3] = axis
    return axes


@dataclass(frozen=True, slots=True)
class MRopeSpec(RopeSpec):
    """A :class:`RopeSpec` whose angles follow M-RoPE's per-axis positions.

    ``axes``: (rotary_dim // 2,) long, the axis (0 t, 1 h, 2 w) of each rotary frequency. ``deltas``: the
    (T, 3) per-token axis offsets of the run of tokens this spec is bound to (:meth:`bind`), or None (all
    zero: plain 1-D angles, as for text).
    """

    axes: torch.Tensor | None = None
    deltas: torch.Tensor | None = None

    @staticmethod
    def of(spec: RopeSpec, axes: torch.Tensor) -> MRopeSpec:
        """``spec``'s frequencies and layout, with M-RoPE's frequency-to-axis map ``axes``."""
        if axes.shape != (spec.rotary_dim // 2,):
            raise UnsupportedModelError(f"M-RoPE axis map {tuple(axes.shape)} != ({spec.rotary_dim // 2},)")
        return MRopeSpec(spec.inv_freq, spec.rotary_dim, spec.head_dim, spec.rope_type, spec.style, axes.to(torch.long))

    def bind(self, deltas: torch.Tensor | None) -> MRopeSpec:
        """This spec for a run of tokens with axis offsets ``deltas`` (T, 3)."""
        return dataclasses.replace(self, deltas=deltas)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Float32 angles ``fl32((p + delta_axis(i)) * inv_freq_i)`` per token and frequency, in float64.

        positions: (T,) int linear positions -> (T, rotary_dim // 2) float64.
        """
        if self.deltas is None or self.axes is None:
            return RopeSpec.angles(self, positions)
        if self.deltas.shape != (positions.shape[0], 3):
            raise InvalidInputError(f"deltas {tuple(self.deltas.shape)} do not match {positions.shape[0]} positions")
        per_axis = positions.to(torch.long)[:, None] + self.deltas.to(positions.device, torch.long)  # (T, 3)
        pos = per_axis[:, self.axes.to(positions.device)].to(torch.float32)  # (T, rotary_dim // 2)
        return (pos * self.inv_freq.to(pos.device, torch.float32)[None, :]).to(torch.float64)

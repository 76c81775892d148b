"""Exact RoPE relocation (core paper §3, appendix A).

RoPE rotates each pair of key features ``(x_i, x_{i+r/2})`` by the angle ``p * inv_freq_i``. Rotations
compose, ``R(a) R(b) = R(a + b)``, so moving a key from position ``p0`` to ``p1`` is one rotation by
``angle(p1) - angle(p0)``: no forward pass, values untouched.

Exactness against re-prefill: transformers computes the angle in float32 (``fl32(p * inv_freq)``) and
rotates with ``cos/sin`` of that float32 angle. We reproduce those float32 angles, take their
difference in float64 and rotate in float64, so a relocated key differs from a key prefilled at the
target position only by float rounding of the key itself (about one ulp), at any distance.

Kamera stores keys *position-free*: rotated to angle 0 (every token "at position 0"). A placement is
then a single rotation from 0 to the target, never a chain of rotations.

Two rotation arithmetics serve a placement from the position-free frame (``ROTATIONS``):

* ``"exact"`` (the default for float32 KV): the rotation computed in float64 (reference) or float32
  (serving) and rounded once to the KV dtype: within one ulp of the exact rotation of the stored key.
* ``"model"`` (the default for bf16 / fp16 KV with pre-RoPE canonicals, ``Engine.default_rotation``): the
  model's own arithmetic in the KV dtype, as transformers' ``apply_rotary_pos_emb`` does
  it: cos/sin of the float32 angle taken in float32 and cast to the KV dtype, then ``k cos + rot(k) sin``
  with every product and the sum rounded to the KV dtype. On a canonical holding the model's pre-RoPE
  key it writes the bits a prefill at the target writes; it is itself up to ~2 ulps from the exact
  rotation on a 16-bit KV (docs/gpu.md, "bf16 and fp16").

Attention scaling (yarn's ``mscale``, longrope's factor) multiplies cos and sin inside the model: the
stored key already carries it once, so relocation rotates by pure angles and never rescales again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidInputError, UnsupportedModelError

#: RoPE variants whose angles depend on position only (not on the sequence length): relocation is exact.
EXACT_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """What relocation needs to know about a model's rotary embedding.

    ``inv_freq`` is float32 ``(rotary_dim // 2,)`` exactly as the model uses it; ``rotary_dim`` may be
    smaller than ``head_dim`` (partial rotary: the remaining features pass through unrotated);
    ``style`` is ``"half"`` (pairs ``i, i + r/2``, the transformers default) or ``"interleaved"``
    (pairs ``2i, 2i + 1``).
    """

    inv_freq: torch.Tensor
    rotary_dim: int
    head_dim: int
    rope_type: str = "default"
    style: str = "half"

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Float32 angles exactly as transformers computes them, returned in float64.

        positions: (T,) int -> (T, rotary_dim // 2) float64.
        """
        pos = positions.to(torch.float32)
        # on the positions' device (as ``MRopeSpec``): KV moved to a GPU carries its positions there, while the
        # spec's inv_freq is kept in host memory; one float32 product is rounded the same on either
        return (pos[:, None] * self.inv_freq.to(pos.device, torch.float32)[None, :]).to(torch.float64)


def check_rope_type(model_name: str, rope_type: str) -> None:
    """Refuse RoPE variants whose rotation is not a function of position alone."""
    if rope_type not in EXACT_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{model_name}: RoPE scaling type {rope_type!r} is not supported: its angles depend on the "
            f"sequence length, so relocation cannot be exact. Supported: {sorted(EXACT_ROPE_TYPES)}."
        )


def _as_positions(positions: torch.Tensor | int | range, n: int) -> torch.Tensor:
    if isinstance(positions, int):
        return torch.arange(positions, positions + n)
    if isinstance(positions, range):
        positions = torch.tensor(list(positions), dtype=torch.long)
    if positions.ndim != 1 or positions.shape[0] != n:
        raise InvalidInputError(f"positions must have shape ({n},), got {tuple(positions.shape)}")
    return positions.to(torch.long)


def rotation_table(
    spec: RopeSpec,
    target: torch.Tensor | None,
    source: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of ``angle(target) - angle(source)`` per token: (T, rotary_dim // 2) each.

    ``None`` (source or target) means position-free: every rotary pair at angle 0.
    """
    if target is None and source is None:
        raise InvalidInputError("rotation_table needs a target or a source")
    if target is None:
        ang = -spec.angles(source)  # type: ignore[arg-type]
    else:
        ang = spec.angles(target)
        if source is not None:
            ang = ang - spec.angles(source)
    cos, sin = torch.cos(ang), torch.sin(ang)
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def rotate_keys(
    keys: torch.Tensor,
    spec: RopeSpec,
    target: torch.Tensor | int | None,
    source: torch.Tensor | int | None = None,
    *,
    exact: bool = True,
) -> torch.Tensor:
    """Rotate keys from ``source`` positions to ``target`` positions (``None``: position-free).

    keys: (..., T, H, D) with the token axis third from the end (Kamera's token-major layout).
    Returns a new tensor of the same dtype. ``exact=True`` rotates in float64 (reference quality);
    ``exact=False`` rotates in the key dtype (the fast serving path, error ~1 ulp of the dtype), except
    for 16-bit keys, which rotate in float32 and are rounded once (see :func:`work_dtype`).
    """
    n = keys.shape[-3]
    tgt = None if target is None else _as_positions(target, n)
    src = None if source is None else _as_positions(source, n)
    work = torch.float64 if exact else work_dtype(keys.dtype)
    cos, sin = rotation_table(spec, tgt, src, dtype=work, device=keys.device)
    out = keys.to(work).clone()
    apply_rotation_(out, cos, sin, spec)
    return out.to(keys.dtype)


#: rotation arithmetics for a placement from the position-free frame (module docstring)
ROTATIONS = ("exact", "model")


def check_rotation(rotation: str) -> str:
    """``rotation`` if it names one of :data:`ROTATIONS`, else a clear error."""
    if rotation not in ROTATIONS:
        raise InvalidInputError(f"rotation must be one of {', '.join(ROTATIONS)}, got {rotation!r}")
    return rotation


def model_rotation_table(
    spec: RopeSpec, target: torch.Tensor, *, dtype: torch.dtype, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the angles of ``target`` (T,) as a transformers model computes them for its own RoPE: the
    float32 angle, ``cos``/``sin`` in float32 on ``device``, cast to ``dtype``. (T, rotary_dim // 2) each.

    Pure angles: a yarn / longrope attention scaling is carried once by the stored key, never applied again.
    """
    ang = spec.angles(target).to(device=device, dtype=torch.float32)  # float32 values, exactly representable
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def rotate_like_model(keys: torch.Tensor, spec: RopeSpec, target: torch.Tensor | int) -> torch.Tensor:
    """Rotate position-free ``keys`` (..., T, H, D) to ``target`` with the model's own arithmetic
    (``rotation="model"``): in the key dtype, every operation rounded as ``apply_rotary_pos_emb`` rounds it.

    Bit for bit the keys a forward at ``target`` writes, when ``keys`` are that forward's pre-RoPE keys and
    the model scales no angle (``attention_scaling == 1``).
    """
    tgt = _as_positions(target, keys.shape[-3])
    cos, sin = model_rotation_table(spec, tgt, dtype=keys.dtype, device=keys.device)
    return apply_model_rotation(keys, cos, sin, spec)


def apply_model_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """``x`` (..., T, H, D) rotated by ``cos``/``sin`` (T, rotary_dim // 2) in ``x``'s dtype, op by op as
    transformers does it: ``x1 c + (-x2) s`` and ``x2 c + x1 s``, each product and sum rounded. A new tensor;
    the features past the rotary band are carried bit for bit."""
    r = spec.rotary_dim
    c = cos[:, None, :]  # (T, 1, r/2): broadcast over heads
    s = sin[:, None, :]
    if spec.style == "half":
        x1, x2 = x[..., : r // 2], x[..., r // 2 : r]
    elif spec.style == "interleaved":
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
    else:  # pragma: no cover - adapters validate the style
        raise UnsupportedModelError(f"unknown rope style {spec.style!r}")
    o1 = (x1 * c) + ((-x2) * s)
    o2 = (x2 * c) + (x1 * s)
    out = x.clone()
    if spec.style == "half":
        out[..., : r // 2] = o1
        out[..., r // 2 : r] = o2
    else:
        out[..., 0:r:2] = o1
        out[..., 1:r:2] = o2
    return out


#: 16-bit KV dtypes: arithmetic on them runs in float32 and rounds once to the dtype at the end
HALF_DTYPES = frozenset({torch.bfloat16, torch.float16})


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the serving path computes a ``dtype`` KV in: float32 for bf16 / fp16, else ``dtype``.

    bf16 has 8 significant bits: a rotation computed in bf16 rounds cos and sin, both products and the
    sum (several ulps off); computed in float32 and rounded once it is within one bf16 ulp of the exact
    rotation of the same stored key.
    """
    return torch.float32 if dtype in HALF_DTYPES else dtype


def apply_rotation_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """In-place rotation of ``x`` (..., T, H, D) by per-token cos/sin tables (T, rotary_dim // 2)."""
    r = spec.rotary_dim
    h = r // 2
    c = cos[:, None, :]  # (T, 1, r/2): broadcast over heads
    s = sin[:, None, :]
    if spec.style == "half":
        x1 = x[..., :h]
        x2 = x[..., h:r]
    elif spec.style == "interleaved":
        x1 = x[..., 0:r:2]
        x2 = x[..., 1:r:2]
    else:  # pragma: no cover - adapters validate the style
        raise UnsupportedModelError(f"unknown rope style {spec.style!r}")
    x1_old = x1.clone()
    # (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
    x1.mul_(c).addcmul_(x2, s, value=-1.0)
    x2.mul_(c).addcmul_(x1_old, s)
    return x

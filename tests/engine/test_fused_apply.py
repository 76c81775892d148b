"""The fused CPU kernel (engine/csrc/kamera_apply.c) computes what torch's path computes, for every shape
its code paths split on; its build is cached; KAMERA_KERNEL is honoured with clear errors."""

from __future__ import annotations

import pytest
import torch

from kamera_engine import KV, InvalidInputError, KernelBuildError, Patch
from kamera_engine import fused_apply as fused
from kamera_engine.operator import apply_patch, reconstruct
from kamera_engine.rope import RopeSpec

# (layers, tokens, heads, head_dim, rotary_dim, style): tokens not a multiple of the 4-row block;
# H*D = 32 (16-wide blocks only), 80 (a 64-wide block + a 16-wide one), 72 (64 + an 8-feature tail,
# rows not 64-byte aligned: buffered path), 128 and 192 with head_dim 64 (the register-rotation path).
SHAPES = [
    (3, 37, 2, 16, 16, "half"),
    (2, 21, 5, 16, 16, "interleaved"),
    (2, 9, 3, 24, 16, "half"),  # partial rotary: features 16..23 pass through
    (2, 6, 3, 24, 8, "interleaved"),
    (1, 3, 1, 8, 8, "half"),  # fewer rows than one block
    (2, 13, 2, 64, 64, "half"),  # head_dim 64: rotated in registers, streamed straight out
    (2, 10, 3, 64, 32, "half"),  # head_dim 64, partial rotary: rotated from the row buffer
]


@pytest.fixture(autouse=True)
def _fresh_kernel_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "_lib", None)
    monkeypatch.setattr(fused, "_why_not", None)


def _case(layers: int, tokens: int, heads: int, dim: int, rot: int, style: str, patched: tuple[int, ...], rank: int):
    g = torch.Generator().manual_seed(tokens * 31 + dim)
    keys = torch.randn(layers, tokens, heads, dim, generator=g)
    values = torch.randn(layers, tokens, heads, dim, generator=g)
    f = heads * dim
    n = len(patched)
    patch = Patch(
        torch.randn(n, tokens, rank, generator=g),
        torch.randn(n, rank, f, generator=g) * 0.1,
        torch.randn(n, tokens, rank, generator=g),
        torch.randn(n, rank, f, generator=g) * 0.1,
        patched,
    )
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    spec = RopeSpec(inv_freq, rot, dim, style=style)
    return KV(keys, values, None), patch, spec


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + s[5])
@pytest.mark.parametrize("with_patch", [True, False], ids=["patch", "relocate"])
def test_kernel_matches_torch_path(shape: tuple, with_patch: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    layers = shape[0]
    patched = tuple(range(0, layers, 2)) if layers > 1 else (0,)  # unpatched layers in between
    canonical, patch, spec = _case(*shape, patched=patched, rank=5)
    p = patch if with_patch else None
    monkeypatch.setenv("KAMERA_KERNEL", "torch")
    ref = apply_patch(canonical, p, spec, 3000)
    monkeypatch.setenv("KAMERA_KERNEL", "c")
    assert fused.usable(canonical.keys) and fused.status() == "c"
    got = apply_patch(canonical, p, spec, 3000)
    assert torch.equal(got.positions, ref.positions)
    # same float32 arithmetic, different summation order: a few ulps of the magnitudes involved
    assert (got.keys - ref.keys).abs().max().item() <= 1e-5 * max(1.0, ref.keys.abs().max().item())
    assert (got.values - ref.values).abs().max().item() <= 1e-5 * max(1.0, ref.values.abs().max().item())
    # the unrotated tail of partial rotary is copied bit for bit when nothing is patched
    if not with_patch and shape[4] < shape[3]:
        assert torch.equal(got.keys[..., shape[4] :], canonical.keys[..., shape[4] :])
        assert torch.equal(got.values, canonical.values)


def test_reconstruct_and_preallocated_out_match(monkeypatch: pytest.MonkeyPatch) -> None:
    canonical, patch, spec = _case(3, 37, 2, 16, 16, "half", patched=(1, 2), rank=4)
    monkeypatch.setenv("KAMERA_KERNEL", "torch")
    ref_free = reconstruct(canonical, patch)
    ref = apply_patch(canonical, patch, spec, 17)
    monkeypatch.setenv("KAMERA_KERNEL", "c")
    free = reconstruct(canonical, patch)
    assert free.is_free
    assert (free.keys - ref_free.keys).abs().max().item() <= 1e-5
    assert (free.values - ref_free.values).abs().max().item() <= 1e-5
    out = KV(torch.full_like(canonical.keys, float("nan")), torch.full_like(canonical.values, float("nan")))
    got = apply_patch(canonical, patch, spec, 17, out=out)
    assert got.keys.data_ptr() == out.keys.data_ptr()
    assert (got.keys - ref.keys).abs().max().item() <= 1e-5
    assert (got.values - ref.values).abs().max().item() <= 1e-5


def test_bfloat16_factors_are_widened(monkeypatch: pytest.MonkeyPatch) -> None:
    canonical, patch, spec = _case(2, 12, 2, 16, 16, "half", patched=(0, 1), rank=3)
    low = Patch(*(t.to(torch.bfloat16) for t in (patch.k_u, patch.k_vt, patch.v_u, patch.v_vt)), patch.layers)
    monkeypatch.setenv("KAMERA_KERNEL", "torch")
    ref = apply_patch(canonical, low, spec, 5)
    monkeypatch.setenv("KAMERA_KERNEL", "c")
    got = apply_patch(canonical, low, spec, 5)
    assert (got.keys - ref.keys).abs().max().item() <= 1e-5


def test_build_is_cached(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("KAMERA_HOME", str(tmp_path))
    cc = fused._compiler()
    assert cc is not None, "the machine's C compiler is part of the supported set-up"
    first = fused._build(cc)
    stamp = first.stat().st_mtime_ns
    assert fused._build(cc) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]  # no temporary left behind


def test_missing_compiler_is_a_clear_error_or_a_logged_fallback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "kamera-no-such-compiler")
    monkeypatch.setenv("KAMERA_KERNEL", "c")
    with pytest.raises(KernelBuildError, match="kamera-no-such-compiler"):
        fused.library()
    monkeypatch.setenv("KAMERA_KERNEL", "auto")
    with caplog.at_level("WARNING", logger="kamera"):
        assert fused.library() is None
    assert "using torch's path" in caplog.text
    assert fused.status().startswith("torch (no C compiler found")
    canonical, patch, spec = _case(2, 12, 2, 16, 16, "half", patched=(0,), rank=3)
    assert apply_patch(canonical, patch, spec, 5).keys.shape == canonical.keys.shape  # still served


def test_bad_kernel_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAMERA_KERNEL", "fast")
    with pytest.raises(InvalidInputError, match="KAMERA_KERNEL='fast'"):
        fused.mode()


def test_torch_choice_never_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAMERA_KERNEL", "torch")
    monkeypatch.setenv("CC", "kamera-no-such-compiler")
    assert fused.library() is None and fused.status() == "torch"

"""``kamera bench gpu``: the GPU suite in one go, kept as ``docs/results/gpu-<device>.json``.

On a CUDA machine (``pip install 'kamera[gpu]'`` brings Triton and flash-attn) this runs, on the first
CUDA device: the Triton kernels against torch's float64 reference on that device (every rope style,
bf16, in ulps), the operator benchmark and the window trace on the loaded model, and the operator speed
sweep on the three realistic shapes at full depth (random weights: timing only). Without CUDA it
refuses before loading anything: nothing here may pretend a CPU is a GPU.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kamera_engine import KV, Engine, InvalidInputError, KameraError, Patch, RopeSpec, apply_patch

from ..console import err
from . import operator, window

SHAPES = ("llama-3.1-8b", "qwen2.5-7b", "qwen2.5-vl-7b")
RESULTS_DIR = Path("docs") / "results"


def preflight() -> None:
    """Refuse clearly on a machine without CUDA (before any model is loaded)."""
    if not torch.cuda.is_available():
        raise InvalidInputError(
            "kamera bench gpu needs a CUDA device and torch built with CUDA (torch.cuda.is_available() is False); "
            "on a GPU machine: pip install 'kamera[gpu]' and run it there (docs/gpu.md)"
        )


def device_slug(name: str) -> str:
    """A file-name-safe device name: ``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"


def kernel_check(device: torch.device, tokens: int = 512) -> dict[str, Any]:
    """The Triton placement kernel vs torch's float64 path on the same bf16 inputs, per rope style: the max error
    in bf16 ulps at the magnitude of its key or value row (one token's head: a rotation and a patch mix a row's
    features, so a feature that cancels to near zero is not judged by its own tiny ulp), and the fraction of
    features within one ulp of their own value."""
    from kamera_engine.kernels import place

    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    for name, (heads, dim, rot, style) in {
        "half": (8, 128, 128, "half"),
        "interleaved": (8, 128, 128, "interleaved"),
        "partial": (8, 128, 64, "half"),
    }.items():
        keys = torch.randn(4, tokens, heads, dim, generator=g)
        values = torch.randn(4, tokens, heads, dim, generator=g)
        f = heads * dim
        patch = Patch(
            torch.randn(4, tokens, 32, generator=g),
            torch.randn(4, 32, f, generator=g) * 0.05,
            torch.randn(4, tokens, 32, generator=g),
            torch.randn(4, 32, f, generator=g) * 0.05,
            (0, 1, 2, 3),
        )
        spec = RopeSpec(1.0 / (500000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)), rot, dim, style=style)
        can = KV(keys.to(device, torch.bfloat16), values.to(device, torch.bfloat16), None)
        # the reference starts from the kernel's own inputs (the bf16 canonical): a float32 canonical's rounding
        # to bf16 is no error of the kernel
        can64 = KV(can.keys.cpu().double(), can.values.cpu().double(), None)
        ref = apply_patch(can64, _double(patch), spec, 4000, exact=True)
        dst = KV(torch.empty_like(can.keys), torch.empty_like(can.values))
        place.place_chunk(can, patch.to(device), spec, torch.arange(4000, 4000 + tokens), dst)
        worst, within, total = 0.0, 0, 0
        for got, want in ((dst.keys, ref.keys), (dst.values, ref.values)):
            want16 = want.to(torch.bfloat16).double()
            err, mag = (got.cpu().double() - want16).abs(), want16.abs()
            worst = max(worst, (err / _bf16_ulp(mag.amax(dim=-1, keepdim=True))).max().item())
            within += int((err <= _bf16_ulp(mag)).sum())
            total += err.numel()
        out[name] = {"max_err_bf16_row_ulp": worst, "within_one_ulp": within / total}
    return out


def _bf16_ulp(magnitude: torch.Tensor) -> torch.Tensor:
    """One bfloat16 ulp at each magnitude (8 significant bits; the smallest normal's below it)."""
    return torch.exp2(torch.floor(torch.log2(magnitude.clamp_min(torch.finfo(torch.bfloat16).tiny))) - 7)


def _factors(p: Patch) -> tuple[torch.Tensor, ...]:
    return (p.k_u, p.k_vt, p.v_u, p.v_vt)


def _double(p: Patch) -> Patch:
    return Patch(*(t.double() for t in _factors(p)), p.layers)


def run(engine: Engine, *, quick: bool = False, results_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """The suite, written to ``gpu-<device>.partial.json`` after every section, so a run cut short (a GPU lent
    by the minute) keeps what finished, and renamed ``gpu-<device>.json`` once every section has passed, so an
    earlier complete result is replaced only by another. A section that raises is recorded under ``failed``
    and the others still run; the run then raises ``KameraError`` naming them and the partial file."""
    preflight()
    if engine.device.type != "cuda":
        raise InvalidInputError(f"kamera bench gpu runs on CUDA; the engine is on {engine.device} (drop --device cpu)")
    from kamera_engine.kernels import dispatch
    from kamera_engine.shapes import random_engine

    name = torch.cuda.get_device_name(engine.device)
    started = time.time()
    path = results_dir / f"gpu-{device_slug(name)}.json"
    partial = path.with_suffix(".partial.json")
    result: dict[str, Any] = {
        "device_name": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu_kernels": dispatch.status(engine.device),
        "quick": quick,
        "failed": {},
    }
    err.print(f"[bold]gpu[/] suite on {name}")

    def shape(shape_name: str) -> dict[str, Any]:
        big = random_engine(shape_name, 4 if quick else None, device=engine.device, dtype=engine.dtype)
        try:
            return operator.run_shape(big, shape_name, quick=quick)
        finally:
            del big
            torch.cuda.empty_cache()

    sections: list[tuple[tuple[str, ...], Callable[[], Any]]] = [
        (("kernels",), lambda: kernel_check(engine.device)),
        (("operator",), lambda: operator.run(engine, quick=quick)),
        (("window",), lambda: window.run(engine, quick=quick)),
    ]
    sections += [(("shapes", s), (lambda s=s: shape(s))) for s in SHAPES]
    for where, section in sections:
        label = "/".join(where)
        try:
            value = section()
        except Exception as exc:  # recorded; the rest still runs, and the run fails at the end
            result["failed"][label] = f"{type(exc).__name__}: {exc}"
            err.print(f"[red]gpu suite: {label} failed[/]: {type(exc).__name__}: {exc}")
        else:
            slot = result
            for key in where[:-1]:
                slot = slot.setdefault(key, {})
            slot[where[-1]] = value
        result["wall_s"] = time.time() - started
        _write(partial, result)
    if result["failed"]:
        raise KameraError(
            f"kamera bench gpu: {len(result['failed'])} section(s) failed ({', '.join(result['failed'])}); "
            f"the others are in {partial}"
        )
    partial.replace(path)
    result["written_to"] = str(path)
    return result


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)

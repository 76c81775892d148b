"""Mechanics check of the operator on image chunks: relocation error, blind vs patched KL.

``python -m kamera_engine.vision.mechanics [--families ...] [--json]`` builds each tiny random VLM
(``tiny.py``), loads it through ``from_pretrained`` and measures, for image chunks:

* ``relocation_max_abs_err``: a canonical relocated to position ``d`` against the same chunk
  prefilled (after the same anchor) at ``d``, max over keys and values, per target distance. Beyond
  layer 0 this includes the prefill's own float32 drift with absolute position (attention rounds
  differently at ``d``), the same for text tokens;
* ``rotation_max_abs_err``: the same comparison on layer 0 only, whose pre-RoPE keys do not depend on
  position: the relocation against transformers' own RoPE at ``d`` (per-axis angles on M-RoPE);
* ``survivor_max_abs_err``: an image chunk's conditioned KV (after another image) relocated by ``d``
  against the whole run prefilled ``d`` later;
* ``full_rank_max_abs_err``: a full-rank patch against the conditioned KV;
* ``blind_kl`` / ``patch_kl`` {rank}: next-token KL(re-prefill || reuse) over a window
  ``[anchor, image A, image B]`` with B served blind (relocated canonical) or patched.

On random weights these are mechanics checks; fidelity on trained weights is measured on the default
model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..kv import KV
from .engine import VisionEngine

DISTANCES = (37, 300, 1000, 4000, 30000)


def noise_image(seed: int, size: tuple[int, int] = (100, 80)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def _register(engine: VisionEngine, seed: int, size: tuple[int, int] = (100, 80)) -> list[int]:
    return engine.register_image(noise_image(seed, size), f"noise-{seed}-{size}").token_ids


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum())


def _maxerr(a: KV, b: KV, layers: slice = slice(None)) -> float:
    return max(
        (a.keys[layers] - b.keys[layers]).abs().max().item(), (a.values[layers] - b.values[layers]).abs().max().item()
    )


def measure(engine: VisionEngine, ranks: tuple[int, ...] = (4, 32)) -> dict[str, Any]:
    anchor = engine.anchor_ids
    a_ids, b_ids = _register(engine, 1), _register(engine, 2)
    q_ids = engine.tokenize("Question: w3 w4 w5")
    out: dict[str, Any] = {"chunk_tokens": len(b_ids)}
    for name in ("relocation_max_abs_err", "rotation_max_abs_err", "survivor_max_abs_err"):
        out[name] = {}
    can_b = engine.canonical(b_ids)
    full = anchor + a_ids + b_ids
    limit = engine.context_length
    distances = [d for d in DISTANCES if limit is None or d + len(full) <= limit]  # references stay in context
    out["distances"] = distances
    for d in distances:
        ref = engine.forward(anchor + b_ids, None, d, logits="none").kv.slice(len(anchor), len(anchor) + len(b_ids))
        placed = engine.apply(can_b, None, d + len(anchor), exact=True)
        out["relocation_max_abs_err"][d] = _maxerr(placed, ref)
        out["rotation_max_abs_err"][d] = _maxerr(placed, ref, slice(0, 1))
    start_b = len(anchor) + len(a_ids)
    ref_run = engine.forward(full, None, 0, logits="none").kv
    cond_b = ref_run.slice(start_b, len(full))
    for d in distances:
        moved = engine.forward(full, None, d, logits="none").kv.slice(start_b, len(full))
        out["survivor_max_abs_err"][d] = _maxerr(engine.relocate(cond_b, start_b + d), moved)
    full_rank = engine.form_patch(cond_b, can_b, rank=len(b_ids))
    out["full_rank_max_abs_err"] = _maxerr(engine.apply(can_b, full_rank, start_b, exact=True), cond_b)
    lp_ref = engine.next_token_logprobs(ref_run, q_ids, len(full))
    head = ref_run.slice(0, start_b)
    blind = KV.cat([head, engine.apply(can_b, None, start_b)])
    out["blind_kl"] = _kl(lp_ref, engine.next_token_logprobs(blind, q_ids, len(full)))
    out["patch_kl"] = {}
    for r in ranks:
        patch = engine.form_patch(cond_b, can_b, rank=r)
        served = KV.cat([head, engine.apply(can_b, patch, start_b)])
        out["patch_kl"][r] = _kl(lp_ref, engine.next_token_logprobs(served, q_ids, len(full)))
    out["key_features"] = engine.num_kv_heads * engine.key_dim
    out["tower_runs"] = engine.tower_runs
    return out


def tiny_engine(family: str, directory: str | None = None, **kw: Any) -> VisionEngine:
    """Build and load a tiny random VLM of ``family`` (anchor: the tokenizer's ``<|im_start|> user``)."""
    from .tiny import build_tiny_vlm

    path = build_tiny_vlm(family, directory or tempfile.mkdtemp(prefix=f"kamera-tiny-{family}-"))
    engine = VisionEngine.load(path, device="cpu", dtype="float32", attn="sdpa", **kw)
    return engine


def main(argv: list[str] | None = None) -> int:
    from .tiny import BUILDERS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=sorted(BUILDERS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report = {}
    for fam in args.families:
        print(f"measuring {fam}...", file=sys.stderr)
        report[fam] = measure(tiny_engine(fam))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for fam, r in report.items():
            reloc = max(r["relocation_max_abs_err"].values())
            rot = max(r["rotation_max_abs_err"].values())
            surv = max(r["survivor_max_abs_err"].values())
            print(
                f"{fam:12s} tokens={r['chunk_tokens']:3d} reloc={reloc:.2e} rotation={rot:.2e} survivor={surv:.2e}"
                f" full_rank={r['full_rank_max_abs_err']:.2e} blind_kl={r['blind_kl']:.3e} "
                + " ".join(f"r{k}_kl={v:.3e}" for k, v in r["patch_kl"].items())
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

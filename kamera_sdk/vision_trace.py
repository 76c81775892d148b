"""A scripted sliding-window trace over images and text on a VLM engine, run by ``kamera`` and
``recompute`` side by side: vision-tower runs per distinct image, tokens prefilled, next-token KL.

    python -m kamera_sdk.vision_trace [--families qwen2_vl llava ...] [--steps 20]

Without ``--model`` each family is a tiny random VLM (``kamera_engine.vision.tiny``): a mechanics check.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

import torch

from kamera_engine.vision import VisionEngine
from kamera_engine.vision.mechanics import noise_image

from .window import ContextWindow


def run_trace(engine: VisionEngine, steps: int = 20, *, seed: int = 0, images: int = 6) -> dict[str, Any]:
    """``steps`` steps: images (drawn with repeats from ``images`` distinct ones) and text arrive, a token
    budget slides the oldest chunks out, and every third step recalls an evicted chunk. Each step asks
    for the next-token distribution on both windows."""
    rng = random.Random(seed)
    pool = [noise_image(1000 + i, (100, 80)) for i in range(images)]
    prompt = engine.prompt_ids("Question: w3 w4 w5")
    runs0 = engine.tower_runs
    probe = ContextWindow(engine)
    image_tokens = probe.chunk(probe.add_image(pool[0])).__len__()  # registers pool[0] (one tower run)
    budget = 3 * image_tokens  # about three images: the window slides on every family
    kam = ContextWindow(engine, rank=32, budget_tokens=budget)
    rec = ContextWindow(engine, policy="recompute", budget_tokens=budget)
    seen: set[int] = {0}
    kls, recalls = [], 0
    for step in range(steps):
        if step % 3 == 2 and kam.evicted:
            cid = rng.choice(kam.evicted)
            kam.recall(cid)
            rec.recall(cid)
            recalls += 1
        elif step % 4 == 3:
            text = f"w{step} w{step + 1} w{step + 2}"
            kam.add_text(text)
            rec.add_text(text)
        else:
            i = rng.randrange(images)
            seen.add(i)
            kam.add_image(pool[i])
            rec.add_image(pool[i])
        assert kam.chunks == rec.chunks
        p, q = rec.next_token_logprobs(prompt), kam.next_token_logprobs(prompt)
        kls.append(float((p.exp() * (p - q)).sum()))
    ks, rs = kam.stats(), rec.stats()
    runs = engine.tower_runs - runs0
    return {
        "steps": steps,
        "image_tokens": image_tokens,
        "budget_tokens": budget,
        "distinct_images": len(seen),
        "vision_tower_runs": runs,
        "tower_runs_per_distinct_image": runs / max(1, len(seen)),
        "recalls": recalls,
        "slides": ks.timings["slide"].count if "slide" in ks.timings else 0,
        "kamera_tokens_prefilled": ks.tokens_prefilled,
        "recompute_tokens_prefilled": rs.tokens_prefilled,
        "kl_mean": sum(kls) / len(kls),
        "kl_max": max(kls),
        "patches_formed": ks.patches_formed,
        "patches_reused": ks.patches_reused,
        "survivors_rotated": ks.survivors_rotated,
    }


def main(argv: list[str] | None = None) -> int:
    from kamera_engine.vision.mechanics import tiny_engine
    from kamera_engine.vision.tiny import BUILDERS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=sorted(BUILDERS))
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    out = {}
    for fam in args.families:
        print(f"trace on tiny {fam} ...", file=sys.stderr)
        torch.manual_seed(0)
        out[fam] = run_trace(tiny_engine(fam), args.steps)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Relocation against a 16-bit prefill, per layer, in ulps of the KV dtype (docs/gpu.md, "bf16 and fp16").

For each model: a chunk's canonical is prefilled alone at position 0 and made position-free, two ways
(``Engine.canonical_source``): from the keys the forward handed RoPE (``"pre_rope"``, the default) and by
un-rotating the keys it wrote (``"unrotation"``); the same chunk is prefilled alone at each target ``p`` (no
other context, so its pre-RoPE keys differ from the canonical forward's only by rounding in deeper layers;
at layer 0 they are identical). Per layer it reports the distance between the keys that prefill writes and:

* ``exact``: the un-rotated canonical relocated to ``p`` with ``rotation="exact"`` (float32, rounded once);
* ``model``: the un-rotated canonical relocated with ``rotation="model"`` (the model's own bf16 arithmetic);
* ``pre_rope_canonical_exact`` / ``pre_rope_canonical_model``: the stored canonical from the pre-RoPE
  capture (what ``Engine.canonical`` returns), relocated by ``Engine.apply`` with each rotation;
* ``model_on_pre_rope``: ``rotation="model"`` applied to the canonical forward's pre-RoPE keys (a canonical
  that stored them bit for bit), which isolates the rotation from the canonical's own rounding;
* ``exact_on_pre_rope``: the default rotation on those pre-RoPE keys;

plus ``pre_rope``: the distance between the two forwards' pre-RoPE keys (the noise floor of deeper layers).
Distances are over the rotary band: ``max_row_ulps`` / ``mean_row_ulps`` in ulps of the dtype at the largest
magnitude of the key row (per token and head: a rotation's rounding scales with the pair it mixes, so a
feature near zero is not judged by its own tiny ulp), and ``bit_equal``, the fraction of features with the
same bits. ``summary`` gives layer 0 and the worst / mean over deeper layers.

Run from the repository root:

    python scripts/bf16_ulp.py --out docs/results/bf16-ulp-cpu.json      # --quick: tiny models only

``--window-steps N`` adds the window trace of ``kamera bench window`` (first N steps) on the default model,
a ``kamera`` window against a ``recompute`` one, once per rotation, with the default (pre-RoPE) canonicals
(about 7 minutes per rotation at N=8 on two busy CPU cores).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kamera_engine import Engine
from kamera_engine.adapters.base import capture_pre_rope_keys
from kamera_engine.rope import rotate_keys, rotate_like_model
from tests.conftest import TINY_CONFIGS, random_ids, tiny_model

TARGETS = (37, 1000, 4000)  # within every tiny model's sliding window
MANTISSA = {torch.bfloat16: 7, torch.float16: 10}


def ordinal(x: torch.Tensor) -> torch.Tensor:
    """Integers that count representable 16-bit values: adjacent values differ by 1, +0 and -0 are equal."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Representable values of the dtype between ``a`` and ``b``, elementwise (0: the same value)."""
    return (ordinal(a) - ordinal(b)).abs()


def row_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in ulps of the dtype at each row's largest magnitude (rows: the last axis)."""
    mag = want.double().abs().amax(-1, keepdim=True).clamp_min(torch.finfo(want.dtype).tiny)
    unit = torch.exp2(torch.floor(torch.log2(mag)) - MANTISSA[want.dtype])
    return (got.double() - want.double()).abs() / unit


def summary(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """Distances of ``got`` from ``want`` (T, H, r), in ulps of the dtype."""
    row = row_ulps(got, want)
    return {
        "max_row_ulps": round(row.max().item(), 3),
        "mean_row_ulps": round(row.mean().item(), 4),
        "bit_equal": round((ulps(got, want) == 0).double().mean().item(), 4),
    }


def kl(want: torch.Tensor, got: torch.Tensor) -> float:
    """KL(want || got) of two next-token log-probability vectors, in nats."""
    return float((want.exp() * (want - got)).sum().item())


def _pre_rope(captured: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    return [k[0, :, -n:, :].transpose(0, 1).contiguous() for k in captured]  # (T, H, D) per layer


def measure(engine: Engine, ids: list[int]) -> dict[str, object]:
    """Per-layer distances for one engine and chunk, at every target (worst over the targets)."""
    spec, r, n = engine.rope, engine.rope.rotary_dim, len(ids)
    with capture_pre_rope_keys(engine.model) as pre:
        captured = engine.canonical(ids, anchored=False)
    pre_can = _pre_rope(pre, n)
    engine.canonical_source = "unrotation"
    can = engine.canonical(ids, anchored=False)
    engine.canonical_source = "pre_rope"
    layers: list[dict[str, dict[str, float]]] = [{} for _ in range(engine.num_layers)]
    modes = ("exact", "model", "pre_rope_canonical_exact", "pre_rope_canonical_model")
    kls: dict[str, list[float]] = {mode: [] for mode in modes}
    prompt = ids[:8]
    for target in TARGETS:
        ref = torch.log_softmax(engine.forward(ids + prompt, None, target).logits[-1].float(), -1)
        with capture_pre_rope_keys(engine.model) as pre:
            prefill = engine.forward(ids, None, target, logits="none").kv.keys.to("cpu")
        pre_tgt = _pre_rope(pre, n)
        exact = engine.apply(can, None, target, rotation="exact").keys
        model = engine.apply(can, None, target, rotation="model").keys
        cap_exact = engine.apply(captured, None, target, rotation="exact").keys
        cap_model = engine.apply(captured, None, target, rotation="model").keys
        for mode in kls:
            source, rotation = (captured, mode.rsplit("_", 1)[1]) if mode.startswith("pre_rope") else (can, mode)
            placed = engine.apply(source, None, target, rotation=rotation)
            kls[mode].append(kl(ref, engine.next_token_logprobs(placed, prompt, target + n)))
        for layer in range(engine.num_layers):
            want = prefill[layer][..., :r]
            same = ulps(pre_can[layer], pre_tgt[layer]).amax(-1) == 0  # (T, H): pre-RoPE key rows that agree
            rows = {
                "exact": summary(exact[layer][..., :r], want),
                "model": summary(model[layer][..., :r], want),
                "pre_rope_canonical_exact": summary(cap_exact[layer][..., :r], want),
                "pre_rope_canonical_model": summary(cap_model[layer][..., :r], want),
                "model_on_pre_rope": summary(rotate_like_model(pre_can[layer], spec, target)[..., :r], want),
                "exact_on_pre_rope": summary(rotate_keys(pre_can[layer], spec, target, exact=False)[..., :r], want),
                "pre_rope": summary(pre_can[layer][..., :r], pre_tgt[layer][..., :r]),
                "prefill_vs_exact_rotation": summary(
                    rotate_keys(pre_tgt[layer].double(), spec, target).to(want.dtype)[..., :r], want
                ),
            }
            rows["pre_rope"]["rows_equal"] = round(same.double().mean().item(), 4)
            for key, row in rows.items():
                old = layers[layer].get(key)
                layers[layer][key] = row if old is None else _worst(old, row)
    deep = layers[1:]
    overview = {
        key: {
            "layer0_max_row_ulps": layers[0][key]["max_row_ulps"],
            "layer0_mean_row_ulps": layers[0][key]["mean_row_ulps"],
            "layer0_bit_equal": layers[0][key]["bit_equal"],
            "deeper_max_row_ulps": max(x[key]["max_row_ulps"] for x in deep) if deep else None,
            "deeper_mean_row_ulps": round(sum(x[key]["mean_row_ulps"] for x in deep) / len(deep), 4) if deep else None,
        }
        for key in layers[0]
    }
    return {
        "summary": overview,
        "rope_style": spec.style,
        "rope_type": spec.rope_type,
        "rotary_dim": r,
        "head_dim": spec.head_dim,
        "canonical_source": engine.canonical_source,
        "default_rotation": engine.rotation,
        "attention_scaling": float(getattr(engine.adapter.rotary_module(engine.model), "attention_scaling", 1.0)),
        "tokens": n,
        "targets": list(TARGETS),
        "window_kl": {mode: {"mean": sum(v) / len(v), "max": max(v)} for mode, v in kls.items()},
        "layers": layers,
    }


def _worst(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """The worse of two targets' summaries, key by key (``bit_equal``, ``rows_equal``: the smaller)."""
    return {k: min(a[k], b[k]) if k in ("bit_equal", "rows_equal") else max(a[k], b[k]) for k in a}


def window_trace(steps: int, dtype: torch.dtype) -> dict[str, object]:
    """Next-token KL of a ``kamera`` window to a ``recompute`` window, per rotation (the default model)."""
    from kamera_sdk.bench.window import build_trace, run_trace

    out: dict[str, object] = {"steps": steps}
    for rotation in ("exact", "model"):
        engine = Engine.load(device="cpu", dtype=dtype)
        engine.rotation = rotation
        arm = run_trace(engine, build_trace(steps=steps), ("recompute", "kamera"))["kamera"]
        keys = ("kl_mean", "kl_max", "answers_equal_recompute", "kl_mean_by_kind")
        out[rotation] = {k: arm[k] for k in keys}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    parser.add_argument("--quick", action="store_true", help="tiny models only (no default model)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--window-steps", type=int, default=0, help="also run the window trace, per rotation")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    models: dict[str, object] = {}
    for name in sorted(TINY_CONFIGS):
        engine = Engine(tiny_model(name).to(dtype), None, name=f"tiny-{name}", anchor_ids=[])
        models[f"tiny-{name}"] = measure(engine, random_ids(24, seed=2))
    if not args.quick:
        engine = Engine.load(device="cpu", dtype=dtype)
        text = (
            "The position-free cache stores each chunk's keys at angle zero and rotates them into place when a "
            "window is assembled, so a chunk computed once is served at any offset without a forward pass."
        )
        models[engine.name] = measure(engine, engine.tokenize(text))
    result: dict[str, object] = {
        "dtype": args.dtype,
        "machine": f"{platform.machine()} cpu, torch {torch.__version__}",
        "command": " ".join(["python scripts/bf16_ulp.py", *(argv if argv is not None else sys.argv[1:])]),
        "models": models,
    }
    if args.window_steps:
        result["window_trace"] = window_trace(args.window_steps, dtype)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

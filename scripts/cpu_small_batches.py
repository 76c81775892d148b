"""What small batches cost on this CPU (docs/batching.md, "Canonicals in steps, the anchor once, patches on
one thread"): the figures behind the serve benchmark's ratio at 8 sessions.

Everything here runs on BLAS's linears (``Engine.load(linear="native")``): it measured MKL, before the
packed linears (``engine/packed_linear.py``), which need no filler token and no column head.

* ``decode_step_s``: one batched decode step of B rows (B in 1 to 5, 7, 8, 11, 13, 15, 16), each a window of
  ``--past`` tokens in the decode slab, on the default model: best of 5, as the scheduler runs it (a step of
  3, 7, 11 or 15 tokens with its filler token, ``batch.packed_length``); ``decode_step_s_plain``: the same
  without the filler;
* ``lm_head_ms``: the LM head's GEMM for B rows, as ``h @ W^T`` (what ``nn.Linear`` runs) and as
  ``(W @ h^T)^T``: MKL runs 2 or 3 rows as matrix-vector products;
* ``eigh_s``: 30 eigh of 192 x 192 matrices (a patch's per-layer factorisation on the default model)
  with MKL's threads and inside ``threads.lapack_on_one_thread()``, each alone and beside a thread that
  keeps one core busy (as the model thread does in a server).

Run from the repository root (about a minute on two cores; keep the machine otherwise idle):

    OMP_NUM_THREADS=2 python scripts/cpu_small_batches.py --out docs/results/cpu-small-batches.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kamera_engine import Engine
from kamera_engine.batch import DecodeSlab, Row, RowCache, batched_forward
from kamera_engine.threads import lapack_on_one_thread
from kamera_sdk.bench.metrics import timed_result

ROWS = (1, 2, 3, 4, 5, 7, 8, 11, 13, 15, 16)


def best(fn: Callable[[], object], repeat: int = 5) -> float:
    """The least of ``repeat`` timings after one warm-up run (noise only ever adds time)."""
    return timed_result(fn, repeat=repeat, warmup=1, reduce=min)[0]


def decode_steps(engine: Engine, past_tokens: int, rounds: int = 5) -> dict[str, dict[str, float]]:
    """Per row count, the least of ``rounds`` timings of a decode step with the filler (``filled``, as the
    scheduler runs it) and without (``plain``), the two timed alternately so that drift hits both."""
    ids = [int(t) % engine.vocab_size for t in range(100, 100 + past_tokens)]
    past = engine.forward(ids, None, 0, logits="none").kv
    out: dict[str, dict[str, float]] = {"filled": {}, "plain": {}}
    for b in ROWS:
        caches = [RowCache.from_past(past, engine.num_layers, reserve=2) for _ in range(b)]
        slab = DecodeSlab()
        for c in caches:
            slab.admit(c, past_tokens + 2)
        marks = [c.mark() for c in caches]

        def step(fill: bool, caches: list[RowCache] = caches, marks: list[list[int]] = marks) -> None:
            for c, m in zip(caches, marks, strict=True):
                c.rollback(m)
            batched_forward(engine.model, [Row.at(c, [5], past_tokens) for c in caches], fill=fill)

        times: dict[str, list[float]] = {"filled": [], "plain": []}
        step(True)
        step(False)
        for _ in range(rounds):
            for arm in times:
                times[arm].append(timed_result(lambda arm=arm: step(arm == "filled"), repeat=1, warmup=0)[0])
        for arm, ts in times.items():
            out[arm][str(b)] = min(ts)
    return out


def lm_head(engine: Engine) -> dict[str, dict[str, float]]:
    weight = engine.model.get_output_embeddings().weight.detach()
    out: dict[str, dict[str, float]] = {"h_wt": {}, "w_ht": {}}
    with torch.inference_mode():
        for b in ROWS:
            h = torch.randn(b, weight.shape[1], dtype=weight.dtype)
            out["h_wt"][str(b)] = 1e3 * best(lambda h=h: torch.nn.functional.linear(h, weight), 10)
            out["w_ht"][str(b)] = 1e3 * best(lambda h=h: torch.mm(weight, h.t()).t(), 10)
    return out


def eigh_times() -> dict[str, float]:
    g = torch.randn(30, 192, 57, dtype=torch.float64)
    gram = (g @ g.transpose(1, 2)).to(torch.float32)

    def thirty() -> None:
        for i in range(gram.shape[0]):
            torch.linalg.eigh(gram[i])

    def one_thread() -> None:
        with lapack_on_one_thread():
            thirty()

    out = {"mkl_threads_alone": best(thirty, 3), "one_thread_alone": best(one_thread, 3)}
    # one core kept busy by another process, as a server's model thread keeps it
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        out["mkl_threads_beside_busy_core"] = best(thirty, 3)
        out["one_thread_beside_busy_core"] = best(one_thread, 3)
    finally:
        spinner.kill()
        spinner.wait()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--past", type=int, default=300, help="tokens of each decode row's window")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args()
    engine = Engine.load(linear="native")
    steps = decode_steps(engine, args.past)
    result = {
        "model": engine.name,
        "threads": torch.get_num_threads(),
        "past_tokens": args.past,
        "decode_step_s": steps["filled"],
        "decode_step_s_plain": steps["plain"],
        "lm_head_ms": lm_head(engine),
        "eigh_s": eigh_times(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

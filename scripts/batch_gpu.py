"""Batching on a GPU (docs/batching.md, "On a GPU"): the scheduler's batched steps against one request at a
time, on random-weight models of real shapes (timing only: random weights never measure fidelity).

Per shape (``--shape``, default ``smollm2-135m`` and ``llama-3.1-8b``, bfloat16 on the first CUDA device):

* ``decode_step_ms``: one decode step of 1, 8 and 32 rows (windows of ``--past`` tokens) in the decode slab
  as the scheduler runs it, and the single path's decode step (``decode.step_logits`` on a transformers
  cache, as the one-at-a-time server runs it); ``decode_speedup``: B single steps over one step of B rows;
* ``serve``: N requests (N in 1, 8, 32; each a prompt of ``--prompt`` tokens after its own past of
  ``--past``, ``--new`` tokens greedy) submitted together to a ``Scheduler`` driven on a thread of its own,
  against the same requests through ``Engine.generate_ids`` one after another: tokens/s each way and their
  ratio, batch sizes, and how many requests' tokens equal their one-at-a-time tokens (bfloat16 GEMMs round
  by batch shape, and random weights put many logits within a rounding of each other: a count, not a check;
  the float32 equality is ``KAMERA_TEST_DEVICE=cuda pytest tests/engine/test_batch*.py``);
* ``driver_thread``: 8 of those requests stepped by the calling thread three times, by a fresh thread each
  time (twice), and three times by one new thread: what a thread's first run of the step shapes costs; with the
  slab's key lengths in buckets (``batch.KEY_BUCKET_DEVICES``, the default) and, as ``driver_thread_exact``, without;
* ``served_ab``: the batched arm alone of 8 requests, key lengths in buckets against exact, alternating
  (``--ab-rounds`` rounds, the order swapped every round), each run on a fresh scheduler thread: tokens/s;
* ``step_kernels``: the GPU kernels of one slab decode step of 8 rows, most time first (which attention
  backend SDPA picked).

Each time is the least of ``--repeat`` runs after a warm-up, with the device synchronised. Run on a GPU:

    python scripts/batch_gpu.py --out docs/results/batch-gpu-nvidia-h200.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from kamera_engine import batch
from kamera_engine.decode import SamplingParams, step_logits
from kamera_engine.scheduler import Scheduler
from kamera_engine.shapes import random_engine
from kamera_sdk.bench.serve import repeated_decode_step


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _best(fn: Callable[[], object], repeat: int) -> float:
    fn()
    _sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return [(1000 + 7919 * seed + 31 * t) % vocab for t in range(n)]


def decode_steps(engine: Any, past_tokens: int, repeat: int) -> dict[str, Any]:
    vocab = engine.vocab_size
    res = engine.forward(_ids(past_tokens, 0, vocab), None, 0, logits="last")
    past = res.kv
    out = {str(b): _best(repeated_decode_step(engine, past, past_tokens, b), repeat) * 1e3 for b in (1, 8, 32)}
    cache = res.cache

    def single() -> None:
        step_logits(engine.model, cache, 5, past_tokens, engine.device)
        cache.crop(-1)

    one = _best(single, repeat) * 1e3
    return {
        "decode_step_ms": {**out, "single": one},
        "decode_speedup": {b: int(b) * one / ms for b, ms in out.items()},
    }


def step_kernels(engine: Any, past_tokens: int, rows: int = 8, top: int = 12) -> list[dict[str, Any]]:
    """The GPU kernels of one slab decode step of ``rows`` rows, most time first: which backend SDPA ran."""
    from torch.profiler import ProfilerActivity, profile

    past = engine.forward(_ids(past_tokens, 0, engine.vocab_size), None, 0, logits="none").kv
    step = repeated_decode_step(engine, past, past_tokens, rows)
    step()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        _sync()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    return [{"kernel": e.key[:160], "calls": e.count, "us": e.device_time_total} for e in events[:top]]


@contextmanager
def _exact_key_lengths() -> Iterator[None]:
    """The slab's decode rows attend exactly their longest row's keys (no buckets) inside the block."""
    kept = batch.KEY_BUCKET_DEVICES
    batch.KEY_BUCKET_DEVICES = frozenset()
    try:
        yield
    finally:
        batch.KEY_BUCKET_DEVICES = kept


def _requests(engine: Any, n: int, past_tokens: int, prompt_tokens: int) -> tuple[list[Any], list[list[int]]]:
    """``n`` requests' pasts (prefilled) and prompts, each its own tokens."""
    vocab = engine.vocab_size
    pasts = [engine.forward(_ids(past_tokens, 10 + i, vocab), None, 0, logits="none").kv for i in range(n)]
    return pasts, [_ids(prompt_tokens, 100 + i, vocab) for i in range(n)]


def _greedy(engine: Any, new_tokens: int) -> SamplingParams:
    """``new_tokens`` greedy tokens that no id ends early."""
    return SamplingParams(max_new_tokens=new_tokens, eos_token_ids=(engine.vocab_size + 1,))


def _scheduled(
    engine: Any, pasts: list[Any], prompts: list[list[int]], past_tokens: int, new_tokens: int
) -> tuple[list[list[int]], float, Any]:
    """The requests submitted together to a ``Scheduler`` driven on a fresh thread of its own: their greedy
    answers, the seconds until the last one ended, and the scheduler's stats."""
    sched = Scheduler(engine)
    sched.start()
    try:
        _sync()
        t0 = time.perf_counter()
        reqs = [
            sched.submit(p, q, past_tokens, _greedy(engine, new_tokens)) for p, q in zip(pasts, prompts, strict=True)
        ]
        answers = [list(r) for r in reqs]
        _sync()
        seconds = time.perf_counter() - t0
    finally:
        sched.stop()
    return answers, seconds, sched.stats()


def serve(engine: Any, n: int, past_tokens: int, prompt_tokens: int, new_tokens: int) -> dict[str, Any]:
    pasts, prompts = _requests(engine, n, past_tokens, prompt_tokens)
    _sync()
    t0 = time.perf_counter()
    alone = [
        list(engine.generate_ids(pasts[i], prompts[i], past_tokens, _greedy(engine, new_tokens))) for i in range(n)
    ]
    _sync()
    sequential_s = time.perf_counter() - t0

    batched, batched_s, stats = _scheduled(engine, pasts, prompts, past_tokens, new_tokens)
    tokens = sum(len(t) for t in batched)
    return {
        "requests": n,
        "tokens": tokens,
        "batched_tokens_per_s": tokens / batched_s,
        "sequential_tokens_per_s": sum(len(t) for t in alone) / sequential_s,
        "throughput_ratio": sequential_s / batched_s * tokens / max(1, sum(len(t) for t in alone)),
        "batch_mean": stats.batch_mean,
        "batch_max": stats.batch_max,
        "same_tokens": sum(a == b for a, b in zip(alone, batched, strict=True)),
    }


def served_ab(
    engine: Any, n: int, rounds: int, past_tokens: int, prompt_tokens: int, new_tokens: int
) -> dict[str, Any]:
    """Tokens/s of ``n`` requests through a fresh ``Scheduler`` thread each run, the slab's key lengths in buckets
    (the default) against exact, alternating, the order swapped every round (the first round pays the warm-up)."""
    pasts, prompts = _requests(engine, n, past_tokens, prompt_tokens)

    def once() -> float:
        answers, seconds, _ = _scheduled(engine, pasts, prompts, past_tokens, new_tokens)
        return sum(len(a) for a in answers) / seconds

    out: dict[str, list[float]] = {"bucketed": [], "exact": []}
    for r in range(rounds):
        for mode in ("bucketed", "exact") if r % 2 == 0 else ("exact", "bucketed"):
            with _exact_key_lengths() if mode == "exact" else nullcontext():
                out[mode].append(once())
    return {"requests": n, "tokens_per_s": out}


def driver_threads(engine: Any, n: int, past_tokens: int, prompt_tokens: int, new_tokens: int) -> dict[str, Any]:
    """Seconds for the same ``n`` requests stepped by the calling thread (``Request`` iteration drives the
    scheduler), three times; by a fresh thread each time, twice; and three times by one new thread: a thread's
    first run of the step shapes against its later runs."""
    pasts, prompts = _requests(engine, n, past_tokens, prompt_tokens)

    def once() -> float:
        sched = Scheduler(engine)
        params = [_greedy(engine, new_tokens) for _ in range(n)]
        _sync()
        t0 = time.perf_counter()
        reqs = [sched.submit(pasts[i], prompts[i], past_tokens, params[i]) for i in range(n)]
        for r in reqs:
            list(r)
        _sync()
        return time.perf_counter() - t0

    def on_thread(runs: int) -> list[float]:
        out: list[float] = []
        t = threading.Thread(target=lambda: out.extend(once() for _ in range(runs)))
        t.start()
        t.join()
        return out

    return {
        "calling_thread_s": [once() for _ in range(3)],
        "fresh_thread_s": [on_thread(1)[0] for _ in range(2)],
        "one_new_thread_s": on_thread(3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", help="shape name (repeatable; default smollm2-135m, llama-3.1-8b)")
    ap.add_argument("--past", type=int, default=300)
    ap.add_argument("--prompt", type=int, default=80)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--serve", default="1,8,32", help="the serve part's request counts, comma-separated")
    ap.add_argument(
        "--serve-exact", default="", help="request counts served again with exact key lengths (served_ab is the A/B)"
    )
    ap.add_argument("--no-driver-thread", action="store_true", help="skip the driver-thread part")
    ap.add_argument("--ab-rounds", type=int, default=4, help="rounds of the served A/B (0: skip it)")
    ap.add_argument("--layers", type=int, help="the shapes' first N layers only (a quick check)")
    ap.add_argument("--device", default="cuda", help="cuda (the figures); cpu only checks that the script runs")
    ap.add_argument("--dtype", help="default: bfloat16 on CUDA, float32 on a CPU")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("scripts/batch_gpu.py needs a CUDA device (torch.cuda.is_available() is False)")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "past_tokens": args.past,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "shapes": {},
    }
    for name in args.shape or ["smollm2-135m", "llama-3.1-8b"]:
        engine = random_engine(name, args.layers, device=args.device, dtype=args.dtype)
        with torch.inference_mode():
            entry = decode_steps(engine, args.past, args.repeat)
            if args.device == "cuda":
                entry["step_kernels"] = step_kernels(engine, args.past)
                print(name, "step kernels", json.dumps(entry["step_kernels"]), flush=True)
        entry["serve"] = {}
        for n in (int(x) for x in args.serve.split(",")):
            entry["serve"][str(n)] = serve(engine, n, args.past, args.prompt, args.new)
            print(name, n, json.dumps(entry["serve"][str(n)]), flush=True)
        entry["serve_exact"] = {}
        for n in (int(x) for x in args.serve_exact.split(",") if x):
            with _exact_key_lengths():
                entry["serve_exact"][str(n)] = serve(engine, n, args.past, args.prompt, args.new)
            print(name, n, "exact key lengths", json.dumps(entry["serve_exact"][str(n)]), flush=True)
        if args.ab_rounds:
            entry["served_ab"] = served_ab(engine, 8, args.ab_rounds, args.past, args.prompt, args.new)
            print(name, "served A/B", json.dumps(entry["served_ab"]), flush=True)
        if not args.no_driver_thread:
            entry["driver_thread"] = driver_threads(engine, 8, args.past, args.prompt, args.new)
            print(name, "driver thread", json.dumps(entry["driver_thread"]), flush=True)
            with _exact_key_lengths():
                entry["driver_thread_exact"] = driver_threads(engine, 8, args.past, args.prompt, args.new)
            print(name, "driver thread, exact key lengths", json.dumps(entry["driver_thread_exact"]), flush=True)
        entry["model"] = engine.name
        entry["dtype"] = str(engine.dtype)
        result["shapes"][name] = entry
        print(name, json.dumps({k: v for k, v in entry.items() if k != "serve"}), flush=True)
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

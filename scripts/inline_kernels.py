"""What running a forward's small kernels inline saves on this CPU (docs/batching.md, "Small kernels inline,
big ones on the pool"): the default model's forwards timed with their small kernels inline (the default:
``threads.small_kernels_inline``, linears and attention on the pool) and with the pool everywhere (before), the
two alternated in one process so that the machine's drift hits both, each result checked to be the same to the
bit.

* ``batched``: steps as the serve benchmark's server runs them, decode rows of windows of 150 to 250 tokens in a
  decode slab with asks (78 tokens after a 136-token window) and pages (57 tokens after the 24-token anchor);
* ``single``: ``run_forward`` (the unbatched path) of a page, an ask and a 300-token prompt, and of 512 tokens
  (past :data:`kamera_engine.batch.INLINE_MAX_ELEMENTS`: the pool everywhere either way).

Each entry: ``pool_ms`` and ``inline_ms`` (least and median of ``--repeat`` alternated timings), ``same``.
Run from the repository root (about four minutes on two cores; keep the machine otherwise idle):

    OMP_NUM_THREADS=2 python scripts/inline_kernels.py --out docs/results/inline-kernels-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kamera_engine.batch as batch
from kamera_engine import Engine
from kamera_engine.batch import DecodeSlab, Row, RowCache, batched_forward
from kamera_engine.runner import run_forward

_INLINE = batch.inlines_small_kernels


def _mode(inline: bool) -> None:
    batch.inlines_small_kernels = _INLINE if inline else (lambda model, tokens: False)  # type: ignore[assignment]


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in _flat(x)]
    return []


def _compare(run: Callable[[], Any], repeat: int) -> dict[str, Any]:
    """``run`` pool-everywhere and inline, alternated ``repeat`` times after a warm-up each."""
    results, times = {}, {False: [], True: []}
    for inline in (False, True):
        _mode(inline)
        results[inline] = _flat(run())
    for _ in range(repeat):
        for inline in (False, True):
            _mode(inline)
            t0 = time.perf_counter()
            run()
            times[inline].append((time.perf_counter() - t0) * 1000)
    _mode(True)
    same = len(results[False]) == len(results[True]) and all(
        torch.equal(a, b) for a, b in zip(results[False], results[True], strict=True)
    )

    def stats(v: list[float]) -> dict[str, float]:
        return {"min": round(min(v), 1), "median": round(statistics.median(v), 1)}

    return {"pool_ms": stats(times[False]), "inline_ms": stats(times[True]), "same": same}


def batched_steps(engine: Engine, repeat: int) -> dict[str, Any]:
    ids = [int(t) % engine.vocab_size for t in range(100, 700)]
    lens = (150, 170, 190, 200, 210, 220, 230, 250)
    slab = DecodeSlab()
    decodes = []
    for n in lens:
        cache = RowCache.from_past(engine.forward(ids[:n], None, 0, logits="none").kv, engine.num_layers, reserve=2)
        slab.admit(cache, 300)
        decodes.append(cache)
    window = engine.forward(ids[:136], None, 0, logits="none").kv
    anchor = engine.forward(ids[:24], None, 0, logits="none").kv
    asks = [RowCache.from_past(window, engine.num_layers, reserve=78) for _ in range(3)]
    pages = [RowCache.from_past(anchor, engine.num_layers, reserve=57) for _ in range(3)]
    marks = [c.mark() for c in (*decodes, *asks, *pages)]

    def step(b: int, a: int, p: int) -> Callable[[], Any]:
        def run() -> Any:
            for c, m in zip((*decodes, *asks, *pages), marks, strict=True):
                c.rollback(m)
            rows = [Row.at(c, [5], len(c)) for c in decodes[:b]]
            rows += [Row.at(asks[i], ids[200 + i : 278 + i], 136) for i in range(a)]
            rows += [Row.at(pages[i], ids[300 + i : 357 + i], 24, logits="none") for i in range(p)]
            out = batched_forward(engine.model, rows)
            new = [c.kv(136, 214, None) for c in asks[:a]] + [c.kv(24, 81, None) for c in pages[:p]]
            return [out, [(x.keys, x.values) for x in new]]

        return run

    cases = {"8 decodes": (8, 0, 0), "7 decodes + 1 page": (7, 0, 1), "7 decodes + 1 ask": (7, 1, 0)}
    cases |= {"6 decodes + 1 ask + 1 page": (6, 1, 1), "5 decodes + 2 asks + 2 pages": (5, 2, 2)}
    return {name: _compare(step(*shape), repeat) for name, shape in cases.items()}


def single_forwards(engine: Engine, repeat: int) -> dict[str, Any]:
    ids = [int(t) % engine.vocab_size for t in range(100, 1000)]
    anchor = engine.forward(ids[:24], None, 0, logits="none").kv
    window = engine.forward(ids[:136], None, 0, logits="none").kv

    def forward(past: Any, n: int, start: int) -> Callable[[], Any]:
        def run() -> Any:
            res = run_forward(engine.model, torch.tensor(ids[300 : 300 + n]), past, start)
            return [res.logits, res.kv.keys, res.kv.values]

        return run

    cases = {"page: 57 after 24": (anchor, 57, 24), "ask: 78 after 136": (window, 78, 136)}
    cases |= {"prompt: 300": (None, 300, 0), "prompt: 512": (None, 512, 0)}
    return {name: _compare(forward(*case), repeat) for name, case in cases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="alternated timings per case (default: 10)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args()
    engine = Engine.load()
    result = {
        "threads": torch.get_num_threads(),
        "inline_max_elements": batch.INLINE_MAX_ELEMENTS,
        "batched": batched_steps(engine, args.repeat),
        "single": single_forwards(engine, args.repeat),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

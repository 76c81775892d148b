"""The serve loop's 8-session batched arm with follow-on answers on and off (``Scheduler.follow_ons``),
alternated in one process: tokens/s and the median time to first token of each run, as JSON.

    OMP_NUM_THREADS=2 python scripts/follow_on_ab.py [pairs] [sessions]

The default model, on loopback (``kamera_sdk.bench.serve``'s loop: add a page, ask, slide; 6 rounds, answers up
to 48 tokens). Alternating the order within each pair spreads a drifting host's load over both settings.
"""

from __future__ import annotations

import json
import statistics
import sys

import kamera_engine  # noqa: F401  (before torch: the engine's thread settings)
from kamera_engine import Engine
from kamera_engine.scheduler import Scheduler
from kamera_sdk.bench.serve import arm


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    sessions = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    engine = Engine.load()
    arm(engine, 2, True, 2, 8)  # warm-up
    runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for i in range(pairs):
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            Scheduler.follow_ons = mode == "on"
            r = arm(engine, sessions, True, 6, 48)
            runs[mode].append({"tokens_per_s": r["tokens_per_s"], "ttft_p50_s": r["ttft_p50_s"], "p95_s": r["p95_s"]})
            print(mode, json.dumps(runs[mode][-1]), file=sys.stderr, flush=True)
    Scheduler.follow_ons = True
    summary = {
        m: {k: statistics.median(run[k] for run in rs) for k in ("tokens_per_s", "ttft_p50_s", "p95_s")}
        for m, rs in runs.items()
    }
    print(json.dumps({"sessions": sessions, "runs": runs, "median": summary}, indent=1))


if __name__ == "__main__":
    main()

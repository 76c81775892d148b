"""``kamera bench serve`` one session count at a time, each count's result written as soon as it ends:

    python scripts/serve_counts.py [--device cuda] [--out DIR] [--quick] [COUNT ...]   # default counts: 1 8 32

The same loop and figures as ``kamera bench serve --json`` (``kamera_sdk.bench.serve.run``), for a machine lent
for a few minutes at a time (a GPU): a run cut short keeps the counts that finished, as
``DIR/serve-<device>-<count>.json``. Progress and each count's ratio go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import kamera_engine  # noqa: F401  (before torch: the engine's thread settings)
from kamera_engine import Engine
from kamera_sdk.bench import serve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("counts", nargs="*", type=int, default=[1, 8, 32])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    t0 = time.perf_counter()
    engine = Engine.load(device=args.device)
    loaded = time.perf_counter() - t0
    print(f"{engine.name} on {engine.device} ({engine.dtype}), loaded in {loaded:.1f} s", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    for n in args.counts:
        t = time.perf_counter()
        result = serve.run(engine, quick=args.quick, counts=(n,))
        result["wall_s"] = time.perf_counter() - t
        path = args.out / f"serve-{engine.device.type}-{n}.json"
        path.write_text(json.dumps(result, indent=1))
        arms = result["sessions"][str(n)]
        print(
            f"{n} sessions: {result['throughput_ratio'][str(n)]:.2f}x "
            f"({arms['batched']['tokens_per_s']:.1f} / {arms['sequential']['tokens_per_s']:.1f} tok/s), "
            f"{result['wall_s']:.0f} s -> {path}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()

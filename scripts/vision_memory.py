"""What a vision engine holds per distinct screenshot, with and without the vision cache's memory bound, as JSON.

    python scripts/vision_memory.py [screenshots] [width] [height]

Registers ``screenshots`` distinct noise screenshots (100 of 1280x800 by default) on a tiny random Qwen2-VL
(built on the fly, no download; its processor given a real one's budget, so a screenshot is 1260 feature rows)
in a fresh process each, first with ``vision_memory_bytes=None`` (every tower output kept in memory) and then with a
bound of 8 MiB, and reports for each the RSS growth over the registrations, the bytes of tower rows the memory
tier holds, the entries moved to disk and the tower runs; and the bytes of one screenshot's processed pixels,
which the engine kept per picture before it dropped them after the tower's run. A real VLM's rows are 24 times
wider (hidden 1536 on Qwen2-VL-2B against 64 here); the bound, not the model, sets what stays in memory.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
from typing import Any

from kamera_engine.vision.mechanics import noise_image, tiny_engine
from kamera_sdk.bench.serve import rss_bytes


def run(bound: int | None, n: int, size: tuple[int, int], where: str) -> dict[str, Any]:
    engine = tiny_engine("qwen2_vl", where, vision_memory_bytes=bound)
    engine.processor.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": size[0] * size[1]}
    engine.register_image(noise_image(0, size), "warm-up")  # the processor and tower's first-call allocations
    gc.collect()
    before = rss_bytes() or 0
    rows = 0
    for i in range(n):
        rows += engine.register_image(noise_image(1000 + i, size), f"shot-{i}").rows
    gc.collect()
    after = rss_bytes() or 0
    stats = engine.vision_cache.stats
    pixels = engine.family.prepare_image(noise_image(0, size)).tower["pixel_values"]
    return {
        "vision_memory_bytes": bound,
        "screenshots": n,
        "feature_rows_per_screenshot": rows / n,
        "pixel_bytes_per_screenshot": pixels.numel() * pixels.element_size(),
        "rss_growth_bytes": after - before,
        "rss_growth_per_screenshot_bytes": (after - before) / n,
        "memory_tier_bytes": stats.bytes,
        "memory_tier_entries": stats.entries,
        "spilled": stats.spilled,
        "tower_runs": stats.tower_runs,
    }


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:  # one engine in this process: --one BOUND N W H DIR
        bound = None if argv[1] == "none" else int(argv[1])
        print(json.dumps(run(bound, int(argv[2]), (int(argv[3]), int(argv[4])), argv[5])))
        return
    n = argv[0] if argv else "100"
    w, h = (argv[1], argv[2]) if len(argv) > 2 else ("1280", "800")
    where = tempfile.mkdtemp(prefix="kamera-vision-memory-")
    report = []
    for bound in ("none", str(8 << 20)):
        out = subprocess.run([sys.executable, __file__, "--one", bound, n, w, h, where], capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr)
        report.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])

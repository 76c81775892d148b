"""What a batched server's memory holds while its sessions run, on the default model, as JSON.

    OMP_NUM_THREADS=2 python scripts/serve_memory.py [sessions] [at_s]

Runs the serve loop's batched arm in process (``kamera_sdk.bench.serve.arm``: ``sessions`` sessions, 6 rounds,
answers up to 48 tokens; 32 and 45 s by default) and, ``at_s`` seconds into it, counts the live CPU tensors: each
storage once, grouped by its size and its tensor's shape, the largest groups first, with the process's RSS at that
moment. Also: RSS after loading, the peak RSS, the model's parameter bytes and the scheduler's peak KV
(``kv_bytes_peak``). Run it with ``MALLOC_ARENA_MAX=2`` to see what the C allocator's per-thread arenas add.
"""

from __future__ import annotations

import collections
import gc
import json
import resource
import sys
import threading
import time
from typing import Any

import kamera_engine  # noqa: F401  (before torch: the engine sets OpenMP's wait policy as torch loads)

# isort: split
import torch

from kamera_engine import Engine
from kamera_sdk.bench.serve import arm


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e9


def census(top: int | None = 20) -> dict[str, Any]:
    """The live CPU tensors' storages, each once: their bytes in all and the ``top`` largest groups (all: None) by
    size and shape (a storage's shape: that of the largest tensor over it, the first one seen among equals)."""
    sizes: dict[int, int] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    elements: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                continue
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except Exception:  # a tensor without storage (sparse) or one whose data cannot be read (a fake tensor)
            continue
        if ptr and obj.numel() > elements.get(ptr, -1):
            sizes[ptr], shapes[ptr], elements[ptr] = storage.nbytes(), tuple(obj.shape), obj.numel()
    groups: collections.Counter[tuple[float, tuple[int, ...]]] = collections.Counter()
    for ptr, n in sizes.items():
        groups[(round(n / 1e6, 1), shapes[ptr])] += 1
    largest = sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1])[:top]
    return {
        "tensor_gb": sum(sizes.values()) / 1e9,
        "storages": len(sizes),
        "rss_gb": _rss_gb(),
        "threads": threading.active_count(),
        "groups": [
            {"mb_each": mb, "shape": list(shape), "count": count, "gb": mb * count / 1e3}
            for (mb, shape), count in largest
        ],
    }


def main() -> None:
    sessions = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    at_s = float(sys.argv[2]) if len(sys.argv) > 2 else 45.0
    engine = Engine.load()
    loaded = _rss_gb()
    seen: dict[str, Any] = {}

    def later() -> None:
        time.sleep(at_s)
        seen.update(census())

    threading.Thread(target=later, daemon=True).start()
    result = arm(engine, sessions, True, 6, 48)
    print(
        json.dumps(
            {
                "sessions": sessions,
                "at_s": at_s,
                "elapsed_s": result["elapsed_s"],
                "loaded_rss_gb": loaded,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                "param_gb": sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 1e9,
                "kv_bytes_peak": result.get("kv_bytes_peak"),
                "census": seen or None,  # None: the run ended before ``at_s``
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

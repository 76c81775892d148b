"""What a batched server's memory holds while its sessions run, on the default model, as JSON.

    OMP_NUM_THREADS=2 python scripts/serve_memory.py [sessions] [at_s]

Runs the serve loop's batched arm in process (``kamera_sdk.bench.serve.arm``: ``sessions`` sessions, 6 rounds,
answers up to 48 tokens; 32 and 45 s by default) and, ``at_s`` seconds into it, counts the live CPU tensors: each
storage once, grouped by its size and its tensor's shape, the largest groups first, with the process's RSS at that
moment (oneDNN's packed weight copies have no storage to read and are not counted). Also: RSS after loading, the
peak RSS, the model's parameter bytes and the scheduler's peak KV (``kv_bytes_peak``). Run it with
``MALLOC_ARENA_MAX=2`` to see what the C allocator's per-thread arenas add, or with
``MALLOC_MMAP_THRESHOLD_=1048576`` to see what it keeps of freed buffers of 1 MB and more (an ``at_s`` past the
run's end skips the census, which costs the run some time).
"""

from __future__ import annotations

import collections
import gc
import json
import sys
import threading
import time
from typing import Any

import kamera_engine  # noqa: F401  (before torch: the engine sets OpenMP's wait policy as torch loads)

# isort: split
import torch

from kamera_engine import Engine
from kamera_sdk.bench.serve import arm, rss_bytes


def _rss_gb() -> float:
    rss = rss_bytes()
    assert rss is not None, "reads /proc/self/statm (Linux)"
    return rss / 1e9


def census(top: int | None = 20) -> dict[str, Any]:
    """The live CPU tensors' storages, each once: their bytes in all and the ``top`` largest groups (all: None) by
    size and shape (a storage's shape: that of the largest tensor over it, the first one seen among equals)."""
    storages: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # data pointer: elements, bytes, shape
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                continue
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except Exception:  # no storage to read: sparse, fake, or oneDNN's packed weights (not counted)
            continue
        if ptr and obj.numel() > storages.get(ptr, (-1,))[0]:
            storages[ptr] = (obj.numel(), storage.nbytes(), tuple(obj.shape))
    groups = collections.Counter((round(n / 1e6, 1), shape) for _, n, shape in storages.values())
    largest = sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1])[:top]
    return {
        "tensor_gb": sum(n for _, n, _ in storages.values()) / 1e9,
        "storages": len(storages),
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
                "peak_rss_gb": result["peak_rss_bytes"] / 1e9,
                "tokens_per_s": result["tokens_per_s"],
                "param_gb": sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 1e9,
                "kv_bytes_peak": result["kv_bytes_peak"],
                "census": seen or None,  # None: the run ended before ``at_s``
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

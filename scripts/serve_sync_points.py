"""The serve loop's synchronising CUDA calls, counted by the SDK or engine line that made them, as JSON:

    python scripts/serve_sync_points.py [--sessions 8] [--rounds 6] [--arm batched|sequential]

On a GPU every thread queues its kernels on the same stream, so a call that waits for the device (a copy to host
memory, ``.item()``, ``.tolist()``) from a window's thread also waits for the step the model thread has queued.
This runs one arm of ``kamera bench serve``'s loop (``kamera_sdk.bench.serve.arm``) on CUDA with
``torch.cuda.set_sync_debug_mode("warn")`` and records each warning's thread and innermost frame in ``engine/`` or
``kamera_sdk/``: the call sites to move off the model's stream, or off the device, first. CUDA only.
"""

from __future__ import annotations

import argparse
import functools
import json
import threading
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import kamera_engine  # noqa: F401  (before torch: the engine sets OpenMP's wait policy as torch loads)

# isort: split
import torch

from kamera_engine import Engine
from kamera_sdk.bench.serve import arm

#: the engine and the SDK: this checkout's engine/ and kamera_sdk/, or an installed kamera_engine/ and kamera_sdk/
#: (a wheel, as carried to a GPU machine), filed under the checkout's names; a folder merely called engine/ is not ours
_ROOT = Path(__file__).resolve().parents[1]
_TREES = {str(_ROOT / "engine"): "engine", str(_ROOT / "kamera_sdk"): "kamera_sdk"}
_PACKAGES = {"kamera_engine": "engine", "kamera_sdk": "kamera_sdk"}


@functools.cache  # a few hundred files, met again in every one of thousands of stacks
def _ours(filename: str) -> str | None:
    """``filename`` as ``engine/...`` or ``kamera_sdk/...`` when it is the engine's or the SDK's, else None."""
    for tree, label in _TREES.items():
        if filename.startswith(tree + "/"):
            return label + filename[len(tree) :]
    parts = Path(filename).parts
    for i in range(len(parts) - 2, -1, -1):  # the innermost folder so named: an installed package
        if parts[i] in _PACKAGES:
            return "/".join((_PACKAGES[parts[i]], *parts[i + 1 :]))
    return None


def _site() -> str:
    frames = [(f, p) for f in traceback.extract_stack() if (p := _ours(f.filename)) is not None]
    if not frames:
        return "(outside engine/ and kamera_sdk/)"
    f, path = frames[-1]
    return f"{path}:{f.lineno} {f.name}"


def count(engine: Engine, sessions: int, rounds: int, batch: bool, max_new_tokens: int = 48) -> dict[str, Any]:
    sites: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    lock = threading.Lock()
    shown = warnings.showwarning

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchronizing CUDA operation" not in str(message):
            shown(message, category, filename, lineno, file, line)
            return
        name = threading.current_thread().name.rstrip("0123456789-_ ")
        with lock:
            sites[_site()] += 1
            threads[name or "(unnamed)"] += 1

    warnings.showwarning = record
    warnings.filterwarnings("always", message=".*synchronizing CUDA operation.*")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        figures = arm(engine, sessions, batch, rounds, max_new_tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    answers = max(figures["answers"], 1)
    return {
        "device": torch.cuda.get_device_name(engine.device),
        "arm": "batched" if batch else "sequential",
        "sessions": sessions,
        "tokens_per_s": figures["tokens_per_s"],
        "answers": figures["answers"],
        "syncs": sum(sites.values()),
        "syncs_per_answer": sum(sites.values()) / answers,
        "by_thread": dict(threads.most_common()),
        "by_site": dict(sites.most_common(30)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--arm", choices=("batched", "sequential"), default="batched")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("serve_sync_points.py counts CUDA synchronisations: this machine has no CUDA device")
    engine = Engine.load(device="cuda")
    arm(engine, 2, args.arm == "batched", 2, 8)  # warm-up: CUDA's first kernels and the allocator's pools
    print(json.dumps(count(engine, args.sessions, args.rounds, args.arm == "batched"), indent=1))


if __name__ == "__main__":
    main()

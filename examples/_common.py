"""Shared by the examples: mirror one agent session onto a Kamera window and a baseline window, and report
what Kamera saved.

Chunk ids are content hashes, so the same id names the same chunk in both windows and every window
operation (reorder, evict, recall, slide) can be replayed on the baseline unchanged.
"""

from __future__ import annotations

import argparse
import atexit
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Literal

import kamera_sdk  # noqa: F401  (first: Kamera sets OpenMP's wait policy before torch loads, docs/quickstart.md)

# isort: split
import torch

from kamera_sdk import ChunkId, ContextWindow, Engine, WindowStats

BASELINE = "recompute"  # re-prefills the whole window on every use: what an engine without Kamera does


def arg_parser(description: str | None) -> argparse.ArgumentParser:
    """The options every example takes: ``--short`` (a few steps, for CI) and ``--device``."""
    parser = argparse.ArgumentParser(description=(description or "").strip().splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a few short steps with tiny answers (CI)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return parser


def load_engine(device: str | None = None) -> Engine:
    """The embedded default model (SmolLM2-135M-Instruct)."""
    print("loading the embedded default model ...", file=sys.stderr, flush=True)
    return Engine.load(device=device)


def scratch_dir(prefix: str) -> str:
    """A temporary directory removed when the process exits (a tiny model built for one run)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def sentences(text: str, n: int | None) -> str:
    """The first ``n`` sentences of ``text`` (all of it when ``n`` is None): short mode reads less."""
    if n is None:
        return text
    return " ".join(re.split(r"(?<=[.!?])\s+", text.strip())[:n])


class SideBySide:
    """The same session run by two windows over one engine: ``kamera`` and the ``recompute`` baseline."""

    def __init__(self, engine: Engine, **window_kwargs: Any) -> None:
        self.windows = {p: ContextWindow(engine, policy=p, **window_kwargs) for p in ("kamera", BASELINE)}
        self.wall_s = dict.fromkeys(self.windows, 0.0)
        self._asked = dict.fromkeys(self.windows, 0)

    @property
    def kamera(self) -> ContextWindow:
        return self.windows["kamera"]

    def _each(self, op: str, *args: Any, **kwargs: Any) -> list[Any]:
        results = []
        for name, win in self.windows.items():
            t0 = time.perf_counter()
            results.append(getattr(win, op)(*args, **kwargs))
            self.wall_s[name] += time.perf_counter() - t0
        return results

    # window operations, replayed on both windows
    def add_text(self, text: str) -> ChunkId:
        return self._each("add_text", text)[0]

    def add_image(self, image: Any) -> ChunkId:
        return self._each("add_image", image)[0]

    def evict(self, chunk_id: ChunkId) -> None:
        self._each("evict", chunk_id)

    def recall(self, chunk_id: ChunkId, at: int | None = None) -> None:
        self._each("recall", chunk_id, at=at)

    def reorder(self, order: Sequence[ChunkId] | Literal["auto"]) -> list[ChunkId]:
        """Reorder both windows; ``"auto"`` lets Kamera choose (the order that reuses most stored patches)."""
        if order == "auto":
            t0 = time.perf_counter()
            order = self.kamera.reorder("auto")
            self.wall_s["kamera"] += time.perf_counter() - t0
            self.windows[BASELINE].reorder(order)
            return order
        return self._each("reorder", list(order))[0]

    def slide(self, n: int = 1) -> list[ChunkId]:
        return self._each("slide", n)[0]

    @property
    def chunks(self) -> list[ChunkId]:
        return self.kamera.chunks

    @property
    def evicted(self) -> list[ChunkId]:
        return self.kamera.evicted

    def ask(self, prompt: str, max_new_tokens: int) -> str:
        """Answer on both windows; print both answers and the tokens each prefilled. Returns Kamera's."""
        self._print_plan()
        answers = self._each("generate", prompt, max_new_tokens=max_new_tokens, stop=["\n"])
        self._print_use([f"{a.strip()!r}" for a in answers])
        return str(answers[0]).strip()

    def logprobs(self, prompt: str) -> dict[str, torch.Tensor]:
        """Next-token log-probs after ``prompt`` on both windows (prints the tokens each prefilled)."""
        self._print_plan()
        lps = self._each("next_token_logprobs", prompt)
        self._print_use(["scored"] * len(lps))
        return dict(zip(self.windows, lps, strict=True))

    def _print_use(self, results: list[str]) -> None:
        parts = []
        for (name, win), result in zip(self.windows.items(), results, strict=True):
            total = win.stats().tokens_prefilled
            parts.append(f"{name}: {result} ({total - self._asked[name]} tokens prefilled)")
            self._asked[name] = total
        print("    " + "   ".join(parts))

    def _print_plan(self) -> None:
        """Where each slot's KV will come from in Kamera's window (lead, keep, survivor, patch, forward...)."""
        t0 = time.perf_counter()
        plan = self.kamera.plan()  # may form patches the next use needs: counted as Kamera's time
        self.wall_s["kamera"] += time.perf_counter() - t0
        print(f"    kamera plan: {plan.summary()}")

    def timings(self) -> str:
        """Kamera's wall time per window operation (from ``stats().timings``)."""
        t = self.kamera.stats().timings
        return ", ".join(
            f"{op} {v.total_s:.1f}s/{v.count}" for op, v in sorted(t.items(), key=lambda kv: -kv[1].total_s)
        )

    def report(self) -> None:
        """A side-by-side table of the two windows' stats, then the line saying what Kamera saved."""
        print(f"\nkamera time per operation: {self.timings()}")
        report(self.kamera.stats(), self.windows[BASELINE].stats(), self.wall_s)


def report(kamera: WindowStats, baseline: WindowStats, wall_s: dict[str, float] | None = None) -> None:
    """Print the two windows' stats side by side and the line saying what Kamera saved."""
    rows = [
        ("tokens prefilled (answering)", "tokens_prefilled"),
        ("ingest tokens (canonicals, once)", "ingest_tokens"),
        ("forward passes", "forwards"),
        ("patches formed", "patches_formed"),
        ("patches reused", "patches_reused"),
        ("survivors rotated", "survivors_rotated"),
    ]
    print(f"{'':34}{'kamera':>12}{baseline.policy:>12}")
    for label, field in rows:
        print(f"{label:34}{getattr(kamera, field):>12}{getattr(baseline, field):>12}")
    if wall_s is not None:
        print(f"{'wall time in window calls (s)':34}{wall_s['kamera']:>12.1f}{wall_s[baseline.policy]:>12.1f}")
    k, b = kamera.tokens_prefilled, baseline.tokens_prefilled
    ratio = f"{b / k:.1f}x fewer" if k else "none at all"
    print(f"Kamera saved {b - k} tokens prefilled: {k} with Kamera vs {b} with policy='{baseline.policy}' ({ratio}).")

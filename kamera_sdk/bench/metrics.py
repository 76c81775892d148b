"""Small measurement helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def kl(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> float:
    """KL(ref || other) of two next-token log-probability vectors."""
    return float((ref_logprobs.exp() * (ref_logprobs - logprobs)).sum().clamp_min(0.0))


def eta(kl_repaired: float, kl_blind: float) -> float:
    """Fraction of the blind-reuse -> re-prefill KL gap a repair closes (1 = all of it)."""
    return 1.0 - kl_repaired / kl_blind if kl_blind > 0 else 1.0


def timed(
    fn: Callable[[], object],
    repeat: int = 5,
    warmup: int = 1,
    reduce: Callable[[list[float]], float] = statistics.median,
) -> float:
    """Wall time of ``fn`` over ``repeat`` runs after ``warmup`` runs, reduced (median by default)."""
    return timed_result(fn, repeat, warmup, reduce)[0]


def timed_result(
    fn: Callable[[], T],
    repeat: int = 5,
    warmup: int = 1,
    reduce: Callable[[list[float]], float] = statistics.median,
) -> tuple[float, T]:
    """``timed``, and what the last run of ``fn`` returned (for a measured call whose output is used)."""
    for _ in range(warmup):
        fn()
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return reduce(times), out  # type: ignore[return-value]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")

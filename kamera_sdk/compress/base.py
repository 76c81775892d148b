"""The compression-policy contract: shrink an assembled window's KV under a budget, for decoding.

Compression runs after relocation, on the assembled window plus the prompt, never on a stored canonical
(merged or evicted keys would no longer be position-free). A policy is one dataclass with one method to
override (``compress``); it declares the attention statistics it needs (``stats``, read by the engine),
and may name cache rows to drop after each decode step (``after_step``). A policy sees tensors and counts
only: the engine runs the model (``Engine.prefill_with_stats``, ``decode_on``, ``score_on``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch

from kamera_engine import KV, InvalidInputError
from kamera_engine.compressed import AttentionStatsSpec, StepHook
from kamera_engine.errors import positive_int


@dataclass(slots=True)
class CompressionInput:
    """What a compression policy sees at prefill.

    ``kv``: the full cache (window + prompt) at positions 0..T-1, (L, T, H, D). ``scores``: per layer,
    per KV head, attention mass each key received from the queries the policy asked for, (L, H, T).
    ``vision``: (T,) bool, tokens of image/video chunks. ``protected``: (T,) bool, tokens that must stay
    (the observation window / the most recent tokens). ``n_queries``: how many queries the scores sum.
    """

    kv: KV
    scores: torch.Tensor
    vision: torch.Tensor
    protected: torch.Tensor
    n_queries: int
    prompt_len: int


@dataclass
class CompressionPolicy:
    """Base class. ``budget``: fraction of the cache's tokens kept (0 < budget <= 1)."""

    name: ClassVar[str] = "base"
    #: whose attention scores the keys: every query (a stats pass over the window), or the prompt's last
    #: ``observation`` queries (the default)
    stats: ClassVar[AttentionStatsSpec] = AttentionStatsSpec()
    budget: float = 0.2
    observation: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, numbers.Real) or not 0 < self.budget <= 1:
            raise InvalidInputError(f"kv_budget must be a number in (0, 1], got {self.budget!r}")
        self.budget = float(self.budget)
        self.observation = positive_int("observation", self.observation)

    def kept(self, n_tokens: int) -> int:
        """Tokens kept out of ``n_tokens`` under the budget."""
        return max(1, round(self.budget * n_tokens))

    def protected(self, n_tokens: int, n_prompt: int) -> tuple[int, str]:
        """How many of ``n_tokens`` (the window and a prompt of ``n_prompt``) this policy always keeps, and
        which: the first and last token (statistics over every query), or the prompt's last queries."""
        if self.stats.every_query:
            return min(2, n_tokens), "the first and last token"
        r = min(self.observation, n_prompt)
        return r, f"the prompt's last {r} tokens"

    def check(self, n_tokens: int, n_prompt: int) -> None:
        """Refuse a budget that cannot hold the tokens this policy always keeps (``InvalidInputError``),
        before any work: the window, its prompt and its answer stay as they were."""
        kept, (must, which) = self.kept(n_tokens), self.protected(n_tokens, n_prompt)
        if kept < must:
            raise InvalidInputError(
                f"kv_budget={self.budget:g} keeps {kept} of this window's {n_tokens} tokens, fewer than the "
                f"{must} {self.name} always keeps ({which}); raise kv_budget"
            )

    def compress(self, inp: CompressionInput) -> KV:
        raise NotImplementedError

    def after_step(self, compressed_len: int, full_len: int) -> StepHook | None:
        """A hook run after each decode step: (tokens in the cache, tokens generated so far) -> the cache
        rows to drop; None for no eviction."""
        return None


COMPRESSORS: dict[str, type[CompressionPolicy]] = {}


def register_compressor(cls: type[CompressionPolicy]) -> type[CompressionPolicy]:
    COMPRESSORS[cls.name] = cls
    return cls


def make_compressor(name: str | CompressionPolicy, budget: float | None) -> CompressionPolicy:
    if isinstance(name, CompressionPolicy):
        return name
    cls = COMPRESSORS.get(name)
    if cls is None:
        raise InvalidInputError(f"unknown compression policy {name!r}; choose one of {sorted(COMPRESSORS)}")
    if budget is None:
        raise InvalidInputError(f"compress={name!r} needs kv_budget (fraction of tokens kept, e.g. 0.2)")
    return cls(budget=budget)


def gather_tokens(kv: KV, index: torch.Tensor) -> KV:
    """Keep, per layer and KV head, the tokens in ``index`` (L, H, K) (sorted), as (L, K, H, D)."""
    n_layers, _, n_heads, dk = kv.keys.shape
    dv = kv.values.shape[-1]
    idx = index.transpose(1, 2)  # (L, K, H)
    keys = torch.gather(kv.keys, 1, idx[..., None].expand(n_layers, idx.shape[1], n_heads, dk))
    values = torch.gather(kv.values, 1, idx[..., None].expand(n_layers, idx.shape[1], n_heads, dv))
    return KV(keys, values, None)

"""Prefill the prompt over an assembled window, gather the statistics a compression policy declares,
compress, then decode (or score a continuation) on the compressed KV. The engine runs the model; this
module only hands tensors between it and the policy."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kamera_engine import KV, Engine, SamplingParams
from kamera_engine.kv import Past

from .base import CompressionInput, CompressionPolicy


@dataclass(slots=True)
class Compressed:
    """A compressed KV ready for decoding, and what it cost."""

    kv: KV  # the compressed cache (window + prompt), (L, K, H, D)
    first_logits: torch.Tensor  # next-token logits after the prompt (computed with the full cache)
    next_position: int
    full_tokens: int
    kept_tokens: int
    kv_bytes_fraction: float
    stats_tokens: int  # tokens run only to gather attention statistics


def prefill_compressed(
    engine: Engine,
    past: Past,
    window_ids: Sequence[int],
    prompt_ids: Sequence[int],
    policy: CompressionPolicy,
    vision: torch.Tensor | None = None,
) -> Compressed:
    """``past``: the window (anchor + chunks; one KV or its parts) at positions 0..N-1; ``window_ids`` its N
    tokens."""
    policy.check(len(window_ids) + len(prompt_ids), len(prompt_ids))  # before any forward
    pre = engine.prefill_with_stats(past, window_ids, prompt_ids, policy.stats, policy.observation)
    full = pre.kv
    n_tok = len(full)
    protected = torch.zeros(n_tok, dtype=torch.bool)
    if policy.stats.every_query:
        protected[[0, -1]] = True
    else:
        protected[pre.query_positions] = True
    vis = torch.zeros(n_tok, dtype=torch.bool)
    if vision is not None:
        vis[: len(vision)] = vision
    inp = CompressionInput(full, pre.scores, vis, protected, len(pre.query_positions), len(prompt_ids))
    compressed = policy.compress(inp)
    return Compressed(
        compressed,
        pre.logits,
        pre.next_position,
        n_tok,
        len(compressed),
        compressed.nbytes / full.nbytes,
        pre.stats_tokens,
    )


def decode_compressed(
    engine: Engine, c: Compressed, policy: CompressionPolicy, params: SamplingParams
) -> Iterator[int]:
    """Token ids decoded on the compressed KV, with the policy's decode-time eviction."""
    hook = policy.after_step(c.kept_tokens, c.full_tokens)
    return engine.decode_on(c.kv, c.first_logits, c.next_position, params, hook)


def score_continuation(
    engine: Engine, c: Compressed, policy: CompressionPolicy, continuation: Sequence[int]
) -> list[torch.Tensor]:
    """Teacher-forced next-token log-probs along ``continuation`` on the compressed KV (with the
    policy's decode-time eviction); the first is the prompt's own next-token distribution."""
    hook = policy.after_step(c.kept_tokens, c.full_tokens)
    return engine.score_on(c.kv, c.first_logits, c.next_position, continuation, hook)

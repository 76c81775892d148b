"""The engine side of KV compression: prefill with attention statistics, then decode or score on a KV
the caller has compressed.

A compression policy (``kamera_sdk.compress``) sees tensors only: the full KV and the attention mass each
key received, and after each decode step two counts, answering which cache rows to drop. Everything that
touches the model (capturing queries, building transformers caches, feeding tokens) happens here.

Statistics are recomputed beside the attention backend from the captured rotated queries and the cached
keys (:func:`~kamera_engine.attention_stats.attention_probs_sum`), so flash attention can still run the
forward itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .adapters.base import capture_queries
from .attention_stats import attention_probs_sum
from .decode import SamplingParams, StepHook, cached_tokens, decode_tokens, step_logits
from .errors import InvalidInputError, positive_int
from .kv import KV, Past, drop_tokens, past_parts, to_cache

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["AttentionStatsSpec", "StatsPrefill", "StepHook", "decode_on", "prefill_with_stats", "score_on"]


@dataclass(frozen=True, slots=True)
class AttentionStatsSpec:
    """Which queries' attention a compression policy scores keys by (declared once per policy class).

    ``every_query``: every query of the window and the prompt (column sums of the causal attention; the
    window is run once more only for its queries, which a prefill over a cache never computes). Otherwise
    the prompt's last ``observation`` queries (SnapKV's observation window; all of them when the prompt
    is shorter), captured during the prompt's own prefill at no extra forward.
    """

    every_query: bool = False


@dataclass(slots=True)
class StatsPrefill:
    """A prompt prefilled over a window, with the attention statistics a policy asked for.

    ``kv``: the full cache (window + prompt) at positions 0..T-1, (L, T, H, D), on the CPU. ``scores``:
    per layer, per KV head, attention mass each key received from the queries at ``query_positions``
    (cache indices), (L, H, T) float32. ``logits``: next-token logits after the prompt (vocab,).
    ``stats_tokens``: tokens run only to gather statistics.
    """

    kv: KV
    scores: torch.Tensor
    query_positions: torch.Tensor
    logits: torch.Tensor
    next_position: int
    stats_tokens: int


def prefill_with_stats(
    engine: Engine,
    past: Past,
    window_ids: Sequence[int],
    prompt_ids: Sequence[int],
    spec: AttentionStatsSpec,
    observation: int,
) -> StatsPrefill:
    """Prefill ``prompt_ids`` after ``past`` (the window at positions 0..N-1, one KV or its parts;
    ``window_ids`` its N tokens) and score every key by the queries ``spec`` names (``observation``: how
    many of the prompt's last queries, when ``spec`` does not ask for every query)."""
    parts = past_parts(past)
    start = sum(len(p) for p in parts)
    if len(window_ids) != start:
        raise InvalidInputError(f"need {start} token ids for the window, got {len(window_ids)}")
    observation = positive_int("observation", observation)
    with capture_queries(engine.model) as prompt_q:
        res = engine.forward(prompt_ids, parts, start, logits="last")
    full = KV.cat([*(p.to("cpu") for p in parts), res.kv.to("cpu")])  # scored and compressed in host memory
    n_tok = len(full)
    stats_tokens = 0
    if spec.every_query:
        with capture_queries(engine.model) as window_q:
            engine.forward(list(window_ids), None, 0, logits="none")
        stats_tokens = len(window_ids)
        queries = [torch.cat([w[0], p[0]], dim=1).cpu() for w, p in zip(window_q, prompt_q, strict=True)]
        q_pos = torch.arange(n_tok)
    else:
        r = min(observation, len(prompt_ids))
        queries = [p[0, :, -r:].cpu() for p in prompt_q]
        q_pos = torch.arange(n_tok - r, n_tok)
    scores = torch.stack(
        [attention_probs_sum(q, full.keys[layer], q_pos) for layer, q in enumerate(queries)]
    )  # (L, H, T)
    return StatsPrefill(full, scores, q_pos, res.logits[-1], start + len(prompt_ids), stats_tokens)


def decode_on(
    engine: Engine,
    kv: KV,
    logits: torch.Tensor,
    position: int,
    params: SamplingParams,
    after_step: StepHook | None = None,
) -> Iterator[int]:
    """Decode after a (compressed) ``kv``: ``logits`` are the next-token logits it was left with and
    ``position`` the first generated token's position. ``after_step(cached, generated)`` names the cache
    rows to drop after each step. ``kv`` itself is left as it was (the cache is a copy)."""
    if not params.eos_token_ids:
        params.eos_token_ids = engine.eos_token_ids
    cache = to_cache(kv, engine.model.config, device=engine.device)
    constraint = engine.constraint(params)  # a grammar holds on a compressed cache too
    return decode_tokens(engine.model, cache, logits, position, params, after_step=after_step, constraint=constraint)


@torch.inference_mode()
def score_on(
    engine: Engine,
    kv: KV,
    logits: torch.Tensor,
    position: int,
    continuation: Sequence[int],
    after_step: StepHook | None = None,
) -> list[torch.Tensor]:
    """Teacher-forced next-token log-probs along ``continuation`` after a (compressed) ``kv`` (with the
    same per-step eviction as :func:`decode_on`); the first is ``logits``' own distribution."""
    engine.check_ids(list(continuation))
    cache = to_cache(kv, engine.model.config, device=engine.device)
    out = [torch.log_softmax(logits.float(), -1).cpu()]
    device = engine.device
    for i, tok in enumerate(continuation[:-1]):
        step = step_logits(engine.model, cache, int(tok), position + i, device)
        if after_step is not None:
            drop_tokens(cache, after_step(cached_tokens(cache), i + 1))
        out.append(torch.log_softmax(step, -1).cpu())
    return out

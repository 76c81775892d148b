"""Prefill the prompt over an assembled window, gather the statistics a compression policy needs,
compress, then decode (or score a continuation) on the compressed cache."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kamera_engine import KV, Engine, SamplingParams
from kamera_engine.adapters.base import capture_queries
from kamera_engine.attention_stats import attention_probs_sum
from kamera_engine.decode import decode_tokens
from kamera_engine.kv import Past, past_parts, to_cache

from .base import CompressionInput, CompressionPolicy


@dataclass(slots=True)
class Compressed:
    """A compressed cache ready for decoding, and what it cost."""

    cache: object  # transformers DynamicCache over the compressed KV
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
    parts = past_parts(past)
    start = sum(len(p) for p in parts)
    policy.check(start + len(prompt_ids), len(prompt_ids))  # before any forward
    with capture_queries(engine.model) as prompt_q:
        res = engine.forward(prompt_ids, parts, start, logits="last")
    full = KV.cat([*parts, res.kv.to("cpu")])
    n_tok = len(full)
    n_prompt = len(prompt_ids)
    stats_tokens = 0
    if policy.needs == "all":
        with capture_queries(engine.model) as window_q:
            engine.forward(list(window_ids), None, 0, logits="none")
        stats_tokens = len(window_ids)
        queries = [torch.cat([w[0], p[0]], dim=1).cpu() for w, p in zip(window_q, prompt_q, strict=True)]
        q_pos = torch.arange(n_tok)
    else:
        r = min(policy.observation, n_prompt)
        queries = [p[0, :, -r:].cpu() for p in prompt_q]
        q_pos = torch.arange(n_tok - r, n_tok)
    scores = torch.stack(
        [attention_probs_sum(q, full.keys[layer], q_pos) for layer, q in enumerate(queries)]
    )  # (L, H, T)
    protected = torch.zeros(n_tok, dtype=torch.bool)
    if policy.needs == "all":
        protected[[0, -1]] = True
    else:
        protected[-len(q_pos) :] = True
    vis = torch.zeros(n_tok, dtype=torch.bool)
    if vision is not None:
        vis[: len(vision)] = vision
    inp = CompressionInput(full, scores, vis, protected, len(q_pos), n_prompt)
    compressed = policy.compress(inp)
    cache = to_cache(compressed.to(engine.device), engine.model.config)
    return Compressed(
        cache,
        res.logits[-1],
        start + n_prompt,
        n_tok,
        len(compressed),
        compressed.nbytes / full.nbytes,
        stats_tokens,
    )


def decode_compressed(
    engine: Engine, c: Compressed, policy: CompressionPolicy, params: SamplingParams
) -> Iterator[int]:
    if not params.eos_token_ids:
        params.eos_token_ids = engine.eos_token_ids
    hook = policy.after_step(c.kept_tokens, c.full_tokens)
    return decode_tokens(engine.model, c.cache, c.first_logits, c.next_position, params, after_step=hook)


@torch.inference_mode()
def score_continuation(
    engine: Engine, c: Compressed, policy: CompressionPolicy, continuation: Sequence[int]
) -> list[torch.Tensor]:
    """Teacher-forced next-token log-probs along ``continuation`` on the compressed cache (with the
    policy's decode-time eviction); the first is the prompt's own next-token distribution."""
    hook = policy.after_step(c.kept_tokens, c.full_tokens)
    out = [torch.log_softmax(c.first_logits.float(), -1).cpu()]
    pos = c.next_position
    device = engine.device
    for i, tok in enumerate(continuation[:-1]):
        res = engine.model(
            input_ids=torch.tensor([[tok]], device=device),
            position_ids=torch.tensor([[pos]], device=device),
            past_key_values=c.cache,
            use_cache=True,
        )
        pos += 1
        if hook is not None:
            hook(c.cache, i + 1)
        out.append(torch.log_softmax(res.logits[0, -1].float(), -1).cpu())
    return out

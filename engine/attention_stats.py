"""Attention statistics computed beside the attention backend, blockwise, from captured Q and cached K.

Compression policies need attention probabilities (Elastic Cache: column sums over all queries; DAVID /
SnapKV: what the last r queries give each key). Recomputing them from Q and K in blocks keeps memory
bounded and lets flash attention run the forward itself.
"""

from __future__ import annotations

import math

import torch


def attention_probs_sum(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_pos: torch.Tensor,
    *,
    block: int = 256,
) -> torch.Tensor:
    """Per KV head, the attention mass each key receives, summed over the given queries.

    queries: (Hq, Tq, D) rotated; keys: (T, Hk, D) rotated (the cache, token-major); query_pos: (Tq,)
    cache index of each query (a query sees keys at indices <= its own). Returns (Hk, T) float32:
    softmax probabilities summed over queries and over the query heads of each KV group.
    """
    n_q_heads, n_queries, dim = queries.shape
    n_keys, n_kv_heads, _ = keys.shape
    group = n_q_heads // n_kv_heads
    k = keys.float().permute(1, 2, 0)  # (Hk, D, T)
    k = k.repeat_interleave(group, dim=0)  # (Hq, D, T)
    out = torch.zeros(n_q_heads, n_keys, dtype=torch.float32)
    scale = 1.0 / math.sqrt(dim)
    key_idx = torch.arange(n_keys)
    for s in range(0, n_queries, block):
        q = queries[:, s : s + block].float()  # (Hq, b, D)
        logits = torch.bmm(q, k) * scale  # (Hq, b, T)
        visible = key_idx[None, :] <= query_pos[s : s + block, None]  # (b, T)
        logits.masked_fill_(~visible[None], float("-inf"))
        out += torch.softmax(logits, dim=-1).sum(dim=1)
    return out.view(n_kv_heads, group, n_keys).sum(dim=1)

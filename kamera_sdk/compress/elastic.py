"""``elastic``: Elastic Cache (Liu et al.), importance-driven merging at prefill, fixed-point elimination
while decoding, as read in the project's baseline notes.

Prefill, per layer: importance of key n = column sum of the causal softmax attention over all queries,
averaged over heads (one decision per layer). The top ``budget * T`` keys by importance are anchors (the
first and the most recent token always are); every other token is merged into its nearest anchor by
position (ties to the left); a merged K and V is the unweighted mean of its bucket, anchor included, per
head. Decode: whenever the cache exceeds the budget ratio, the single entry at the fixed index
``N_tl = compressed prompt length - 25`` is dropped (entries before it stay; entries after it form a FIFO).
Merged keys average vectors rotated at different positions; the paper does not address RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kamera_engine import KV
from kamera_engine.compressed import AttentionStatsSpec, StepHook

from .base import CompressionInput, CompressionPolicy, register_compressor


@register_compressor
@dataclass
class ElasticCache(CompressionPolicy):
    name = "elastic"
    stats = AttentionStatsSpec(every_query=True)
    fixed_point_offset: int = 25

    def anchors(self, importance: torch.Tensor, keep: int) -> torch.Tensor:
        """Sorted anchor indices: top-``keep`` by importance, first and last token always included."""
        n = importance.shape[0]
        if keep >= n:
            return torch.arange(n)
        score = importance.clone()
        score[0] = score[-1] = float("inf")
        return torch.topk(score, keep).indices.sort().values

    def compress(self, inp: CompressionInput) -> KV:
        kv = inp.kv
        n_layers, n_tok = kv.keys.shape[:2]
        keep = self.kept(n_tok)
        keys = torch.empty(n_layers, keep, *kv.keys.shape[2:], dtype=kv.keys.dtype)
        values = torch.empty(n_layers, keep, *kv.values.shape[2:], dtype=kv.values.dtype)
        pos = torch.arange(n_tok)
        for layer in range(n_layers):
            importance = inp.scores[layer].mean(dim=0)  # (T,): heads averaged, a layer-wise decision
            anchors = self.anchors(importance, keep)
            # nearest anchor by position, ties to the left
            dist = (pos[:, None] - anchors[None, :]).abs()  # (T, K)
            bucket = torch.argmin(dist, dim=1)  # argmin returns the first (leftmost) minimum
            counts = torch.bincount(bucket, minlength=keep).to(kv.keys.dtype)  # (K,)
            k_sum = torch.zeros(keep, *kv.keys.shape[2:], dtype=kv.keys.dtype).index_add_(0, bucket, kv.keys[layer])
            v_sum = torch.zeros(keep, *kv.values.shape[2:], dtype=kv.values.dtype).index_add_(
                0, bucket, kv.values[layer]
            )
            keys[layer] = k_sum / counts[:, None, None]
            values[layer] = v_sum / counts[:, None, None]
        return KV(keys, values, None)

    def after_step(self, compressed_len: int, full_len: int) -> StepHook | None:
        fixed = max(1, compressed_len - self.fixed_point_offset)

        def evict(cached: int, generated: int) -> list[int]:
            """Over the budget ratio: drop the entry at the fixed point (later entries move up one)."""
            return [fixed] if cached > self.kept(full_len + generated) else []

        return evict

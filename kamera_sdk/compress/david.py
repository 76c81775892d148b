"""``david``: DAVID (dual-stage adaptive vision-text decoupling), as read in the project's baseline notes.

Scores are SnapKV-style: the attention each key receives from the last r queries (the observation
window, r = 32 or the prompt's length if shorter), smoothed by a 1-D max pool (kernel 5), per KV head.
Per layer m the fusion metric NCAR theta_m = mean over heads of (n / (n_V r)) * the attention the window
queries give vision keys (1 under uniform attention), theta_0 = 1, drop_m = theta_{m-1} - theta_m.
Layers evict *decoupled* (a vision quota floor(B / (1 + rho)) and a text quota, rho = text/vision token
ratio, the other modality masked with -inf, unused quota handed over) until the first layer where
drop_m < theta_T (0.3); from there on, *unified* top-k over all tokens. The observation window is always
kept; runs once at prefill, generated tokens are appended without eviction. With no vision tokens the
policy is exactly SnapKV (unified top-k everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kamera_engine import KV
from kamera_engine.compressed import AttentionStatsSpec

from .base import CompressionInput, CompressionPolicy, gather_tokens, register_compressor


@register_compressor
@dataclass
class DAVID(CompressionPolicy):
    name = "david"
    stats = AttentionStatsSpec()  # the prompt's last ``observation`` queries
    pool_kernel: int = 5
    theta_threshold: float = 0.3

    def smooth(self, scores: torch.Tensor) -> torch.Tensor:
        """1-D max pooling over tokens, per head: (H, T) -> (H, T)."""
        k = self.pool_kernel
        return F.max_pool1d(scores[None], kernel_size=k, stride=1, padding=k // 2)[0]

    def ncar(self, scores: torch.Tensor, vision: torch.Tensor, n_queries: int) -> float:
        n_v = int(vision.sum())
        if n_v == 0:
            return float("nan")
        n = scores.shape[-1]
        return float((scores[:, vision].sum(dim=-1) * n / (n_v * n_queries)).mean())

    def compress(self, inp: CompressionInput) -> KV:
        kv = inp.kv
        n_layers, n_tok, n_heads = kv.keys.shape[:3]
        budget = self.kept(n_tok)
        prot = inp.protected
        free_budget = max(0, budget - int(prot.sum()))
        vision, text = inp.vision & ~prot, ~inp.vision & ~prot
        n_vis, n_txt = int(vision.sum()), int(text.sum())
        index = torch.empty(n_layers, n_heads, budget, dtype=torch.long)
        theta_prev, unified = 1.0, n_vis == 0
        for layer in range(n_layers):
            raw = inp.scores[layer]  # (H, T)
            if not unified:
                theta = self.ncar(raw, inp.vision, inp.n_queries)
                if theta_prev - theta < self.theta_threshold and layer > 0:
                    unified = True
                theta_prev = theta
            score = self.smooth(raw)
            score = score.masked_fill(prot[None], float("inf"))
            if unified:
                chosen = torch.topk(score, budget, dim=-1).indices
            else:
                rho = n_txt / max(n_vis, 1)
                q_vis = min(n_vis, int(free_budget // (1 + rho)))
                q_txt = min(n_txt, free_budget - q_vis)
                q_vis = min(n_vis, free_budget - q_txt)  # hand unused text quota back to vision
                parts = [torch.nonzero(prot).flatten()[None].expand(n_heads, -1)]
                if q_vis:
                    parts.append(torch.topk(score.masked_fill(~vision[None], float("-inf")), q_vis, dim=-1).indices)
                if q_txt:
                    parts.append(torch.topk(score.masked_fill(~text[None], float("-inf")), q_txt, dim=-1).indices)
                chosen = torch.cat(parts, dim=-1)
            index[layer] = chosen.sort(dim=-1).values
        return gather_tokens(kv, index)

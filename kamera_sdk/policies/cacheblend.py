"""``cacheblend``: relocated canonicals, then recompute the r% of tokens whose key deviates most.

CacheBlend (Yao et al.; LMCache ``LMCBlender``), as read in the project's baseline notes: every reused
token runs the layers up to a check layer (default 1) in context; the ``ratio`` (default 15%) with the
largest deviation between fresh and cached keys there is kept and recomputed through the remaining
layers; their K/V overwrite the cached ones from the check layer on. The leading chunk is exact already.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..chunks import Chunk
from ..plan import RecomputeSpec
from .base import register_policy
from .selective import SelectivePolicy


@register_policy
@dataclass
class CacheBlendPolicy(SelectivePolicy):
    name = "cacheblend"
    ratio: float = 0.15
    check_layer: int = 1

    def candidates(self, chunk: Chunk) -> tuple[list[int], str]:
        return list(range(len(chunk))), "cacheblend candidates"

    def recompute_spec(self) -> RecomputeSpec:
        return RecomputeSpec(self.ratio, self.check_layer)

"""``mpic``: MPIC-k, recompute the first k tokens of every reused span in context, reuse the rest.

MPIC (Hu et al.), as read in the project's baseline notes: stored KV is reused for every chunk except
its first ``k`` tokens (default 32), which are recomputed in context, at every layer, in one pass (they
played the attention-sink role when the chunk was stored alone). With ``k`` >= the chunk length this is
a full recompute; with ``k = 0`` it is blind reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..chunks import Chunk
from ..plan import RecomputeSpec
from .base import register_policy
from .selective import SelectivePolicy


@register_policy
@dataclass
class MPICPolicy(SelectivePolicy):
    name = "mpic"
    k: int = 32

    def candidates(self, chunk: Chunk) -> tuple[list[int], str]:
        return list(range(min(self.k, len(chunk)))), f"first {self.k}"

    def recompute_spec(self) -> RecomputeSpec:
        return RecomputeSpec(1.0, None)

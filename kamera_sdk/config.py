"""Window configuration (pydantic): the knobs of the reuse operator and the window operations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from pydantic import Field

from .chunks import PatchKind
from .envelope import EnvelopeConfig
from .options import Options

if TYPE_CHECKING:
    from kamera_engine import Engine

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WindowConfig(Options):
    """How a ``ContextWindow`` forms and reuses conditioning (an unknown option or a bad value raises
    ``InvalidInputError``)."""

    rank: int = Field(32, ge=1, description="rank m of conditioning patches")
    budget_tokens: int | None = Field(None, ge=1, description="slide the oldest chunks out above this many tokens")
    patch_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="storage dtype of patch factors (default: the engine's KV dtype)"
    )
    patch_layers: Literal["all", "deep"] = Field("all", description="patch every layer, or only the deepest ones")
    deep_fraction: float = Field(0.5, gt=0, le=1, description="fraction of layers patched when patch_layers='deep'")
    reorder_patch: Literal["transfer", "orbit", "exact"] = Field(
        "transfer",
        description="on reorder: reuse conditioning formed in another order (transfer), form an orbit patch "
        "over orderings of the predecessor set (orbit), or re-prefill in the new order (exact)",
    )
    survivors: Literal["rotate", "patch"] = Field(
        "rotate",
        description="slide survivors: rotation only, keeping what they absorbed from the chunks that left "
        "(paper §5: near-lossless on GQA/MLA), or re-conditioned on what remains with a stored removal patch "
        "of rank survivor_rank (the paper's option for deepstack backbones such as Qwen3-VL; costs a forward "
        "the first time)",
    )
    background: Literal["off", "manual", "auto"] = Field(
        "off",
        description="work that improves the next step without being needed for it (set-aside patches, "
        "re-conditioning slide survivors on what remains, canonicals nothing needs yet, store prefetches) is "
        "queued and run in idle time: 'manual' by prepare(), 'auto' also on an idle thread; 'off' runs it "
        "inline as before and serves survivors as the survivors option says. With it on, survivors are "
        "re-conditioned as under survivors='patch' (the answer does not depend on whether idle time reached them)",
    )
    background_budget_tokens: int | None = Field(
        None, ge=1, description="forward tokens background work may run per window operation (None: unbounded)"
    )
    survivor_rank: int = Field(64, ge=1, description="rank of survivor removal patches (survivors='patch')")
    orbit_exhaustive_max: int = Field(4, ge=1, description="use all orderings up to this many predecessors")
    orbit_samples: int = Field(6, ge=1, description="orderings sampled beyond orbit_exhaustive_max")
    reuse_buffer: bool = Field(
        True,
        description="keep the window's KV buffer from one assembly to the next and rewrite only the rows whose "
        "placed KV changed (False: a new buffer, every slot placed again, at each assembly)",
    )
    envelope: EnvelopeConfig = Field(default_factory=EnvelopeConfig)
    seed: int = 0

    def patch_rank(self, kind: PatchKind) -> int:
        """The rank patches of ``kind`` are formed at (and the least a stored one may
        have to be reused): removal patches at ``survivor_rank``, the others at ``rank``."""
        return self.survivor_rank if kind == PatchKind.REMOVAL else self.rank

    def patch_layer_indices(self, engine: Engine) -> tuple[int, ...]:
        """The layers this config forms patches on (a stored patch on other layers is not reused)."""
        if self.patch_layers == "deep":
            return tuple(engine.deep_layers(self.deep_fraction))
        return tuple(range(engine.num_layers))

    def torch_patch_dtype(self) -> torch.dtype | None:
        return None if self.patch_dtype is None else _DTYPES[self.patch_dtype]

"""Forward runner: prefill new tokens with explicit positions on top of an assembled KV.

transformers' ``generate()`` assumes the cache was built by the model itself at contiguous positions;
Kamera assembles caches from relocated, patched chunks, so the engine drives the model directly:
one ``model(...)`` call with ``position_ids`` and a ``DynamicCache`` made from our KV.

Every call that hands a module a cache goes through :func:`call_with_cache`, the one place that knows
what transformers names that argument (``cache`` from 5.24, ``past_key_values`` before, ``layer_past``
for some decoder layers).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache as memoised
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import DynamicCache

from .batch import inline_forward
from .errors import InvalidInputError, UnsupportedModelError
from .kv import KV, Past, past_parts, to_cache
from .window_buffer import BufferedKV

if TYPE_CHECKING:
    from .scheduler import Request


@dataclass(slots=True)
class ForwardResult:
    """KV of the new tokens (placed at their positions) and their logits."""

    kv: KV  # (L, T_new, H, D), positions = the new tokens' positions; a copy the caller owns (never a view of a cache)
    logits: torch.Tensor  # (T_new, vocab) or (1, vocab) when only the last was asked for
    cache: DynamicCache  # the transformers cache after the forward (past + new), for decoding on
    # the answer a scheduler started decoding from this forward's end (``Engine.forward(..., answer=...)``),
    # already queued for the step after the forward's; None where none was started (decode from ``prefilled``)
    answer: Request | None = None

    def take_answer(self) -> Request | None:
        """The answer started from this forward (``answer``), handed over once: later calls get None."""
        answer, self.answer = self.answer, None
        return answer

    def prefilled(self, next_position: int) -> Prefilled:
        """A reusable snapshot of this forward for decoding on (shares tensors; nothing is copied)."""
        layers = [(layer.keys, layer.values) for layer in self.cache.layers]
        return Prefilled(self.logits[-1], layers, next_position)


@dataclass(slots=True)
class Prefilled:
    """A prefilled prompt that decoding can start from, any number of times.

    Decoding grows a transformers cache by concatenation, which builds new tensors, so the snapshot's
    per-layer tensors stay as they were and every ``cache()`` starts from the same state.
    """

    logits: torch.Tensor  # (vocab,) next-token logits after the prompt
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, H, T, D) keys and values
    next_position: int

    def cache(self, config: object) -> DynamicCache:
        cache = DynamicCache(config=config)
        for i, (k, v) in enumerate(self.layers):
            cache.update(k, v, i)
        return cache


def past_cache(input_ids: torch.Tensor, past: Past, config: Any, device: torch.device) -> tuple[DynamicCache, int]:
    """Check a forward's inputs and build its cache: ``past`` (placed parts) copied once onto ``device``,
    with room for ``input_ids``; a past that is a view of a :class:`WindowBuffer` (all its rows) is not
    copied at all when the buffer can lend the rows after it. Returns the cache and the past's length."""
    if input_ids.ndim != 1 or input_ids.numel() == 0:
        raise InvalidInputError(f"input_ids must be a non-empty 1-D tensor, got shape {tuple(input_ids.shape)}")
    parts = past_parts(past)
    reserve = int(input_ids.shape[0])
    if len(parts) == 1 and isinstance(parts[0], BufferedKV) and parts[0].buffer is not None:
        # the window's buffer: the past is read where it lies and the new tokens land right after it
        on_buffer = parts[0].buffer.cache(parts[0], reserve, config, device)
        if on_buffer is not None:
            return on_buffer, len(parts[0])
    cache = to_cache(parts, config, reserve=reserve, device=device)
    return cache, sum(len(p) for p in parts)


#: Names a forward takes its cache under, newest first: transformers renamed ``past_key_values`` to ``cache``
#: (the old name warns, and goes in 5.40); some decoder layers still say ``layer_past``.
CACHE_KEYWORDS = ("cache", "past_key_values", "layer_past")


@memoised
def cache_keyword(module_type: type[nn.Module]) -> str:
    """The keyword ``module_type.forward`` takes its cache under, read once per class from its signature
    (transformers' deprecation wrappers keep the wrapped signature)."""
    params = inspect.signature(module_type.forward).parameters
    for name in CACHE_KEYWORDS:
        if name in params:
            return name
    raise UnsupportedModelError(
        f"{module_type.__name__}.forward takes no cache argument (looked for {', '.join(CACHE_KEYWORDS)})"
    )


def call_with_cache(module: nn.Module, cache: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``module`` (a model, its language model or one decoder layer) with ``cache`` under the keyword
    its forward takes in the installed transformers, so no deprecated name is ever passed."""
    return module(*args, **{cache_keyword(type(module)): cache}, **kwargs)


_KEEP = {"last": 1, "all": 0, "none": 1}  # logits= -> transformers' logits_to_keep


@torch.inference_mode()
def run_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    past: Past,
    start: int,
    *,
    logits: str = "last",
) -> ForwardResult:
    """Run ``input_ids`` (T,) at positions ``start .. start+T-1`` after ``past`` (a placed KV, its parts
    in order, or None; parts are copied once, straight into the model's cache).

    ``logits``: ``"last"`` (next-token logits only), ``"all"``, or ``"none"``.
    """
    if logits not in _KEEP:
        raise InvalidInputError(f"logits must be one of {sorted(_KEEP)}, got {logits!r}")
    device = next(model.parameters()).device
    cache, n_past = past_cache(input_ids, past, model.config, device)
    n_new = int(input_ids.shape[0])
    positions = torch.arange(start, start + n_new, dtype=torch.long)
    keep = _KEEP[logits]
    with inline_forward(model, n_new):  # a prompt-sized forward on a CPU: small kernels inline (batch.py)
        out = call_with_cache(
            model,
            cache,
            input_ids=input_ids[None].to(device),
            position_ids=positions[None].to(device),
            use_cache=True,
            logits_to_keep=keep,
        )
    # the model grows the cache it was handed in place (read back from ``cache``, not the output's field,
    # whose name changed with the argument's)
    new_kv = KV.from_cache(cache, n_past, n_past + n_new, positions)
    return ForwardResult(new_kv, out.logits[0].float(), cache)

"""The adapter contract: everything Kamera needs to know about one model family.

An adapter says where the rotary embedding lives, how keys are laid out (rope style, partial rotary)
and which configurations it refuses. All access to transformers model internals goes through here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..rope import RopeSpec, check_rope_type
from .capture import RopeCall, layer_modules, modeling_module, recording


class ModelAdapter:
    """Base adapter for decoder-only transformers with RoPE attention (GQA / MHA)."""

    #: Registry name of the family.
    name: ClassVar[str] = "base"
    #: transformers ``config.model_type`` values served by this adapter.
    model_types: ClassVar[tuple[str, ...]] = ()
    #: Pairing of rotary features: "half" (i, i + r/2) or "interleaved" (2i, 2i + 1).
    rope_style: ClassVar[str] = "half"
    #: Keys are normalised (q/k-norm) before RoPE; relocation is unaffected but worth knowing.
    keys_normalised: ClassVar[bool] = False
    #: A config's ``sliding_window`` applies unless it says ``use_sliding_window=False`` (VLM text
    #: configs carry a window they do not use unless told to).
    sliding_by_default: ClassVar[bool] = True
    #: The cache holds the rotated RoPE band in its *value* slot and a RoPE-free channel in its key slot
    #: (Multi-head Latent Attention: ``k_pe`` beside the latent). The engine's operator then rotates only
    #: the value slot and carries the key slot byte for byte; the patch still covers both.
    rope_in_values: ClassVar[bool] = False
    #: Names of the functions, in the decoder layers' modeling module, that attention calls to rotate its
    #: keys (``capture.py`` records the keys they are handed: ``Engine.canonical``'s pre-RoPE capture)
    rope_functions: ClassVar[tuple[str, ...]] = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")

    def __init__(self, config: Any, name: str | None = None) -> None:
        self.config = config
        self.name_hint = name
        self.validate(config)

    # --- model access -------------------------------------------------------------------------
    def decoder(self, model: nn.Module) -> nn.Module:
        """The base decoder module (owns the layers and the rotary embedding)."""
        return model.model

    def rotary_module(self, model: nn.Module) -> nn.Module:
        return self.decoder(model).rotary_emb

    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layers, in order (for layer-by-layer forwards such as selective recompute)."""
        return self.decoder(model).layers

    def rope_modules(self, model: nn.Module) -> tuple[ModuleType, ...]:
        """The modeling modules whose ``rope_functions`` the decoder's attention calls."""
        return layer_modules(self.layers(model))

    def attention_scaling(self, model: nn.Module) -> float:
        """The factor the rotary module multiplies cos and sin by (yarn's mscale; 1 for plain RoPE)."""
        return float(getattr(self.rotary_module(model), "attention_scaling", 1.0) or 1.0)

    # --- checks -------------------------------------------------------------------------------
    def validate(self, config: Any) -> None:
        """Refuse configurations the operator cannot serve exactly."""

    def context_length(self) -> int | None:
        """Positions the model attends over: ``max_position_embeddings`` of its text config, or the
        length a RoPE scaling extends the original to (``factor`` x ``original_max_position_embeddings``,
        which yarn configs often state only there), whichever is larger; None when the config says neither."""
        text = getattr(self.config, "text_config", None) or self.config
        value = getattr(text, "max_position_embeddings", None)
        scaling = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
        scaling = scaling if isinstance(scaling, dict) else {}
        factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
        extended = int(factor * original) if factor and original else None
        known = [int(v) for v in (value, extended) if v]
        return max(known) if known else None

    def max_context(self) -> int | None:
        """Longest window whose attention is position-independent of cache layout (sliding windows): the
        window less one, since a sliding cache layer keeps only the last ``sliding_window - 1`` tokens."""
        text = getattr(self.config, "text_config", None) or self.config
        window = getattr(text, "sliding_window", None)
        if window and getattr(text, "use_sliding_window", self.sliding_by_default):
            return int(window) - 1
        return None

    # --- rope ---------------------------------------------------------------------------------
    def rope_spec(self, model: nn.Module, head_dim: int) -> RopeSpec:
        rot = self.rotary_module(model)
        rope_type = str(getattr(rot, "rope_type", "default"))
        check_rope_type(self.model_name(), rope_type)
        inv_freq = rot.inv_freq.detach().to("cpu", torch.float32).clone()
        rotary_dim = 2 * int(inv_freq.shape[0])
        if rotary_dim > head_dim:
            raise UnsupportedModelError(f"{self.model_name()}: rotary dim {rotary_dim} exceeds head dim {head_dim}")
        return RopeSpec(inv_freq, rotary_dim, head_dim, rope_type, self.rope_style)

    def model_name(self) -> str:
        if self.name_hint:
            return self.name_hint
        return str(getattr(self.config, "_name_or_path", "") or getattr(self.config, "model_type", "model"))


ADAPTERS: dict[str, type[ModelAdapter]] = {}


def register(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Class decorator: make ``cls`` serve its ``model_types``."""
    for model_type in cls.model_types:
        ADAPTERS[model_type] = cls
    return cls


def adapter_for(config: Any, name: str | None = None) -> ModelAdapter:
    """The adapter instance for a transformers config, or a clear error."""
    model_type = getattr(config, "model_type", None)
    cls = ADAPTERS.get(model_type or "")
    if cls is None:
        raise UnsupportedModelError(
            f"{name or 'model'}: model type {model_type!r} has no Kamera adapter; supported: {sorted(ADAPTERS)}"
        )
    return cls(config, name)


# --- measurement hooks (reference for relocation exactness) -----------------------------------------
@contextmanager
def capture_pre_rope_keys(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Record the keys each attention layer of a forward in this context passes to RoPE (pre-rotation), in
    layer order, (B, H, T, D) each.

    Scoped to the calling context (``capture.recording``): forwards on other threads are not recorded, and
    the family's ``apply_rotary_pos_emb`` is the original again once no recording is open. Used to build the
    re-prefill reference that relocation is checked against.
    """
    captured: list[torch.Tensor] = []

    def record(call: RopeCall) -> None:
        captured.append(call.k.detach().clone())

    with recording([modeling_module(model)], ("apply_rotary_pos_emb",), record):
        yield captured


def reference_rotate(
    model: nn.Module, adapter: ModelAdapter, keys: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Rotate pre-RoPE keys (B, H, T, D) to ``positions`` with the model's own RoPE code."""
    rot = adapter.rotary_module(model)
    cos, sin = rot(keys, positions[None].to(keys.device))
    _, k = modeling_module(model).apply_rotary_pos_emb(keys, keys, cos, sin)
    return k


@contextmanager
def capture_queries(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Record each attention layer's rotated queries (B, Hq, T, D), in layer order, for forwards in this
    context (scoped as :func:`capture_pre_rope_keys`).

    Compression policies read attention statistics from them beside the attention backend (so flash
    attention can still run the forward itself).
    """
    captured: list[torch.Tensor] = []

    def record(call: RopeCall) -> None:
        captured.append(call.out[0].detach())

    with recording([modeling_module(model)], ("apply_rotary_pos_emb",), record):
        yield captured

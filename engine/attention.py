"""Attention backend choice: SDPA on CPU, flash-attn on CUDA when the package is installed."""

from __future__ import annotations

import importlib.util

import torch

from .errors import InvalidInputError

BACKENDS = ("sdpa", "eager", "flash_attention_2")


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(requested: str | None, device: torch.device) -> str:
    """The transformers ``attn_implementation`` to use; explicit requests are checked, not downgraded."""
    if requested is None:
        return "flash_attention_2" if device.type == "cuda" and flash_attn_available() else "sdpa"
    if requested not in BACKENDS:
        raise InvalidInputError(f"unknown attention backend {requested!r}; use one of {BACKENDS}")
    if requested == "flash_attention_2":
        if device.type != "cuda":
            raise InvalidInputError("flash_attention_2 needs a CUDA device")
        if not flash_attn_available():
            raise InvalidInputError(
                "flash_attention_2 requested but flash-attn is not installed: pip install 'kamera[gpu]'"
            )
    return requested

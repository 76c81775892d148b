"""Realistic model shapes without weights: random-weight engines built from known architecture configs.

No model hub is reachable, so speed at 7-8B scale is measured on models with the real architecture
(widths, heads, KV heads, MLP size, RoPE, vocabulary: ``data/shapes/*.json``, copied from the released
configs) and random weights, optionally truncated to their first N layers (the operator's cost and a
re-prefill's are both per layer, so a truncated model gives the per-layer ratio). Random weights are
for timing only: never measure fidelity on them.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import torch

from .errors import InvalidInputError

SHAPES_DIR = Path(__file__).with_name("data") / "shapes"
#: config keys that describe the shape, not a transformers field
_META = ("name", "source", "mrope_section")


@cache
def shapes() -> dict[str, dict[str, Any]]:
    """Every known shape by name (the JSON files under ``data/shapes``)."""
    out = {}
    for path in sorted(SHAPES_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        out[data["name"]] = data
    return out


def shape_config(name: str, layers: int | None = None) -> Any:
    """The transformers config of shape ``name``, truncated to its first ``layers`` decoder layers."""
    known = shapes()
    if name not in known:
        raise InvalidInputError(f"unknown shape {name!r}; choose one of {sorted(known)}")
    data = dict(known[name])
    full = int(data["num_hidden_layers"])
    if layers is not None:
        if not 1 <= layers <= full:
            raise InvalidInputError(f"{name} has {full} layers; --layers must be in 1..{full}, got {layers}")
        data["num_hidden_layers"] = layers
    from transformers import AutoConfig

    fields = {k: v for k, v in data.items() if k not in _META}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def random_engine(
    name: str,
    layers: int | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
):
    """An :class:`~kamera_engine.engine.Engine` over a random-weight model of shape ``name`` (no tokenizer,
    no anchor: feed it token ids). Default dtype as ``Engine.load``: float32 on CPU, bfloat16 on CUDA."""
    from transformers import AutoModelForCausalLM

    from .engine import Engine
    from .loading import resolve_device

    config = shape_config(name, layers)
    dev = resolve_device(None if device is None else str(device))
    torch_dtype = _dtype(dtype, dev)
    from transformers.initialization import no_init_weights

    with torch.device(dev), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    _fill(model, seed)
    n = config.num_hidden_layers
    return Engine(model, None, name=f"{name} (random weights, {n} layers)", anchor_ids=[])


def _fill(model: torch.nn.Module, seed: int, block: int = 1 << 20) -> None:
    """Random weights at memcpy speed: every tensor tiles one block of N(0, 0.02) draws (a 7B model's
    vocabulary embedding alone is half a billion draws: minutes on a busy CPU); norm weights are ones.
    Timing does not depend on the values, only on their being ordinary floats (no NaN, no denormals)."""
    g = torch.Generator().manual_seed(seed)
    noise = (torch.randn(block, generator=g) * 0.02).to(next(model.parameters()).device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
                continue
            flat = p.view(-1)
            for start in range(0, flat.numel(), block):
                n = min(block, flat.numel() - start)
                flat[start : start + n].copy_(noise[:n])


def _dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if found not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidInputError(f"dtype {dtype!r}: expected float32, bfloat16 or float16")
    return found

"""Model fingerprints: which model produced a KV, so a store never serves one model's KV to another.

fingerprint = blake2b(architecture config JSON, every parameter's name/shape/dtype and a digest of its
bytes). Small tensors are hashed whole; tensors above ``SAMPLE_THRESHOLD`` elements are hashed on a
fixed strided sample of ``SAMPLE_SIZE`` elements plus their sum, which tells fine-tunes apart (they
change every weight) without reading tens of GB on every load.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

SAMPLE_THRESHOLD = 1 << 22
SAMPLE_SIZE = 1 << 20
_VOLATILE_KEYS = {
    "_name_or_path",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_attn_implementation",
    "_commit_hash",
    "architectures",
    "use_cache",
}


def config_digest(config: Any) -> str:
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    clean = {k: v for k, v in sorted(data.items()) if k not in _VOLATILE_KEYS}
    return hashlib.blake2b(json.dumps(clean, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    if flat.numel() > SAMPLE_THRESHOLD:
        step = flat.numel() // SAMPLE_SIZE
        extra = flat.float().sum().cpu().numpy().tobytes()
        flat = flat[::step][:SAMPLE_SIZE]
    else:
        extra = b""
    flat = flat.cpu().contiguous()
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return flat.numpy().tobytes() + extra


def model_fingerprint(model: nn.Module) -> str:
    """Hex fingerprint of architecture + weights."""
    h = hashlib.blake2b(digest_size=20)
    h.update(config_digest(model.config).encode())
    for name, tensor in model.state_dict().items():
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(_tensor_bytes(tensor))
    return h.hexdigest()

"""Model fingerprints: which model produced a KV, so a store never serves one model's KV to another.

fingerprint = blake2b(architecture config JSON, every parameter's name/shape/dtype and a digest of its
bytes). Small tensors are hashed whole; tensors above ``SAMPLE_THRESHOLD`` elements are hashed on a
fixed strided sample of ``SAMPLE_SIZE`` elements plus an integer checksum of all their bits (an integer
sum: the same on every device and thread count, unlike a float sum), which tells fine-tunes apart
without hashing tens of GB on every load.

The engine's fingerprint adds the tokenizer and, for a VLM, the image processor (``processor_digest``):
a text chunk is keyed by its text and an image by its pixels, so the KV stored for them depends on how
they become tokens.
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
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.contiguous().view(_BITS[flat.element_size()])  # the bits, as integers
    if flat.numel() > SAMPLE_THRESHOLD:
        step = flat.numel() // SAMPLE_SIZE
        extra = flat.sum(dtype=torch.int64).cpu().numpy().tobytes()  # exact: integer addition is associative
        flat = flat[::step][:SAMPLE_SIZE]
    else:
        extra = b""
    return flat.cpu().contiguous().numpy().tobytes() + extra


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def processor_digest(processor: Any) -> str:
    """Digest of how inputs become tokens: a tokenizer's vocabulary, added tokens and chat template, and an
    image / video processor's settings (whichever ``processor`` has). ``None`` digests as "none"."""
    if processor is None:
        return "none"
    parts: dict[str, Any] = {"class": type(processor).__name__}
    tok = getattr(processor, "tokenizer", processor)
    if hasattr(tok, "get_vocab"):
        parts["vocab"] = sorted(tok.get_vocab().items())
        parts["chat_template"] = getattr(tok, "chat_template", None)
        parts["special"] = sorted(str(t) for t in getattr(tok, "all_special_tokens", []))
    for name in ("image_processor", "video_processor"):
        sub = getattr(processor, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            parts[name] = config_digest(sub)
    data = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def model_fingerprint(model: nn.Module) -> str:
    """Hex fingerprint of architecture + weights."""
    h = hashlib.blake2b(digest_size=20)
    h.update(config_digest(model.config).encode())
    for name, tensor in model.state_dict().items():
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(_tensor_bytes(tensor))
    return h.hexdigest()


def engine_fingerprint(model: nn.Module, processor: Any) -> str:
    """Hex fingerprint of a model and of how its inputs become tokens (see the module docstring)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(model_fingerprint(model).encode())
    h.update(processor_digest(processor).encode())
    return h.hexdigest()

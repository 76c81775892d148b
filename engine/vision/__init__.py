"""Vision-language models: image and video chunks on transformers' own VLM classes.

One file per family (``qwen2_vl.py``, ``llava.py``, ...), each registering a vision family (how images
become chunk tokens and features) and a model adapter (where RoPE lives). ``VisionEngine`` drives them.
"""

from . import idefics3, kimi_k25, llava, qwen2_vl, qwen3_vl  # noqa: F401  (registration)
from .base import FAMILIES, Features, MediaInput, VisionFamily, family_for, register_family
from .cache import DEFAULT_MEMORY_BYTES, VisionCache, VisionCacheStats
from .engine import MediaEntry, VisionEngine
from .mrope import MRopeSpec

__all__ = [
    "DEFAULT_MEMORY_BYTES",
    "FAMILIES",
    "Features",
    "MRopeSpec",
    "MediaEntry",
    "MediaInput",
    "VisionCache",
    "VisionCacheStats",
    "VisionEngine",
    "VisionFamily",
    "family_for",
    "register_family",
]

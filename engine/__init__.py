"""kamera_engine: the embedded engine (models, RoPE, the KV operator, forward and decode).

Layering: this package never imports ``kamera_sdk``. Public names are listed in ``__all__``.
"""

from . import threads as threads  # first: sets OpenMP's wait policy before torch loads (see threads.py)

# isort: split
from .adapters import ADAPTERS, ModelAdapter, adapter_for, register
from .decode import SamplingParams, TextStream
from .default_model import DEFAULT_MODEL_NAME, INSTALL_HINT, kamera_home
from .engine import Engine, EngineCounters, EngineInfo
from .errors import (
    ChecksumError,
    ChunkNotFoundError,
    ContextLengthError,
    FingerprintMismatchError,
    InvalidInputError,
    KameraError,
    KernelBuildError,
    MediaError,
    ModelLoadError,
    StoreError,
    UnsupportedModelError,
    WindowOperationError,
)
from .kv import KV
from .operator import Patch, apply_patch, conditioning_delta, form_patch, make_free, reconstruct, relocate
from .rope import RopeSpec, rotate_keys

__all__ = [
    "ADAPTERS",
    "DEFAULT_MODEL_NAME",
    "INSTALL_HINT",
    "KV",
    "ChecksumError",
    "ChunkNotFoundError",
    "ContextLengthError",
    "Engine",
    "EngineCounters",
    "EngineInfo",
    "FingerprintMismatchError",
    "InvalidInputError",
    "KameraError",
    "KernelBuildError",
    "MediaError",
    "ModelAdapter",
    "ModelLoadError",
    "Patch",
    "RopeSpec",
    "SamplingParams",
    "StoreError",
    "TextStream",
    "UnsupportedModelError",
    "WindowOperationError",
    "adapter_for",
    "apply_patch",
    "conditioning_delta",
    "form_patch",
    "kamera_home",
    "make_free",
    "reconstruct",
    "register",
    "relocate",
    "rotate_keys",
]

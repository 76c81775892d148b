"""kamera_engine: the embedded engine (models, RoPE, the KV operator, forward and decode).

Layering: this package never imports ``kamera_sdk``. Public names are listed in ``__all__``.
Importing it registers every model family (text adapters and vision families), so ``Engine.load`` can
serve any of them.
"""

from . import threads as threads  # first: sets OpenMP's wait policy before torch loads (see threads.py)

# isort: split
from . import vision  # noqa: F401  (registers the vision families' engine with the loader)
from .adapters import ADAPTERS, ModelAdapter, adapter_for, register
from .constrained import Grammar
from .decode import AsyncTextStream, SamplingParams, TextStream
from .default_model import DEFAULT_MODEL_NAME, INSTALL_HINT, kamera_home
from .engine import Engine, EngineCounters, EngineInfo
from .errors import (
    CapacityError,
    ChecksumError,
    ChunkNotFoundError,
    ConstraintError,
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
from .loading import LoadSettings, ModelSource, load_engine, resolve_device, resolve_dtype
from .operator import Patch, apply_patch, conditioning_delta, form_patch, make_free, reconstruct, relocate
from .rope import RopeSpec, rotate_keys

__all__ = [
    "ADAPTERS",
    "DEFAULT_MODEL_NAME",
    "INSTALL_HINT",
    "KV",
    "AsyncTextStream",
    "CapacityError",
    "ChecksumError",
    "ChunkNotFoundError",
    "ConstraintError",
    "ContextLengthError",
    "Engine",
    "EngineCounters",
    "EngineInfo",
    "FingerprintMismatchError",
    "Grammar",
    "InvalidInputError",
    "KameraError",
    "KernelBuildError",
    "LoadSettings",
    "MediaError",
    "ModelAdapter",
    "ModelLoadError",
    "ModelSource",
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
    "load_engine",
    "make_free",
    "reconstruct",
    "register",
    "relocate",
    "resolve_device",
    "resolve_dtype",
    "rotate_keys",
]

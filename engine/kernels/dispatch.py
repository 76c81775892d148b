"""Which implementation serves the operator's apply on a device: the Triton kernels or torch's path.

On CUDA the Triton kernels (``place``) are the default when ``triton`` imports; torch's path stays the
reference and the fallback. CPU tensors never go to Triton here (the CPU has its own fused C kernel,
``fused_apply``; tests run the Triton kernels on CPU through Triton's interpreter, ``TRITON_INTERPRET=1``).
``KAMERA_GPU_KERNEL`` chooses: ``auto`` (default), ``triton`` (an error when Triton is missing) or
``torch``.
"""

from __future__ import annotations

import functools
import os

import torch

from ..errors import InvalidInputError, KernelBuildError

MODES = ("auto", "triton", "torch")


def mode() -> str:
    """The GPU kernel choice from ``KAMERA_GPU_KERNEL`` (``auto`` when unset)."""
    value = os.environ.get("KAMERA_GPU_KERNEL", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise InvalidInputError(f"KAMERA_GPU_KERNEL={value!r}: expected one of {', '.join(MODES)}")
    return value


@functools.lru_cache(maxsize=1)
def triton_version() -> str | None:
    """Triton's version when it imports, else None."""
    try:
        import triton
    except Exception:  # any import failure (missing, broken install) means torch's path
        return None
    return str(triton.__version__)


def backend(device: torch.device | str) -> str:
    """``"triton"`` when the kernels serve tensors on ``device``, else ``"torch"``."""
    if torch.device(device).type != "cuda" or mode() == "torch":
        return "torch"
    if triton_version() is None:
        if mode() == "triton":
            raise KernelBuildError("KAMERA_GPU_KERNEL=triton but triton does not import: pip install 'kamera[gpu]'")
        return "torch"
    return "triton"


def status(device: torch.device | str | None = None) -> str:
    """One line for ``kamera doctor``: what serves apply on CUDA, and why."""
    dev = torch.device(device) if device is not None else None
    cuda = torch.cuda.is_available()
    version = triton_version()
    if mode() == "torch":
        return "torch (KAMERA_GPU_KERNEL=torch)"
    if version is None:
        return "torch (triton not installed)"
    if not cuda or (dev is not None and dev.type != "cuda"):
        return f"torch on this device (triton {version} serves CUDA tensors)"
    return f"triton {version}"


def _rows_contiguous(x: torch.Tensor) -> bool:
    return x.ndim == 4 and x.stride(3) == 1 and x.stride(2) == x.shape[3] and x.stride(1) == x.shape[2] * x.shape[3]


def serves(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels serve an apply over these (L, T, H, D) tensors (CUDA, rows contiguous)."""
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return False
    return backend(tensors[0].device) == "triton" and all(_rows_contiguous(t) for t in tensors)

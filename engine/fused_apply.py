"""The fused CPU kernel behind ``apply_patch``: ``R(p) · (canonical + U V^T)`` in one pass per row.

On a CPU, torch runs the operator as separate passes (a GEMM, an add, and a rotation that reads and
writes the keys three times), so apply ran at a fraction of memcpy bandwidth. ``csrc/kamera_apply.c``
does it row block by row block instead: the rank-m product accumulates in registers on top of the
canonical row, the row is rotated while it is in L1 and streamed out. Same arithmetic, float32, so the
result equals torch's path to float rounding (tests/engine/test_fused_apply.py holds them together).

The C file is compiled on first use with the system C compiler (``$CC``, else ``cc``) for this CPU
(``-O3 -march=native``) and cached under ``$KAMERA_HOME/kernels`` by a hash of the source, the
compiler and the CPU; later processes load it in milliseconds. ``KAMERA_KERNEL`` chooses:

* ``auto`` (default): the kernel when it builds, else torch's path, with one warning saying why;
* ``c``: the kernel or a :class:`KernelBuildError`;
* ``torch``: torch's path only.

GPU tensors and float64 / half dtypes use torch. The exact reference path (``apply_patch(exact=True)``)
rotates in float64 with torch; its ``canonical + U V^T`` (``reconstruct``) may run here.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .default_model import kamera_home
from .errors import InvalidInputError, KernelBuildError

log = logging.getLogger("kamera")

SOURCE = Path(__file__).with_name("csrc") / "kamera_apply.c"
MODES = ("auto", "c", "torch")
_STYLES = {"half": 0, "interleaved": 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why_not: str | None = None  # why the kernel is not available (after a failed build)


def mode() -> str:
    """The kernel choice from ``KAMERA_KERNEL`` (``auto`` when unset)."""
    value = os.environ.get("KAMERA_KERNEL", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise InvalidInputError(f"KAMERA_KERNEL={value!r}: expected one of {', '.join(MODES)}")
    return value


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _build(cc: str) -> Path:
    """Compile the kernel for this CPU (once per source / compiler / CPU) and return the library path."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        SOURCE.read_bytes() + version.encode() + _cpu_flags().encode() + platform.machine().encode()
    ).hexdigest()[:16]
    out_dir = kamera_home() / "kernels"
    lib = out_dir / f"kamera_apply-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cc, "-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-o", tmp, str(SOURCE)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise KernelBuildError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, lib)  # atomic: concurrent builders all end with one complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise KernelBuildError(
            f"no C compiler found (looked for {os.environ.get('CC') or 'cc'!r}); install gcc or set CC, "
            "or set KAMERA_KERNEL=torch"
        )
    try:
        path = _build(cc)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"could not build or load the fused apply kernel: {exc}") from exc
    fn = lib.kamera_apply_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None when torch's path is to be used (see the module docstring)."""
    global _lib, _why_not
    chosen = mode()
    if chosen == "torch":
        return None
    if _lib is not None:  # loaded: no lock on the apply path
        return _lib
    with _lock:
        if _lib is None and (_why_not is None or chosen == "c"):
            try:
                _lib = _load()
            except KernelBuildError as exc:
                if chosen == "c":
                    raise
                _why_not = str(exc)
                log.warning("kamera: fused apply kernel unavailable, using torch's path: %s", exc)
        return _lib


def status() -> str:
    """``"c"`` when the kernel serves apply, else ``"torch"`` (with the reason, when a build failed)."""
    if library() is not None:
        return "c"
    return "torch" if _why_not is None or mode() == "torch" else f"torch ({_why_not.splitlines()[0]})"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernel can serve these tensors (float32, CPU, contiguous) and is available."""
    ok = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
    return ok and library() is not None


def run(
    src: torch.Tensor,
    dst: torch.Tensor,
    factors: tuple[torch.Tensor, torch.Tensor] | None,
    patch_rows: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    *,
    rotary_dim: int = 0,
    style: str = "half",
) -> None:
    """``dst = R(cos, sin) · (src + u @ vt)`` over (L, T, H, D) float32 tensors, in place on ``dst``.

    ``factors``: ``(u (Lp, T, m), vt (Lp, m, H * D))`` or None; ``patch_rows`` (L,) int64 maps each layer
    to its row in the factors (-1: unpatched). ``cos``/``sin``: (T, rotary_dim // 2) float32, or None for
    no rotation. Callers check :func:`usable` first.
    """
    lib = library()
    assert lib is not None, "fused_apply.run called without the kernel (check usable() first)"
    n_layers, n_tok, heads, dim = src.shape
    u = vt = None
    m = 0
    if factors is not None:
        u, vt = (f.to(torch.float32).contiguous() for f in factors)
        m = int(u.shape[-1])
        if patch_rows is None or patch_rows.shape != (n_layers,) or patch_rows.dtype != torch.int64:
            raise InvalidInputError("fused apply needs an int64 (L,) layer -> factor row map with factors")
    rc = lib.kamera_apply_f32(
        _ptr(src),
        _ptr(dst),
        _ptr(u),
        _ptr(vt),
        _ptr(patch_rows) if factors is not None else None,
        _ptr(cos),
        _ptr(sin),
        n_layers,
        n_tok,
        heads,
        dim,
        rotary_dim if cos is not None else 0,
        m,
        _STYLES[style],
        max(1, torch.get_num_threads()),
    )
    if rc != 0:
        raise KernelBuildError(f"fused apply kernel failed with code {rc} (1: out of memory, 2: bad arguments)")

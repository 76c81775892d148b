"""Linear layers through oneDNN with prepacked weights, for float32 models on a CPU.

PyTorch runs ``nn.Linear`` on a CPU through its BLAS (MKL in the standard wheels). For the few rows of a
decode step that is a poor fit: on the 2-core AMD EPYC this project is measured on, MKL's sgemm runs a
product of 2 to 8 rows as about that many passes over the weights, so a batch of decode rows paid for
the weights almost once per row. oneDNN's linear over a weight packed once into its blocked layout reads
the weights once for all rows (the default model's linears, one forward's worth: 8 rows 17.6 ms against
36.9 ms, 1 row 11.0 against 17.6, 448 rows 569 against 658; ``docs/batching.md``).

:func:`pack_linears` gives every plain ``nn.Linear`` of a CPU float32 model that second, packed copy of
its weight and routes its forward through oneDNN (the layer becomes a :class:`PackedLinear`). Every path
of the engine then runs the same kernels: a lone forward, a batched one, the one-at-a-time server and
the batched one alike. The cost is memory: the packed copy sits beside the weight (the model's linear
weights twice; the default model about 0.5 GB more). The results differ from MKL's by float rounding.

A packed copy follows its weight: a layer whose weight was replaced (``.data`` or ``.to()`` included)
or changed in place with its version counter moving (``with torch.no_grad(): w.mul_(2)``) packs again
before its next forward; an in-place edit of ``weight.data`` keeps the tensor, its storage and its
version, and is not seen. Whether a lone row runs as two (``_packing``) is probed at packing time, under the
thread count and oneDNN math mode then in force. A forward that autograd must see (grad enabled and an
input, the weight or the bias requiring grad), or on another device or dtype, runs ``nn.Linear``'s own.
``KAMERA_LINEAR_BACKEND=native`` (or ``Engine(..., linear_backend="native")``) keeps BLAS.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, NamedTuple

import torch
from torch import nn

from .errors import InvalidInputError
from .threads import pooled

#: the linear backends an engine can run: ``onednn`` (packed, CPU float32 only) or ``native`` (PyTorch's own)
LINEAR_BACKENDS = ("onednn", "native")
#: the environment variable that sets the default backend (``auto``: oneDNN where it applies)
LINEAR_BACKEND_ENV = "KAMERA_LINEAR_BACKEND"


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's packed linear."""
    ops = torch.ops.mkldnn
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def _choice(requested: str | None) -> str:
    choice = requested if requested is not None else (os.environ.get(LINEAR_BACKEND_ENV) or "auto")
    if choice not in (*LINEAR_BACKENDS, "auto"):
        raise InvalidInputError(f"unknown linear backend {choice!r}; use one of {(*LINEAR_BACKENDS, 'auto')}")
    return choice


def _fits(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of this device and dtype run on oneDNN's packed linear (float32 on a CPU)."""
    return device.type == "cpu" and dtype == torch.float32


def runs_onednn(module: nn.Module | None) -> bool:
    """Whether ``module`` is a linear whose forward runs on its packed oneDNN weight (a :class:`PackedLinear`
    whose weight is still float32 on a CPU)."""
    return isinstance(module, PackedLinear) and _fits(module.weight.device, module.weight.dtype)


def _refuse_onednn(device: torch.device, dtype: torch.dtype) -> None:
    if not _fits(device, dtype):
        raise InvalidInputError("the onednn linear backend runs float32 models on a CPU only")
    if not onednn_available():
        raise InvalidInputError("this torch build has no oneDNN packed linear; use linear_backend='native'")


def check_linear_backend(requested: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before a model is loaded, a backend name (or ``$KAMERA_LINEAR_BACKEND``) that is unknown, or
    ``onednn`` where it cannot run (``device`` and ``dtype`` are the load's)."""
    if _choice(requested) == "onednn":
        _refuse_onednn(device, dtype)


def resolve_linear_backend(requested: str | None, model: nn.Module) -> str:
    """The backend ``model``'s linears run on: ``requested`` (checked), else ``$KAMERA_LINEAR_BACKEND``, else
    ``auto``: ``onednn`` for a float32 model on a CPU where this torch has it, ``native`` otherwise. An
    explicit ``onednn`` that cannot apply is refused, not downgraded; a model another engine packed already
    runs ``onednn`` (``native`` for it is refused)."""
    choice = _choice(requested)
    if any(isinstance(m, PackedLinear) for m in model.modules()):  # packed by an engine before (a shared model)
        if choice == "native":
            raise InvalidInputError("the model's linears are already packed (another engine's): it runs onednn")
        return "onednn"
    param = next(model.parameters(), None)
    if param is None:
        return "native"
    if choice == "auto":
        return "onednn" if _fits(param.device, param.dtype) and onednn_available() else "native"
    if choice == "onednn":
        _refuse_onednn(param.device, param.dtype)
    return choice


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # on the thread's pool even where a forward runs its small kernels inline (``threads.small_kernels_inline``)
    return pooled(torch.ops.mkldnn._linear_pointwise, x, packed, bias, "none", [], "")


class _Packing(NamedTuple):
    """A packed weight and what it was packed from (one object, swapped whole: no torn reads)."""

    packed: torch.Tensor
    pad_single: bool  # a lone row runs as two (``_packing``)
    source: weakref.ref[torch.Tensor]
    held: torch.Tensor  # the weight's data when packed: holds its storage, so no new storage takes its address
    version: int  # -1 for an inference tensor (which keeps no version counter)


def _version(weight: torch.Tensor) -> int:
    return -1 if weight.is_inference() else int(weight._version)


def _packing(weight: torch.Tensor) -> _Packing:
    """Pack ``weight``, and probe whether a lone row must run as two: oneDNN may take another kernel for one
    row (on the default model, the MLP's down projection: 1,536 inputs) whose rounding differs from the kernel
    every larger row count shares, so a lone row would not equal the same row in a batch."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=weight.dtype)
    pad_single = not torch.equal(_linear(probe[:1], packed, None), _linear(probe, packed, None)[:1])
    return _Packing(packed, pad_single, weakref.ref(weight), weight.detach(), _version(weight))


def _fresh(p: _Packing | None, weight: torch.Tensor) -> bool:
    return (
        p is not None
        and p.source() is weight
        and p.held.data_ptr() == weight.data_ptr()
        and p.version == _version(weight)
    )


#: guards re-packing (rare: a weight replaced or changed in place)
_PACK_LOCK = threading.Lock()


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that runs through oneDNN with a packed copy of its weight (see the module docstring).
    The packed copy is never saved or copied with the module: a pickle or deep copy packs again."""

    _packing: _Packing | None = None

    def _current(self) -> _Packing:
        weight = self.weight
        p = self._packing
        if not _fresh(p, weight):
            with _PACK_LOCK:
                p = self._packing
                if not _fresh(p, weight):
                    p = self._packing = _packing(weight)
        assert p is not None
        return p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if (
            not _fits(x.device, x.dtype)
            or not _fits(weight.device, weight.dtype)
            or (
                torch.is_grad_enabled()
                and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
            )
        ):
            return super().forward(x)
        p = self._current()
        if p.pad_single and x.numel() == x.shape[-1]:  # one row: run it as two, as a batch would
            return _linear(x.reshape(1, -1).expand(2, -1), p.packed, bias)[:1].reshape(*x.shape[:-1], -1)
        return _linear(x, p.packed, bias)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_packing", None)
        return state


def pack_linears(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` with a CPU float32 weight a :class:`PackedLinear`, packed
    now; returns how many. Subclasses of ``nn.Linear`` (quantised layers, adapters) are left as they are."""
    if not onednn_available():
        raise InvalidInputError("this torch build has no oneDNN packed linear")
    n = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        if not _fits(module.weight.device, module.weight.dtype):
            continue
        module.__class__ = PackedLinear
        module._packing = _packing(module.weight)  # type: ignore[attr-defined]
        n += 1
    return n

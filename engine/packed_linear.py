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

A packed copy follows its weight: a layer whose weight was replaced or changed in place packs again
before its next forward, so a stale copy is never used. A forward that autograd must see (grad enabled
and an input or the weight requiring grad), or on another device or dtype, runs ``nn.Linear``'s own.
``KAMERA_LINEAR_BACKEND=native`` (or ``Engine(..., linear_backend="native")``) keeps BLAS.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch import nn

from .errors import InvalidInputError

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


def resolve_linear_backend(requested: str | None, model: nn.Module) -> str:
    """The backend ``model``'s linears run on: ``requested`` (checked), else ``$KAMERA_LINEAR_BACKEND``, else
    ``auto``: ``onednn`` for a float32 model on a CPU where this torch has it, ``native`` otherwise. An
    explicit ``onednn`` that cannot apply is refused, not downgraded."""
    choice = requested if requested is not None else (os.environ.get(LINEAR_BACKEND_ENV) or "auto")
    if choice not in (*LINEAR_BACKENDS, "auto"):
        raise InvalidInputError(f"unknown linear backend {choice!r}; use one of {(*LINEAR_BACKENDS, 'auto')}")
    param = next(model.parameters(), None)
    fits = param is not None and param.device.type == "cpu" and param.dtype == torch.float32
    if choice == "auto":
        return "onednn" if fits and onednn_available() else "native"
    if choice == "onednn" and not fits:
        raise InvalidInputError("the onednn linear backend runs float32 models on a CPU only")
    if choice == "onednn" and not onednn_available():
        raise InvalidInputError("this torch build has no oneDNN packed linear; use linear_backend='native'")
    return choice


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The packed weight, and whether a lone row must run as two: oneDNN may take another kernel for one row
    (on the default model, the MLP's down projection: 1,536 inputs) whose rounding differs from the kernel every
    larger row count shares, so a lone row would not equal the same row in a batch. Probed once per packing."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=weight.dtype)
    lone = _linear(probe[:1], packed, None)
    return packed, not torch.equal(lone, _linear(probe, packed, None)[:1])


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that runs through oneDNN with a packed copy of its weight (see the module docstring).
    The packed copy is never saved or copied with the module: a pickle or deep copy packs again."""

    _packed: torch.Tensor | None
    _pad_single: bool  # a lone row runs as two (``_pack``)
    _packed_of: tuple[torch.Tensor | None, int]  # the weight it was packed from, and that weight's version
    _pack_lock: threading.Lock

    def _current(self) -> torch.Tensor:
        weight = self.weight
        source, version = self._packed_of
        packed = self._packed
        if packed is None or source is not weight or version != weight._version:
            with self._pack_lock:
                packed, self._pad_single = _pack(weight)
                self._packed, self._packed_of = packed, (weight, weight._version)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            x.device.type != "cpu"
            or weight.device.type != "cpu"
            or x.dtype != torch.float32
            or weight.dtype != torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            return super().forward(x)
        packed = self._current()
        if self._pad_single and x.numel() == x.shape[-1]:  # one row: run it as two, as a batch would
            return _linear(x.reshape(1, -1).expand(2, -1), packed, self.bias)[:1].reshape(*x.shape[:-1], -1)
        return _linear(x, packed, self.bias)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_packed"] = None
        state["_pad_single"] = False
        state["_packed_of"] = (None, -1)
        state.pop("_pack_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._pack_lock = threading.Lock()


def pack_linears(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` with a CPU float32 weight a :class:`PackedLinear`, packed
    now; returns how many. Subclasses of ``nn.Linear`` (quantised layers, adapters) are left as they are."""
    if not onednn_available():
        raise InvalidInputError("this torch build has no oneDNN packed linear")
    n = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        module.__class__ = PackedLinear
        module._pack_lock = threading.Lock()  # type: ignore[assignment]
        module._packed, module._pad_single = _pack(weight)  # type: ignore[assignment]
        module._packed_of = (weight, weight._version)  # type: ignore[assignment]
        n += 1
    return n

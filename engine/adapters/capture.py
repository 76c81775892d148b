"""What a model's attention hands its RoPE function, recorded for one forward and no other.

transformers families apply RoPE through a module-level function of the family's modeling module
(``apply_rotary_pos_emb``; DeepSeek's ``apply_rotary_pos_emb_interleave``), called by every attention layer
with its queries and keys. :func:`recording` wraps those functions while at least one recording is open
anywhere in the process (reference counted under a lock; the original goes back when the last recording
closes, also after an error) and hands a call to a recorder only when that recorder was opened in the
calling context (a ``ContextVar``). A forward on another thread, or another engine's forward, passes
straight through the wrapper with the same arguments and is never seen; a recording sees only the calls of
the forward it encloses.

A forward that records may still be packed with other requests' rows by a scheduler (``scheduler.carry``)
when its recorders are :func:`packable`: the caller hands them (:func:`active_recorders`) with the forward,
and the thread that runs the packed forward records it with :func:`recording_rows`, which gives each
recorder only its own row's tokens of every call (the row's span of the packed sequence), as if its forward
had run alone, once the forward succeeded. A forward with other recorders (one that reads a call's output,
e.g. ``capture_queries``) runs alone between two steps, in its caller's context.

:class:`PreRopeKeys` turns a recorded call into the key the model would write at angle 0, computed by the
family's own function with the angle-0 tables (``cos`` = the attention scaling, ``sin`` = 0), so the result
is in the cache's layout (DeepSeek's interleaved band comes out de-interleaved, as the cache holds it) and
carries a yarn scaling once, as a written key does. That is the position-free key of ``Engine.canonical``
without the un-rotation of a written key, which in bf16 loses bits that cannot be recovered (docs/gpu.md).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class RopeCall:
    """One call of a family's RoPE function: its inputs, what it returned, and the original function."""

    function: Callable[..., Any]
    q: torch.Tensor
    k: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any


Recorder = Callable[[RopeCall], None]

#: recorders opened in this context (a thread, or an asyncio task), innermost last
_ACTIVE: ContextVar[tuple[Recorder, ...]] = ContextVar("kamera_rope_recorders", default=())
_LOCK = threading.Lock()
#: (module, name) -> [original function, open recordings]
_INSTALLED: dict[tuple[str, str], list[Any]] = {}


def is_recording() -> bool:
    """Whether a recording is open in the calling context."""
    return bool(_ACTIVE.get())


def active_recorders() -> tuple[Recorder, ...]:
    """The recorders open in the calling context, innermost last (handed with a forward another thread runs)."""
    return _ACTIVE.get()


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def rope_with_recorders(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        recorders = _ACTIVE.get()
        if recorders and len(args) >= 4:  # (q, k, cos, sin, ...) as transformers calls it; else not recorded
            q, k, cos, sin = args[:4]
            call = RopeCall(original, q, k, cos, sin, tuple(args[4:]), kwargs, out)
            for record in recorders:
                record(call)
        return out

    rope_with_recorders.__kamera_original__ = original  # type: ignore[attr-defined]
    return rope_with_recorders


def _targets(modules: Iterable[ModuleType], names: Sequence[str]) -> list[tuple[ModuleType, str]]:
    found: dict[tuple[str, str], tuple[ModuleType, str]] = {}
    for module in modules:
        for name in names:
            if callable(getattr(module, name, None)):
                found[(module.__name__, name)] = (module, name)
    return list(found.values())


def _install(targets: list[tuple[ModuleType, str]]) -> None:
    with _LOCK:
        for module, name in targets:
            slot = _INSTALLED.get((module.__name__, name))
            if slot is None:
                original = getattr(module, name)
                setattr(module, name, _wrap(original))
                _INSTALLED[(module.__name__, name)] = [original, 1]
            else:
                slot[1] += 1


def _uninstall(targets: list[tuple[ModuleType, str]]) -> None:
    with _LOCK:
        for module, name in targets:
            slot = _INSTALLED[(module.__name__, name)]
            slot[1] -= 1
            if slot[1] == 0:
                del _INSTALLED[(module.__name__, name)]
                if getattr(getattr(module, name), "__kamera_original__", None) is slot[0]:
                    setattr(module, name, slot[0])


@contextmanager
def recording(modules: Iterable[ModuleType], names: Sequence[str], recorder: Recorder) -> Iterator[None]:
    """Hand ``recorder`` every call of the functions ``names`` of ``modules`` made in this context until the
    block ends (see the module docstring); the functions are the originals again once no recording is open."""
    targets = _targets(modules, names)
    _install(targets)
    token = _ACTIVE.set((*_ACTIVE.get(), recorder))
    try:
        yield
    finally:
        try:
            # a generator-based context manager may be closed from another context, where ``reset`` raises
            # ValueError: the wrappers still go (their count would never reach 0 again)
            _ACTIVE.reset(token)
        finally:
            _uninstall(targets)


@contextmanager
def unrecorded() -> Iterator[None]:
    """Within this block, recordings open in the calling context see no forward (a thread that runs other
    requests' forwards, e.g. a scheduler step, while a recording of its own is open)."""
    token = _ACTIVE.set(())
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def packable(recorders: Sequence[Recorder]) -> bool:
    """Whether every recorder takes calls cut to one row of a packed forward (``recording_rows``): a recorder
    says so with a true ``packable`` attribute (it reads a call's ``function``, ``k``, ``cos``, ``sin``,
    ``args`` and ``kwargs`` only: a cut call carries the keys in place of the queries and no ``out``)."""
    return all(getattr(r, "packable", False) for r in recorders)


class RowRecording:
    """The calls a packed forward made, cut per recorded row, held until :meth:`deliver` hands them over."""

    def __init__(self, spans: Sequence[tuple[int, int, tuple[Recorder, ...]]], width: int) -> None:
        self.spans = list(spans)
        self.width = width
        self.calls: list[list[RopeCall]] = [[] for _ in self.spans]

    def __call__(self, call: RopeCall) -> None:
        if call.k.shape[-2] != self.width or call.cos.shape[-2] != self.width:
            raise ValueError(
                f"a RoPE call of keys {tuple(call.k.shape)} and cos {tuple(call.cos.shape)} does not hold the packed "
                f"sequence of {self.width} tokens on its second-to-last axis: its rows cannot be cut"
            )
        for calls, (a, b, _) in zip(self.calls, self.spans, strict=True):
            k = call.k[..., a:b, :]  # a view: the recorder copies what it keeps
            cos, sin = call.cos[..., a:b, :], call.sin[..., a:b, :]
            calls.append(RopeCall(call.function, k, k, cos, sin, call.args, call.kwargs, None))

    def deliver(self, i: int) -> None:
        """Hand the ``i``-th recorded row's calls to its recorders (once the packed forward succeeded); a
        recorder's error is raised here, for that row alone."""
        calls, self.calls[i] = self.calls[i], []
        for call in calls:
            for record in self.spans[i][2]:
                record(call)


@contextmanager
def recording_rows(
    modules: Iterable[ModuleType],
    names: Sequence[str],
    rows: Sequence[tuple[int, int, Sequence[Recorder]]],
    width: int,
) -> Iterator[RowRecording]:
    """Record a packed forward of ``width`` tokens (several rows in one sequence) for its rows that have
    recorders (all :func:`packable`): each ``(start, stop, recorders)`` gets every call cut to tokens
    ``[start, stop)`` (keys, cos, sin), which is what the row's own forward would have handed RoPE. The
    calls are held by the :class:`RowRecording` this yields; the caller hands each row's over with
    ``deliver(i)`` (``i`` counts the rows given here) once the forward succeeded, so a failed attempt is
    never seen. Recorders open in the calling context are set aside for the block (they would see the other
    rows' tokens)."""
    spans = [(int(a), int(b), tuple(rs)) for a, b, rs in rows]
    held = RowRecording(spans, width)
    if not any(rs for _, _, rs in spans):
        with unrecorded():
            yield held
        return
    targets = _targets(modules, names)
    _install(targets)
    token = _ACTIVE.set((held,))
    try:
        yield held
    finally:
        try:
            _ACTIVE.reset(token)
        finally:
            _uninstall(targets)


def modeling_module(model: nn.Module) -> ModuleType:
    """The modeling module of ``model``'s own class."""
    return sys.modules[type(model).__module__]


def layer_modules(layers: Iterable[nn.Module]) -> tuple[ModuleType, ...]:
    """The modeling modules the decoder layers' classes live in (where their attention calls RoPE from)."""
    seen: dict[str, ModuleType] = {}
    for layer in layers:
        module = sys.modules.get(type(layer).__module__)
        if module is not None:
            seen.setdefault(module.__name__, module)
    return tuple(seen.values())


class PreRopeKeys:
    """A recorder of the keys each attention call hands RoPE, in call (layer) order.

    ``scaling``: the factor the model's rotary module multiplies cos and sin by (yarn's ``attention_scaling``;
    1 for plain RoPE), so :meth:`at_angle_zero` is what the model writes at angle 0.
    """

    #: it reads a call's keys, tables and function only, so it may record one row of a packed forward
    packable = True

    def __init__(self, scaling: float = 1.0) -> None:
        self.scaling = float(scaling)
        self.calls: list[RopeCall] = []

    def __call__(self, call: RopeCall) -> None:
        k = call.k.detach().clone()  # the forward may reuse its buffers later on
        self.calls.append(RopeCall(call.function, k, k, call.cos, call.sin, call.args, call.kwargs, None))

    def at_angle_zero(self, n: int) -> list[torch.Tensor]:
        """Per call, the last ``n`` token rows of the key the model writes at angle 0: (n, H, D') each, in the
        cache's layout (``D'``: what the family rotates; its rotary band, or the whole head with a pass-through
        tail that is the written one)."""
        rows = []
        for call in self.calls:
            cos = torch.full(call.cos.shape, self.scaling, dtype=torch.float32, device=call.cos.device)
            cos = cos.to(call.cos.dtype)
            sin = torch.zeros_like(call.sin)
            with torch.no_grad():
                _, k0 = call.function(call.k, call.k, cos, sin, *call.args, **call.kwargs)
            if k0.ndim != 4 or k0.shape[0] != 1 or k0.shape[2] < n:
                raise ValueError(f"a recorded key of shape {tuple(k0.shape)} is not (1, H, >= {n}, D)")
            rows.append(k0[0, :, -n:, :].transpose(0, 1))
        return rows

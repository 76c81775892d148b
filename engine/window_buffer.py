"""A preallocated window KV buffer: the window is assembled in place and forwards run on top of it.

Without it, a window is a list of placed parts: every forward over it copies them into a fresh
transformers cache, and the assembled window is one more concatenation. Here each part is written once
into per-layer tensors ``(L, capacity, H, D)`` (token-major, like :class:`KV`), at its slot; the window
so far is a view of the first rows (no copy), and a forward takes those rows as its cache's past and
writes its own tokens into the rows after them (also no copy, :meth:`WindowBuffer.cache`).

A window keeps its buffer from one step to the next (:meth:`WindowBuffer.restart`): rows written with a
*key* (the objects their KV is a function of, compared by identity: the position-free KV a slot is
rotated from, at that row) are remembered, and a later assembly that places the same key at the same row
takes them as they are (:meth:`WindowBuffer.reuse`) instead of rotating and writing the slot again. A
write or a forward's lent rows over remembered rows forget them. Placed KV depends only on its key and
its row, so rows kept this way hold the bits a rewrite would.

Every view the buffer hands out stays as it was: before a new assembly writes over rows, the buffer
checks whether anything outside it still holds a view of its tensors (a caller's assembled window, a
prompt's prefill kept for decoding, a policy's cached parts); if so it continues in new tensors (copy on
write: the remembered rows copied once) and the holders keep the old ones. Rows lent to a forward's cache
belong to that cache: within one assembly the buffer lends its free rows to one forward only, and a later
forward over the same rows copies the past as before. Beyond its capacity the buffer grows by doubling
into new tensors (earlier views keep the old ones).

Host-to-device copies of loaded entries (:func:`upload`) go through pinned memory on a side CUDA stream, so
they overlap the forward running on the default stream; on a CPU they are no-ops.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from .errors import InvalidInputError
from .kv import KV, reserved_cache


@dataclass(slots=True)
class BufferedKV(KV):
    """The first rows of a :class:`WindowBuffer` as a placed KV (views, no copy). A forward given it as its
    whole past runs on the buffer itself (``runner.past_cache``)."""

    buffer: WindowBuffer | None = None


#: What a row range holds, as the objects its placed KV is a function of (compared by identity), with a
#: tag naming the function: ``("free", kv)`` is ``kv`` rotated to the rows' positions.
Key = tuple[Any, ...]


@dataclass(slots=True)
class _Held:
    """Rows ``[start, stop)`` written from ``keys`` (any of them names their content); ``note`` is what the
    writer asked to get back when the rows are reused."""

    stop: int
    keys: tuple[Key, ...]
    note: Any


def _same(a: Key, b: Key) -> bool:
    """Keys name the same content: the same objects, and equal ints and tags."""
    return len(a) == len(b) and all(
        x is y or (type(x) is type(y) and isinstance(x, int | str) and x == y) for x, y in zip(a, b, strict=True)
    )


def _views_of(t: torch.Tensor) -> int | None:
    """How many tensors other than ``t`` share its storage (views), or None where torch cannot tell."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(t.untyped_storage()._cdata)) - _own_refs()


@functools.cache
def _own_refs() -> int:
    """The storage references of a tensor no one else views (itself and the storage object counting it)."""
    t = torch.empty(1)
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class WindowBuffer:
    """Per-layer K/V tensors ``(L, capacity, H, D)`` on one device that a window is assembled into."""

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        key_dim: int,
        value_dim: int,
        capacity: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if capacity < 1:
            raise InvalidInputError(f"a window buffer needs a capacity >= 1, got {capacity}")
        self.device = torch.device(device)
        self.keys = torch.empty(num_layers, capacity, num_heads, key_dim, dtype=dtype, device=self.device)
        self.values = torch.empty(num_layers, capacity, num_heads, value_dim, dtype=dtype, device=self.device)
        self.positions = torch.zeros(capacity, dtype=torch.long)
        self.deltas: torch.Tensor | None = None  # (capacity, 3), made when a part with M-RoPE offsets arrives
        self.filled = 0  # rows holding the window's tokens
        self._lent = 0  # rows [filled, _lent) belong to a forward's cache
        self._held: dict[int, _Held] = {}  # start row -> rows written from a key, still holding it
        self.grown = 0  # times the buffer outgrew its capacity
        self.detached = 0  # times a restart moved to new tensors because views of the old ones were held
        self.rows_written = 0  # rows written (every assembly so far)
        self.rows_reused = 0  # rows a later assembly took as they were

    @classmethod
    def like(cls, kv: KV, capacity: int, *, device: torch.device | str | None = None) -> WindowBuffer:
        """A buffer for KV shaped like ``kv`` (layers, heads, dims, dtype), on ``device`` (default: kv's)."""
        k, v = kv.keys, kv.values
        dev = k.device if device is None else device
        return cls(k.shape[0], k.shape[2], k.shape[3], v.shape[3], capacity, dtype=k.dtype, device=dev)

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[1])

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def _check(self, kv: KV) -> None:
        k, v = kv.keys, kv.values
        fits = k.shape[0] == self.keys.shape[0] and k.shape[2:] == self.keys.shape[2:]
        if not fits or v.shape[2:] != self.values.shape[2:]:
            raise InvalidInputError(
                f"KV of shape {tuple(k.shape)} / {tuple(v.shape)} does not fit a buffer of "
                f"{tuple(self.keys.shape)} / {tuple(self.values.shape)}"
            )
        if k.dtype != self.keys.dtype or v.dtype != self.values.dtype:
            raise InvalidInputError(f"KV of dtype {k.dtype} written into a {self.keys.dtype} buffer")
        if kv.positions is None:
            raise InvalidInputError("a window buffer holds placed KV (positions set), not position-free KV")

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` rows in all: double the capacity (at least) into new tensors, rows so far
        copied once. Views handed out earlier keep the old tensors, unchanged."""
        if rows <= self.capacity:
            return
        self._move(max(rows, 2 * self.capacity))
        self.grown += 1

    def _move(self, cap: int) -> None:
        """Continue in new tensors of ``cap`` rows: the filled rows and the remembered ones copied once;
        the old tensors stay with whatever views of them are held."""
        top = max([self.filled, *(h.stop for h in self._held.values())])
        with torch.inference_mode(False):  # (a forward grows it in inference mode: its rows are written after)
            keys = self.keys.new_empty(self.keys.shape[0], cap, *self.keys.shape[2:])
            values = self.values.new_empty(self.values.shape[0], cap, *self.values.shape[2:])
            keys[:, :top].copy_(self.keys[:, :top])
            values[:, :top].copy_(self.values[:, :top])
            positions = self.positions.new_zeros(cap)
            positions[:top] = self.positions[:top]
            if self.deltas is not None:
                deltas = self.deltas.new_zeros(cap, 3)
                deltas[:top] = self.deltas[:top]
                self.deltas = deltas
        self.keys, self.values, self.positions = keys, values, positions
        self._lent = self.filled  # the old rows lent stay with the old tensors

    def _shared(self) -> bool:
        """Whether anything outside the buffer holds a view of its tensors (True where torch cannot tell)."""
        tensors = [self.keys, self.values, self.positions] + ([] if self.deltas is None else [self.deltas])
        views = [_views_of(t) for t in tensors]
        return any(v is None or v > 0 for v in views)

    def restart(self) -> None:
        """Start the next assembly at row 0, keeping the remembered rows for :meth:`reuse`. Views handed out
        before stay as they were: when any is still held, the buffer moves to new tensors first."""
        if self._shared():
            self._move(self.capacity)
            self.detached += 1
        self.filled = 0
        self._lent = 0

    def reuse(self, keys: Sequence[Key]) -> tuple[KV, Any] | None:
        """The rows at ``filled`` as a view, and the note they were written with, when they were written from
        one of ``keys`` and nothing has written over them since (``filled`` then moves past them); else None."""
        held = self._held.get(self.filled)
        if held is None or not any(_same(a, b) for a in keys for b in held.keys):
            return None
        start, self.filled = self.filled, held.stop
        self._lent = max(self._lent, self.filled)
        self.rows_reused += held.stop - start
        return self._rows(start, held.stop), held.note

    def _forget(self, start: int, stop: int) -> None:
        """Rows ``[start, stop)`` are written over: remembered rows that overlap them no longer hold their key."""
        for at in [a for a, h in self._held.items() if a < stop and h.stop > start]:
            del self._held[at]

    def write(self, start: int, kv: KV, *, keys: Sequence[Key] = (), note: Any = None) -> KV:
        """Write a placed ``kv`` at rows ``[start, start + len(kv))`` in place and return those rows as a view.
        With ``keys`` (what ``kv`` is a function of, see :data:`Key`), the rows are remembered for
        :meth:`reuse`, which hands back ``note``.

        ``start`` is at most ``filled`` (no holes) and not below it unless the caller owns the rows it
        rewrites (views of them change); the window's assembly only appends (:meth:`append`)."""
        self._check(kv)
        if not 0 <= start <= self.filled:
            raise InvalidInputError(f"write at row {start}: the buffer is filled up to row {self.filled}")
        stop = start + len(kv)
        self.reserve(stop)
        self._forget(start, stop)
        self.keys[:, start:stop].copy_(kv.keys, non_blocking=True)
        self.values[:, start:stop].copy_(kv.values, non_blocking=True)
        assert kv.positions is not None
        self.positions[start:stop] = kv.positions.to(self.positions.device)
        if kv.deltas is not None and self.deltas is None:
            self.deltas = torch.zeros(self.capacity, 3, dtype=torch.long)
        if self.deltas is not None:
            self.deltas[start:stop] = 0 if kv.deltas is None else kv.deltas.to(self.deltas.device)
        self.filled = max(self.filled, stop)
        self._lent = max(self._lent, self.filled)
        self.rows_written += stop - start
        if keys:
            self._held[start] = _Held(stop, tuple(keys), note)
        return self._rows(start, stop)

    def append(self, kv: KV, *, keys: Sequence[Key] = (), note: Any = None) -> KV:
        """Write ``kv`` after the rows filled so far (remembered under ``keys``); the view of its rows."""
        return self.write(self.filled, kv, keys=keys, note=note)

    def _rows(self, start: int, stop: int) -> KV:
        deltas = None if self.deltas is None else self.deltas[start:stop]
        return KV(self.keys[:, start:stop], self.values[:, start:stop], self.positions[start:stop], deltas)

    def view(self, n: int | None = None) -> BufferedKV:
        """The first ``n`` rows (default: all filled) as a placed KV, no copy."""
        n = self.filled if n is None else n
        if not 0 <= n <= self.filled:
            raise InvalidInputError(f"view of {n} rows: the buffer is filled up to row {self.filled}")
        deltas = None if self.deltas is None else self.deltas[:n]
        return BufferedKV(self.keys[:, :n], self.values[:, :n], self.positions[:n], deltas, self)

    def cache(self, past: KV, reserve: int, config: Any, device: torch.device | str) -> DynamicCache | None:
        """A transformers cache whose past is ``past`` (a :meth:`view` of every filled row), read in place,
        with the next ``reserve`` rows lent to the forward for its own tokens. None when the buffer cannot
        serve it (another device, a view of fewer rows, rows already lent, or a model whose cache has
        layers of its own kind); the caller then copies the past as usual."""
        n = len(past)
        if torch.device(device) != self.device or n != self.filled or self._lent > self.filled:
            return None
        if past.keys.data_ptr() != self.keys.data_ptr():  # a view of tensors the buffer has since outgrown
            return None
        self.reserve(n + reserve)
        rows = n + reserve
        self._forget(n, rows)  # the forward writes its tokens there
        keys = [self.keys[i, :rows].permute(1, 0, 2)[None] for i in range(self.keys.shape[0])]
        values = [self.values[i, :rows].permute(1, 0, 2)[None] for i in range(self.values.shape[0])]
        cache = reserved_cache(keys, values, n, config)
        if cache is not None:
            self._lent = rows
        return cache


def pinned_for_upload(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in page-locked host memory when CUDA is available (so a host-to-device copy can run
    asynchronously), else unchanged."""
    if tensor.device.type != "cpu" or not torch.cuda.is_available() or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


@functools.cache
def side_stream(device: torch.device) -> Any:
    """The CUDA stream uploads to ``device`` are issued on (one per device, beside the default stream)."""
    return torch.cuda.Stream(device=device)


def upload_tensors(
    tensors: Mapping[str, torch.Tensor], device: torch.device | str, stream: Any = None
) -> dict[str, torch.Tensor]:
    """``tensors`` with the floating-point ones on ``device`` (integer ones, such as layer indices or
    positions, stay where they are: they are read on the host). To CUDA, each copy is issued from pinned
    memory on ``stream`` (default: :func:`side_stream`), so it overlaps what the default stream is running,
    and the current stream waits for it before anything there reads the result; elsewhere ``.to``, which is
    a no-op for a tensor already there (on a CPU nothing is copied or pinned)."""
    dev = torch.device(device)
    moving = {n: t for n, t in tensors.items() if t.is_floating_point() and not _on(t, dev)}
    out = dict(tensors)
    if not moving:
        return out
    if dev.type != "cuda":
        out.update({n: t.to(dev) for n, t in moving.items()})
        return out
    stream = stream if stream is not None else side_stream(dev)
    pinned = {n: pinned_for_upload(t) for n, t in moving.items()}
    with torch.cuda.stream(stream):
        copies = {n: t.to(dev, non_blocking=True) for n, t in pinned.items()}
    current = torch.cuda.current_stream(dev)
    current.wait_stream(stream)
    for t in copies.values():
        t.record_stream(current)  # allocated on the side stream, used and freed on this one
    out.update(copies)
    return out


def upload(kv: KV, device: torch.device | str, stream: Any = None) -> KV:
    """``kv`` with its keys and values on ``device`` (:func:`upload_tensors`; positions and deltas stay on
    the host, where placed KV keeps them); ``kv`` itself when they are there already."""
    moved = upload_tensors({"keys": kv.keys, "values": kv.values}, device, stream)
    if moved["keys"] is kv.keys and moved["values"] is kv.values:
        return kv
    return KV(moved["keys"], moved["values"], kv.positions, kv.deltas)

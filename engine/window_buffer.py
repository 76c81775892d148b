"""A preallocated window KV buffer: the window is assembled in place and forwards run on top of it.

Without it, a window is a list of placed parts: every forward over it copies them into a fresh
transformers cache, and the assembled window is one more concatenation. Here each part is written once
into per-layer tensors ``(L, capacity, H, D)`` (token-major, like :class:`KV`), at its slot; the window
so far is a view of the first rows (no copy), and a forward takes those rows as its cache's past and
writes its own tokens into the rows after them (also no copy, :meth:`WindowBuffer.cache`).

Rows already written are never written again by the buffer itself, so every view it hands out stays as it
was. Rows lent to a forward's cache belong to that cache (a prompt's prefill kept for decoding reads
them): the buffer lends its free rows to one forward only, and a later forward over the same rows copies
the past as before. Beyond its capacity the buffer grows by doubling into new tensors (earlier views keep
the old ones).

Host-to-device copies of loaded entries (:func:`upload`) go through pinned memory on a side CUDA stream, so
they overlap the forward running on the default stream; on a CPU they are no-ops.
"""

from __future__ import annotations

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
        self.grown = 0  # times the buffer outgrew its capacity

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
        cap = max(rows, 2 * self.capacity)
        keys = self.keys.new_empty(self.keys.shape[0], cap, *self.keys.shape[2:])
        values = self.values.new_empty(self.values.shape[0], cap, *self.values.shape[2:])
        keys[:, : self.filled].copy_(self.keys[:, : self.filled])
        values[:, : self.filled].copy_(self.values[:, : self.filled])
        positions = self.positions.new_zeros(cap)
        positions[: self.filled] = self.positions[: self.filled]
        if self.deltas is not None:
            deltas = self.deltas.new_zeros(cap, 3)
            deltas[: self.filled] = self.deltas[: self.filled]
            self.deltas = deltas
        self.keys, self.values, self.positions = keys, values, positions
        self._lent = self.filled  # the old rows lent stay with the old tensors
        self.grown += 1

    def write(self, start: int, kv: KV) -> KV:
        """Write a placed ``kv`` at rows ``[start, start + len(kv))`` in place and return those rows as a view.

        ``start`` is at most ``filled`` (no holes) and not below it unless the caller owns the rows it
        rewrites (views of them change); the window's assembly only appends (:meth:`append`)."""
        self._check(kv)
        if not 0 <= start <= self.filled:
            raise InvalidInputError(f"write at row {start}: the buffer is filled up to row {self.filled}")
        stop = start + len(kv)
        self.reserve(stop)
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
        return self._rows(start, stop)

    def append(self, kv: KV) -> KV:
        """Write ``kv`` after the rows filled so far; the view of its rows."""
        return self.write(self.filled, kv)

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


def upload(kv: KV, device: torch.device | str, stream: Any = None) -> KV:
    """``kv`` on ``device``. To CUDA, the copy is issued from pinned memory on ``stream`` (a side stream: it
    overlaps what the default stream runs) and the current stream is made to wait for it, so the result is
    safe to use there; to the CPU (or the device ``kv`` is on) nothing is copied."""
    dev = torch.device(device)
    if kv.keys.device == dev:
        return kv
    if dev.type != "cuda":
        return kv.to(dev)
    stream = stream if stream is not None else torch.cuda.Stream(device=dev)
    keys, values = pinned_for_upload(kv.keys), pinned_for_upload(kv.values)
    with torch.cuda.stream(stream):
        k = keys.to(dev, non_blocking=True)
        v = values.to(dev, non_blocking=True)
    current = torch.cuda.current_stream(dev)
    current.wait_stream(stream)
    k.record_stream(current)
    v.record_stream(current)
    return KV(k, v, kv.positions, kv.deltas)

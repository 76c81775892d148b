"""Triton kernels for the operator on CUDA (see ``dispatch`` for when they serve).

* ``place``: one fused pass per row: canonical + rank-m patch, rotary band rotated to the target
  position, written straight into a destination KV buffer at the chunk's slot;
* ``relocate_many``: many chunks in one launch, each with its own slot and target;
* ``tables``: the exact float32 cos/sin tables both read;
* ``dispatch``: the Triton-or-torch choice, reported by ``kamera doctor``.

Importing this package does not import Triton; ``place`` and ``relocate_many`` do.
"""

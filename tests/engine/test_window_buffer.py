"""The window KV buffer: parts written in place equal their concatenation bit for bit, a forward on top of
the buffer (no copy of the past) gives the bits of a forward on a copied past, rows lent once, growth."""

from __future__ import annotations

import pytest
import torch

from kamera_engine import KV, InvalidInputError
from kamera_engine.window_buffer import BufferedKV, WindowBuffer, pinned_for_upload, upload
from tests.conftest import ANCHOR, random_ids, tiny_engine


def _parts(engine, n: int = 3) -> list[KV]:
    parts, pos = [engine.anchor_kv], len(ANCHOR)
    for i in range(n):
        can = engine.canonical(random_ids(7 + i, seed=10 + i))
        parts.append(engine.apply(can, None, pos))
        pos += len(can)
    return parts


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])
def test_written_parts_equal_their_concatenation(name: str) -> None:
    engine = tiny_engine(name)
    parts = _parts(engine)
    buf = WindowBuffer.like(parts[0], 8)  # too small: grows on the way
    views = [buf.append(p) for p in parts]
    want = KV.cat(parts)
    got = buf.view()
    assert isinstance(got, BufferedKV) and buf.grown >= 1
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert torch.equal(got.positions, want.positions)
    for v, p in zip(views, parts, strict=True):
        assert torch.equal(v.keys, p.keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])
def test_a_forward_on_the_buffer_equals_one_on_a_copied_past(name: str, dtype: torch.dtype) -> None:
    engine = tiny_engine(name)
    engine.model.to(dtype)
    parts = _parts(engine)
    n = sum(len(p) for p in parts)
    ids = random_ids(9, seed=5)
    ref = engine.forward(ids, parts, n, logits="all")  # the past copied into a fresh cache
    buf = WindowBuffer.like(parts[0], n + len(ids), device=engine.device)  # where a window's buffer lives
    for p in parts:
        buf.append(p)
    before = buf.keys.data_ptr()
    got = engine.forward(ids, buf.view(), n, logits="all")
    assert buf.keys.data_ptr() == before  # nothing reallocated: the forward wrote into the buffer
    assert torch.equal(got.logits, ref.logits)
    assert torch.equal(got.kv.keys, ref.kv.keys) and torch.equal(got.kv.values, ref.kv.values)
    assert torch.equal(buf.keys[:, n : n + len(ids)], ref.kv.keys)  # its tokens landed in the lent rows
    # the rows are lent to that forward's cache: a second forward copies the past, leaving them alone
    kept = buf.keys[:, n:].clone()
    again = engine.forward(random_ids(9, seed=6), buf.view(), n, logits="last")
    assert torch.equal(buf.keys[:, n:], kept)
    assert again.logits.shape[0] == 1


def test_a_view_of_fewer_rows_is_copied_not_lent() -> None:
    engine = tiny_engine("llama")
    parts = _parts(engine)
    buf = WindowBuffer.like(parts[0], 64)
    for p in parts:
        buf.append(p)
    assert buf.cache(buf.view(len(ANCHOR)), 3, engine.model.config, "cpu") is None
    assert buf.cache(buf.view(), 3, engine.model.config, "meta") is None


def test_bad_writes_are_refused_and_leave_the_buffer_alone() -> None:
    engine = tiny_engine("llama")
    parts = _parts(engine, 1)
    buf = WindowBuffer.like(parts[0], 64)
    buf.append(parts[0])
    with pytest.raises(InvalidInputError, match="filled"):
        buf.write(buf.filled + 1, parts[1])
    with pytest.raises(InvalidInputError, match="dtype"):
        buf.append(parts[1].to(dtype=torch.float16))
    with pytest.raises(InvalidInputError, match="position-free"):
        buf.append(KV(parts[1].keys, parts[1].values, None))
    with pytest.raises(InvalidInputError, match="capacity"):
        WindowBuffer(1, 1, 2, 2, 0, dtype=torch.float32)
    assert buf.filled == len(ANCHOR)


def test_upload_on_a_cpu_is_a_no_op() -> None:
    engine = tiny_engine("llama")
    kv = engine.anchor_kv
    assert upload(kv, "cpu") is kv
    pinned = pinned_for_upload(kv.keys)
    assert pinned.is_pinned() == torch.cuda.is_available()  # page-locked only where CUDA can use it
    assert torch.equal(pinned, kv.keys)

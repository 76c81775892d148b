"""Batched forwards: every row of a packed forward equals its own single-request forward."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kamera_engine.batch as batch_module
from kamera_engine import Engine, InvalidInputError
from kamera_engine.batch import ROWS_ATTENTION, Row, RowCache, batched_forward, column_logits, packed_length
from kamera_engine.kv import KV
from kamera_engine.runner import call_with_cache, run_forward
from tests.conftest import ANCHOR, TEST_DEVICE, random_ids, tiny_model

#: (past tokens, new tokens) per row: an empty past, decode steps, prompts longer and shorter than pasts
SHAPES = [(0, 5), (7, 3), (12, 1), (3, 9), (20, 1)]
TOL = 1e-4


def _past(engine: Engine, n: int, seed: int) -> KV | None:
    if n == 0:
        return None
    return run_forward(engine.model, torch.tensor(random_ids(n, seed)), None, 0, logits="none").kv


def _rows_and_singles(tiny: Engine, shapes: list[tuple[int, int]], seed: int) -> tuple[list[Row], list]:
    """Per (past, new) shape: a row over a random past with random new ids, and that row's single forward."""
    rows, refs = [], []
    for i, (p, n) in enumerate(shapes):
        past = _past(tiny, p, seed + i)
        ids = torch.tensor(random_ids(n, seed + 100 + i))
        refs.append(run_forward(tiny.model, ids, past, p, logits="all"))
        rows.append(Row.at(RowCache.from_past(past, tiny.num_layers, reserve=n), ids, p, logits="all"))
    return rows, refs


def test_every_row_equals_its_single_forward(tiny: Engine) -> None:
    rows, refs = _rows_and_singles(tiny, SHAPES, seed=0)
    outs = batched_forward(tiny.model, rows)
    for (p, n), ref, out, row in zip(SHAPES, refs, outs, rows, strict=True):
        assert out is not None and out.shape == ref.logits.shape
        assert (out - ref.logits).abs().max() < TOL
        assert torch.equal(out.argmax(-1), ref.logits.argmax(-1))
        kv = row.cache.kv(p, p + n, None)
        assert (kv.keys - ref.kv.keys).abs().max() < TOL
        assert (kv.values - ref.kv.values).abs().max() < TOL
        assert len(row.cache) == p + n
    assert tiny.model.config._attn_implementation == "sdpa"  # the model is left as it was


def test_eager_attention_rows_equal_their_single_forward(tiny: Engine) -> None:
    """On eager attention (no is_causal flag) a prompt row from an empty cache still gets its causal mask."""
    config = tiny.model.config
    try:
        config._attn_implementation = "eager"
        shapes = [(0, 5), (7, 3), (12, 1)]
        rows, refs = _rows_and_singles(tiny, shapes, seed=60)
        outs = batched_forward(tiny.model, rows)
        for ref, out in zip(refs, outs, strict=True):
            assert out is not None and (out - ref.logits).abs().max() < TOL
        assert config._attn_implementation == "eager"
    finally:
        config._attn_implementation = "sdpa"


def test_a_short_step_is_filled_up_and_the_filler_reaches_no_row(tiny: Engine) -> None:
    """On a CPU with BLAS's linears, a step of 3, 7, 11 or 15 tokens gets one filler token; the filler is
    written to no cache and changes no row's logits. oneDNN's packed linears get no filler."""
    packed = tiny.linear_backend == "onednn"
    if TEST_DEVICE.type != "cpu":  # a GPU's BLAS needs no filler
        assert [packed_length(n, tiny.model) for n in (3, 7, 8)] == [3, 7, 8]
        return
    assert [packed_length(n, tiny.model) for n in (3, 7, 8)] == ([3, 7, 8] if packed else [4, 8, 8])
    tiny = Engine(tiny_model(tiny.name.removeprefix("tiny-")), None, anchor_ids=ANCHOR, linear_backend="native")
    got = [packed_length(n, tiny.model) for n in (1, 2, 3, 5, 7, 8, 11, 13, 15, 19, 40)]
    assert got == [1, 2, 4, 5, 8, 8, 12, 13, 16, 19, 40]
    assert packed_length(3, tiny_model("llama").to("meta")) == 3  # a GPU's BLAS needs no filler
    for shapes in ([(7, 1), (12, 1), (20, 1)], [(5, 6), (9, 1)]):  # 3 decode rows; a prompt chunk and a decode row (7)
        rows, refs = _rows_and_singles(tiny, shapes, seed=30)
        assert packed_length(sum(n for _, n in shapes), tiny.model) > sum(n for _, n in shapes)
        marks = [row.cache.mark() for row in rows]
        plain = batched_forward(tiny.model, rows, fill=False)
        for row, mark in zip(rows, marks, strict=True):
            row.cache.rollback(mark)
        outs = batched_forward(tiny.model, rows)
        for (p, n), ref, out, row, unfilled in zip(shapes, refs, outs, rows, plain, strict=True):
            assert out is not None and out.shape == ref.logits.shape
            assert (out - ref.logits).abs().max() < TOL
            assert unfilled is not None and (out - unfilled).abs().max() < TOL
            assert len(row.cache) == p + n  # the row's own tokens, no filler
            kv = row.cache.kv(p, p + n, None)
            assert (kv.keys - ref.kv.keys).abs().max() < TOL


def test_the_column_head_runs_only_inside_a_batched_forward(tiny: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """On BLAS's linears (``linear_backend="native"``), a batched step of 2-8 rows computes its logits as
    (W @ h^T)^T (within tolerance of the single path); outside a batched forward the head stays nn.Linear's
    own, bit for bit. A packed head (the CPU default) keeps its own form everywhere, and so does a head on a GPU."""
    if tiny.linear_backend == "onednn":
        assert type(tiny.model.get_output_embeddings()) is not torch.nn.Linear  # packed: no column form
    tiny = Engine(tiny_model(tiny.name.removeprefix("tiny-")), None, anchor_ids=ANCHOR, linear_backend="native")
    calls: list[tuple[int, ...]] = []

    def spy(head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return column_logits(head, x)

    monkeypatch.setattr(batch_module, "column_logits", spy)
    rows, refs = _rows_and_singles(tiny, [(7, 1), (12, 1), (20, 1), (3, 1)], seed=90)
    outs = batched_forward(tiny.model, rows)
    # on a CPU the column form ran, once, for the 4 rows
    column = [(1, 4, tiny.model.config.hidden_size)] if TEST_DEVICE.type == "cpu" else []
    assert calls == column
    for ref, out in zip(refs, outs, strict=True):
        assert out is not None and (out - ref.logits).abs().max() < TOL
    head = tiny.model.get_output_embeddings()
    x = torch.randn(1, 3, head.in_features, device=head.weight.device)
    assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight, head.bias)) and calls == column
    ten = _rows_and_singles(tiny, [(5, 1)] * 10, seed=95)[0]
    batched_forward(tiny.model, ten)
    assert calls == column  # 10 rows: the head's own form


def test_rows_decode_on_like_the_single_path(tiny: Engine) -> None:
    """Several decode steps in a batch, rows of different lengths, against transformers' own cache."""
    prompts = [random_ids(n, 50 + n) for n in (4, 11, 6)]
    caches = [RowCache.from_past(None, tiny.num_layers, reserve=len(p) + 4) for p in prompts]
    first = batched_forward(tiny.model, [Row.at(c, p, 0) for c, p in zip(caches, prompts, strict=True)])
    singles = [run_forward(tiny.model, torch.tensor(p), None, 0) for p in prompts]
    tokens = [int(f.argmax()) for f in first]  # type: ignore[union-attr]
    assert tokens == [int(s.logits[-1].argmax()) for s in singles]
    pos = [len(p) for p in prompts]
    single_caches = [s.cache for s in singles]
    for _ in range(3):
        outs = batched_forward(tiny.model, [Row.at(c, [t], q) for c, t, q in zip(caches, tokens, pos, strict=True)])
        for i, out in enumerate(outs):
            ref = call_with_cache(
                tiny.model,
                single_caches[i],
                input_ids=torch.tensor([[tokens[i]]], device=TEST_DEVICE),
                position_ids=torch.tensor([[pos[i]]], device=TEST_DEVICE),
                use_cache=True,
            ).logits[0, -1]
            assert out is not None and (out - ref).abs().max() < TOL
            tokens[i] = int(ref.argmax())
            assert int(out.argmax()) == tokens[i]
            pos[i] += 1


def test_logits_none_and_last_are_per_row(tiny: Engine) -> None:
    rows = [
        Row.at(RowCache.from_past(None, tiny.num_layers), random_ids(3, 1), 0, logits="none"),
        Row.at(RowCache.from_past(None, tiny.num_layers), random_ids(4, 2), 0, logits="last"),
    ]
    none, last = batched_forward(tiny.model, rows)
    assert none is None and last is not None and last.shape == (tiny.vocab_size,)


@pytest.mark.parametrize("where", ["embedding", "last layer"])
def test_a_failing_forward_leaves_every_row_as_it_was(tiny: Engine, where: str) -> None:
    """A forward that raises in its embedding (an id out of range: an IndexError on a CPU; on CUDA a
    device-side assert, which the engine's callers rule out by checking ids first) or after every layer but
    the last wrote its keys leaves every row's cache as it was."""
    good = RowCache.from_past(_past(tiny, 5, 0), tiny.num_layers, reserve=4)
    before = [(k.clone(), v.clone()) for k, v in good.layers()]
    other = RowCache.from_past(None, tiny.num_layers)
    if where == "embedding":
        if TEST_DEVICE.type != "cpu":
            pytest.skip("on CUDA an id out of range is a device-side assert (callers check ids first)")
        expected: type[Exception] = IndexError
        bad = Row.at(other, [tiny.vocab_size + 5], 0)  # out of the embedding: the forward raises
        hook = None
    else:
        expected = RuntimeError
        bad = Row.at(other, random_ids(3, 4), 0)
        last = next(m for m in tiny.model.modules() if getattr(m, "layer_idx", None) == tiny.num_layers - 1)

        def boom(*_: object) -> None:
            raise RuntimeError("the last layer fails")

        hook = last.register_forward_pre_hook(boom)
    try:
        with pytest.raises(expected):
            batched_forward(tiny.model, [Row.at(good, random_ids(2, 3), 5), bad])
    finally:
        if hook is not None:
            hook.remove()
    assert len(good) == 5 and len(other) == 0
    for (k, v), (k0, v0) in zip(good.layers(), before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert tiny.model.config._attn_implementation == "sdpa"


def test_row_checks_its_inputs() -> None:
    cache = RowCache.from_past(None, 2)
    with pytest.raises(InvalidInputError):
        Row(cache, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    with pytest.raises(InvalidInputError):
        Row(cache, torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(InvalidInputError):
        Row(cache, torch.tensor([1]), torch.tensor([0]), logits="some")


def test_a_single_forward_elsewhere_keeps_sdpa_semantics(tiny: Engine) -> None:
    """The registered name falls back to SDPA with SDPA's mask when no batch is running."""
    past = _past(tiny, 6, 1)
    ids = torch.tensor(random_ids(4, 9))
    ref = run_forward(tiny.model, ids, past, 6, logits="all").logits
    tiny.model.config._attn_implementation = ROWS_ATTENTION
    try:
        other = run_forward(tiny.model, ids, past, 6, logits="all").logits
    finally:
        tiny.model.config._attn_implementation = "sdpa"
    assert torch.equal(ref, other)


def _inline_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread plan of a process whose pool threads sleep (this test process imported torch first: its plan
    leaves OpenMP alone and runs nothing inline)."""
    import dataclasses

    import kamera_engine.threads as threads

    monkeypatch.setattr(threads, "_plan", dataclasses.replace(threads.thread_plan(), inline_small_kernels=True))


def _count_pools(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """The calling thread's OpenMP counts inside the big kernels (``pooled``: linears and attention), from now on."""
    import kamera_engine.packed_linear as packed_module

    big: set[int] = set()
    real = batch_module.pooled

    def spy(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        def counted(*a, **k):  # type: ignore[no-untyped-def]
            big.add(torch.get_num_threads())
            return fn(*a, **k)

        return real(counted, *args, **kwargs)

    monkeypatch.setattr(batch_module, "pooled", spy)
    monkeypatch.setattr(packed_module, "pooled", spy)
    return big


def _counting_forward(engine: Engine, rows: list[Row], monkeypatch: pytest.MonkeyPatch) -> tuple[list, set, set]:
    """Run ``rows`` in one batched forward, recording the calling thread's OpenMP count inside the big kernels
    (``pooled``: linears and attention) and inside a norm (a small kernel's module)."""
    big = _count_pools(monkeypatch)
    small: set[int] = set()
    norm = engine.model.model.layers[0].input_layernorm
    hook = norm.register_forward_hook(lambda *_: small.add(torch.get_num_threads()))
    try:
        outs = batched_forward(engine.model, rows)
    finally:
        hook.remove()
    return outs, big, small


def test_a_prompt_sized_forward_runs_small_kernels_inline_and_big_ones_on_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forward of a few hundred tokens on a CPU with packed linears runs its norms, rotary embedding and
    activations on the calling thread alone and its linears and attention on the pool, with the same results to
    the bit as with the pool everywhere; a decode step (nothing torch would split) keeps the pool throughout."""
    _inline_on(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a pool to leave (OpenMP grants two threads whatever the machine)
    try:
        # a CPU's thread pools, whatever device the other tests run on
        engine = Engine(tiny_model("llama").cpu(), None, name="tiny-llama", anchor_ids=ANCHOR)
        assert batch_module.inlines_small_kernels(engine.model, 300)  # 300 x 128 wide: past torch's grain
        assert not batch_module.inlines_small_kernels(engine.model, 3)

        def rows() -> list[Row]:
            past = _past(engine, 9, 1)
            prompt = Row.at(RowCache.from_past(past, engine.num_layers, reserve=300), random_ids(300, 2), 9, "all")
            decode = Row.at(RowCache.from_past(_past(engine, 5, 3), engine.num_layers, reserve=1), [7], 5)
            return [decode, prompt]

        inline, big, small = _counting_forward(engine, rows(), monkeypatch)
        assert big == {2} and small == {1}
        monkeypatch.setattr(batch_module, "inlines_small_kernels", lambda model, tokens: False)
        pooled_out, _, small = _counting_forward(engine, rows(), monkeypatch)
        assert small == {2}
        assert all(torch.equal(a, b) for a, b in zip(inline, pooled_out, strict=True))
        decode = [Row.at(RowCache.from_past(_past(engine, 5, 3), engine.num_layers, reserve=1), [7], 5)]
        monkeypatch.undo()
        _inline_on(monkeypatch)
        _, big, small = _counting_forward(engine, decode, monkeypatch)
        assert small == {2} and big <= {2}
    finally:
        torch.set_num_threads(before)


def test_a_prompt_sized_single_forward_runs_small_kernels_inline_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_forward`` (the unbatched path) of a few hundred tokens does the same: its norms inline, its linears and
    the model's own SDPA function on the pool, every logit and key the same to the bit, and the model's attention
    name back afterwards. An eager model is left alone (its mask is built another way)."""
    _inline_on(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine(tiny_model("llama").cpu(), None, name="tiny-llama", anchor_ids=ANCHOR)  # a CPU's pools
        past, ids = _past(engine, 9, 1), torch.tensor(random_ids(300, 2))
        big = _count_pools(monkeypatch)
        small: set[int] = set()
        norm = engine.model.model.layers[0].input_layernorm
        hook = norm.register_forward_hook(lambda *_: small.add(torch.get_num_threads()))
        try:
            inline = run_forward(engine.model, ids, past, 9, logits="all")
            assert big == {2} and small == {1}
            monkeypatch.setattr(batch_module, "inlines_small_kernels", lambda model, tokens: False)
            small.clear()
            pooled_out = run_forward(engine.model, ids, past, 9, logits="all")
            assert small == {2}
        finally:
            hook.remove()
        assert torch.equal(inline.logits, pooled_out.logits) and torch.equal(inline.kv.keys, pooled_out.kv.keys)
        assert engine.model.config._attn_implementation == "sdpa"
        monkeypatch.undo()
        eager = tiny_model("llama")
        eager.config._attn_implementation = "eager"
        assert isinstance(batch_module.inline_forward(eager, 300), contextlib.nullcontext)
    finally:
        torch.set_num_threads(before)

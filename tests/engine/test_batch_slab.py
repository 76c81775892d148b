"""Decode rows in a ``DecodeSlab`` attend in one call: every row still equals its single-request decode, with
rows of different lengths, rows joining and leaving, the slab growing, and prompt rows in the same forward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kamera_engine import Engine, InvalidInputError, SamplingParams, batch
from kamera_engine.batch import DecodeSlab, Row, RowCache, batched_forward
from kamera_engine.runner import call_with_cache, run_forward
from kamera_engine.scheduler import Scheduler
from tests.conftest import random_ids, tiny_engine

TOL = 1e-4


class _Single:
    """One request decoded alone on transformers' own cache: the reference a slab row must match."""

    def __init__(self, engine: Engine, prompt: list[int]) -> None:
        res = run_forward(engine.model, torch.tensor(prompt), None, 0)
        self.model, self.cache, self.pos = engine.model, res.cache, len(prompt)
        self.logits = res.logits[-1]

    def step(self, token: int) -> torch.Tensor:
        device = self.logits.device
        out = call_with_cache(
            self.model,
            self.cache,
            input_ids=torch.tensor([[token]], device=device),
            position_ids=torch.tensor([[self.pos]], device=device),
        )
        self.pos += 1
        self.logits = out.logits[0, -1].float()
        return self.logits


def _prefilled(engine: Engine, prompt: list[int], reserve: int) -> tuple[RowCache, torch.Tensor]:
    cache = RowCache.from_past(None, engine.num_layers, reserve=len(prompt) + reserve)
    (logits,) = batched_forward(engine.model, [Row.at(cache, prompt, 0)])
    assert logits is not None
    return cache, logits


def _check(out: torch.Tensor | None, ref: torch.Tensor) -> None:
    assert out is not None
    assert (out - ref).abs().max() < TOL
    assert int(out.argmax()) == int(ref.argmax())


def _decode_in_slab(
    engine: Engine, prompts: list[list[int]], steps: int, check: Callable[[torch.Tensor | None, torch.Tensor], None]
) -> list[RowCache]:
    """Prefill each prompt into a row of one slab, then decode ``steps`` greedy tokens of every row in one forward
    each, ``check``-ing each row's logits against the same request decoded alone; returns the rows."""
    slab = DecodeSlab()
    rows, refs, tokens = [], [], []
    for p in prompts:
        cache, logits = _prefilled(engine, p, steps + 3)
        slab.admit(cache, len(p) + steps + 3)
        rows.append(cache)
        refs.append(_Single(engine, p))
        check(logits, refs[-1].logits)
        tokens.append(int(refs[-1].logits.argmax()))
    assert len(slab) == len(prompts) and all(c.slab is slab for c in rows)
    for _ in range(steps):
        outs = batched_forward(
            engine.model, [Row.at(c, [t], r.pos) for c, t, r in zip(rows, tokens, refs, strict=True)]
        )
        for i, out in enumerate(outs):
            check(out, refs[i].step(tokens[i]))
            tokens[i] = int(refs[i].logits.argmax())
    return rows


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gpt_neox"])
def test_slab_rows_of_different_lengths_decode_like_alone(family: str) -> None:
    engine = tiny_engine(family)
    prompts = [random_ids(n, 30 + n) for n in (3, 17, 8, 29)]
    rows = _decode_in_slab(engine, prompts, 5, _check)
    assert [len(c) for c in rows] == [len(p) + 5 for p in prompts]


def test_rows_join_and_leave_and_a_prompt_rides_along() -> None:
    engine = tiny_engine("llama")
    slab = DecodeSlab()
    live: dict[int, tuple[RowCache, _Single, int]] = {}

    def join(k: int, n: int) -> None:
        p = random_ids(n, 70 + k)
        cache, _ = _prefilled(engine, p, 12)
        slab.admit(cache, len(p) + 12)
        ref = _Single(engine, p)
        live[k] = (cache, ref, int(ref.logits.argmax()))

    for k, n in enumerate((5, 14, 9)):
        join(k, n)
    left: RowCache | None = None
    for step in range(6):
        if step == 2:  # the first row leaves: the last row moves into its slot
            left = live.pop(0)[0]
            slab.release(left)
        if step == 3:
            join(3, 21)
        keys = sorted(live)
        prompt_cache = RowCache.from_past(None, engine.num_layers, reserve=6)
        prompt = random_ids(6, 200 + step)
        rows = [Row.at(live[k][0], [live[k][2]], live[k][1].pos) for k in keys]
        outs = batched_forward(engine.model, [*rows, Row.at(prompt_cache, prompt, 0)])
        _check(outs[-1], run_forward(engine.model, torch.tensor(prompt), None, 0).logits[-1])
        for k, out in zip(keys, outs, strict=False):
            cache, ref, token = live[k]
            _check(out, ref.step(token))
            live[k] = (cache, ref, int(ref.logits.argmax()))
    assert left is not None and left.slab is None and len(left) == 0
    assert len(slab) == 3 and sorted(c._slot for c, _, _ in live.values()) == [0, 1, 2]


def test_a_subset_of_the_slab_and_a_slab_that_grows() -> None:
    """Rows read from slots that are not the slab's first ones, and rows that outgrow its capacity."""
    engine = tiny_engine("qwen2")
    slab = DecodeSlab()
    entries = []
    for k, n in enumerate((4, 7, 11)):
        p = random_ids(n, 90 + k)
        cache, _ = _prefilled(engine, p, 1)
        slab.admit(cache, len(p) + 1)
        ref = _Single(engine, p)
        entries.append([cache, ref, int(ref.logits.argmax())])
    capacity = slab.capacity
    picked = [entries[2], entries[1]]  # slots 2 and 1, out of order
    for _ in range(capacity + 3 - 11):  # past the slab's first capacity
        outs = batched_forward(engine.model, [Row.at(c, [t], r.pos) for c, r, t in picked])
        for entry, out in zip(picked, outs, strict=True):
            _check(out, entry[1].step(entry[2]))
            entry[2] = int(entry[1].logits.argmax())
    assert slab.capacity > capacity
    cache, ref, token = entries[0]  # the row left out kept its KV through the growth
    (out,) = batched_forward(engine.model, [Row.at(cache, [token], ref.pos)])
    _check(out, ref.step(token))


def test_attended_keys_round_up_to_a_bucket_on_the_bucketed_devices_only() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert batch.attended_keys(65, 256, cpu) == 65  # nothing gained from reading the padding on a CPU
    assert [batch.attended_keys(n, 256, cuda) for n in (1, 64, 65, 130)] == [64, 64, 128, 192]
    assert batch.attended_keys(200, 200, cuda) == 200  # never past the slab's capacity


def test_bucketed_key_lengths_decode_like_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows attending a bucketed key length (the slab's padding masked) still equal their single decodes, and
    every attention call reads whole buckets."""
    monkeypatch.setattr(batch, "KEY_BUCKET", 16)
    monkeypatch.setattr(batch, "KEY_BUCKET_DEVICES", frozenset({"cpu", "cuda"}))
    spans: list[int] = []
    sdpa = batch._sdpa
    monkeypatch.setattr(batch, "_sdpa", lambda q, k, v, mask, kw: spans.append(k.shape[2]) or sdpa(q, k, v, mask, kw))
    prompts = [random_ids(n, 40 + n) for n in (5, 13, 20)]
    _decode_in_slab(tiny_engine("llama"), prompts, 6, _check)  # the longest row's keys: 21 to 26, one bucket of 32
    assert spans and set(spans) == {32}


def test_released_with_keep_decodes_on_alone() -> None:
    engine = tiny_engine("llama")
    slab = DecodeSlab()
    caches, refs = [], []
    for k, n in enumerate((6, 10)):
        p = random_ids(n, 120 + k)
        cache, _ = _prefilled(engine, p, 4)
        slab.admit(cache, len(p) + 4)
        caches.append(cache)
        refs.append(_Single(engine, p))
    slab.release(caches[0], keep=True)
    assert caches[0].slab is None and len(caches[0]) == 6 and len(slab) == 1
    token = int(refs[0].logits.argmax())
    (out,) = batched_forward(engine.model, [Row.at(caches[0], [token], 6)])
    _check(out, refs[0].step(token))
    slab.release(caches[1])
    assert len(slab) == 0 and slab.nbytes == 0


def test_a_failing_forward_leaves_slab_rows_as_they_were() -> None:
    """A forward that fails after every layer but the last wrote the rows' new keys into the slab."""
    engine = tiny_engine("llama")
    slab = DecodeSlab()
    caches = []
    for k, n in enumerate((5, 8)):
        cache, _ = _prefilled(engine, random_ids(n, 140 + k), 4)
        slab.admit(cache, n + 4)
        caches.append(cache)
    before = [[(k.clone(), v.clone()) for k, v in c.layers()] for c in caches]
    other = Row.at(RowCache.from_past(None, engine.num_layers), random_ids(3, 150), 0)
    last = engine.model.model.layers[-1].self_attn

    def boom(*_: object) -> None:
        raise RuntimeError("the last layer fails")

    hook = last.register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="the last layer fails"):
            batched_forward(engine.model, [Row.at(caches[0], [1], 5), Row.at(caches[1], [2], 8), other])
    finally:
        hook.remove()
    assert len(other.cache) == 0
    for cache, layers in zip(caches, before, strict=True):
        assert len(cache) == len(layers[0][0][0, 0])
        for (k, v), (k0, v0) in zip(cache.layers(), layers, strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0)


def test_admit_checks_its_row() -> None:
    engine = tiny_engine("llama")
    slab = DecodeSlab()
    with pytest.raises(InvalidInputError):
        slab.admit(RowCache.from_past(None, engine.num_layers), 4)  # nothing prefilled yet
    cache, _ = _prefilled(engine, random_ids(4, 1), 2)
    slab.admit(cache, 6)
    with pytest.raises(InvalidInputError):
        slab.admit(cache, 6)
    k = cache.layers()[0][0]
    wide = torch.zeros(1, k.shape[1] + 1, 4, k.shape[3])  # one more head than the slab's rows
    other = RowCache.from_layers([(wide, wide)] * engine.num_layers)
    with pytest.raises(InvalidInputError):
        slab.admit(other, 6)
    assert len(slab) == 1


# --- through the scheduler ----------------------------------------------------------------------------------

#: prompts of different lengths, greedy and sampled, answers of different lengths
REQUESTS = [
    (3, dict(max_new_tokens=9)),
    (19, dict(max_new_tokens=14, temperature=0.9, seed=5)),
    (8, dict(max_new_tokens=4)),
    (27, dict(max_new_tokens=11, temperature=1.1, top_p=0.8, seed=2)),
]


def _cases() -> list[tuple[list[int], dict]]:
    return [(random_ids(n, 300 + n), kw) for n, kw in REQUESTS]


def _alone(engine: Engine, prompt: list[int], kw: dict) -> list[int]:
    return list(engine.generate_ids(None, prompt, 0, SamplingParams(**kw)))


def test_scheduler_decodes_in_the_slab_and_matches_alone() -> None:
    engine = tiny_engine("llama")
    cases = _cases()
    expected = [_alone(engine, p, kw) for p, kw in cases]
    sched = Scheduler(engine)
    reqs = [sched.submit(None, p, 0, SamplingParams(**kw)) for p, kw in cases]
    got: list[list[int]] = [[] for _ in reqs]
    slab_rows, live = 0, set(range(len(reqs)))
    while live:  # each next() steps the whole batch
        for i in sorted(live):
            token = next(reqs[i], None)
            if token is None:
                live.discard(i)
            else:
                got[i].append(token)
        slab_rows = max(slab_rows, sched.stats().slab_rows)
    assert got == expected
    assert slab_rows == len(cases)  # every decoding request attended in the slab
    stats = sched.stats()
    assert stats.slab_rows == 0 and stats.slab_bytes == 0 and stats.kv_bytes == 0


def test_a_cancelled_row_leaves_the_slab_and_the_others_go_on() -> None:
    engine = tiny_engine("qwen2")
    cases = _cases()
    expected = [_alone(engine, p, kw) for p, kw in cases]
    sched = Scheduler(engine)
    reqs = [sched.submit(None, p, 0, SamplingParams(**kw)) for p, kw in cases]
    outs: list[list[int]] = [[next(r)] for r in reqs]
    assert sched.stats().slab_rows == len(cases)
    reqs[1].close()  # a client that left: the last row moves into its slot
    assert reqs[1].state == "cancelled" and sched.stats().slab_rows == len(cases) - 1
    for i in (0, 2, 3):
        outs[i].extend(reqs[i])
        assert outs[i] == expected[i]
    assert sched.stats().slab_bytes == 0


def test_the_scheduler_lays_slab_rows_out_in_slot_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a row leaves (the last row moves into its slot), the scheduler still packs its decode rows in slot
    order, so their attention reads and writes the slab's first slots as slices (one block, no gathers), and every
    answer is the one it gets alone."""
    engine = tiny_engine("qwen2")
    cases = _cases()
    expected = [_alone(engine, p, kw) for p, kw in cases]
    seen: list[tuple[int, int | None, bool]] = []
    real = batch._together

    def spy(rows: list[Row], base: str, spans: list[tuple[int, int]]) -> object:
        group = real(rows, base, spans)
        if group is not None:
            seen.append((len(group.members), group.first, group.in_place))
        return group

    monkeypatch.setattr(batch, "_together", spy)
    sched = Scheduler(engine)
    reqs = [sched.submit(None, p, 0, SamplingParams(**kw)) for p, kw in cases]
    outs: list[list[int]] = [[next(r)] for r in reqs]
    reqs[0].close()  # slot 0 is free: the last request's row moves there, ahead of the others' in slot order
    for i in (1, 2, 3):
        outs[i].extend(reqs[i])
        assert outs[i] == expected[i]
    assert len(seen) > 3 and {n for n, _, _ in seen} >= {2, 3}
    assert all(first == 0 and in_place for _, first, in_place in seen), seen


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gpt_neox"])
def test_a_masked_prompt_row_is_its_single_forward_bit_for_bit(family: str) -> None:
    """A prompt after a past attends with a mask; on a CPU the batched forward calls SDPA with grouped heads and
    an additive mask, which computes exactly what the model's own SDPA function does (repeating the heads)."""
    engine = tiny_engine(family)
    past = run_forward(engine.model, torch.tensor(random_ids(11, 5)), None, 0, logits="none").kv
    prompt = random_ids(7, 6)
    ref = run_forward(engine.model, torch.tensor(prompt), past, 11, logits="all")
    cache = RowCache.from_past(past, engine.num_layers, reserve=len(prompt))
    (out,) = batched_forward(engine.model, [Row.at(cache, prompt, 11, logits="all")])
    assert out is not None and torch.equal(out, ref.logits.float())
    kv = cache.kv(11, 11 + len(prompt), None)
    assert torch.equal(kv.keys, ref.kv.keys) and torch.equal(kv.values, ref.kv.values)


@pytest.mark.parametrize("budget", [None, "tight"])
def test_rows_join_a_running_slab_and_a_tight_budget_keeps_them_out(budget: str | None) -> None:
    engine = tiny_engine("llama")
    cases = _cases()
    expected = [_alone(engine, p, kw) for p, kw in cases]
    sched = Scheduler(engine)
    if budget == "tight":  # room for every request's own KV, not for the slab's padded slots
        need = sum((len(p) + kw["max_new_tokens"]) * sched.bytes_per_token for p, kw in cases)
        sched = Scheduler(engine, kv_budget_bytes=need)
    first = sched.submit(None, cases[0][0], 0, SamplingParams(**cases[0][1]))
    head = [next(first), next(first)]  # decoding before the others arrive
    rest = [sched.submit(None, p, 0, SamplingParams(**kw)) for p, kw in cases[1:]]
    outs = [[next(r)] for r in rest]
    if budget == "tight":
        assert sched.stats().slab_bytes <= need
    else:
        assert sched.stats().slab_rows == len(cases)
    outs = [head + list(first), *[o + list(r) for o, r in zip(outs, rest, strict=True)]]
    assert outs == expected
    assert sched.stats().kv_bytes == 0 and sched.stats().slab_bytes == 0


@pytest.mark.slow
def test_default_model_slab_rows_match_alone(default_engine: Engine) -> None:
    """The real model: 8 decode rows of different lengths in one slab, each step's log-probs within 1e-4 of
    the request decoded alone and the greedy tokens identical."""
    engine = default_engine
    prompts = [random_ids(n, 500 + n, vocab=engine.vocab_size) for n in (12, 40, 25, 70, 33, 9, 55, 18)]

    def check(out: torch.Tensor | None, ref: torch.Tensor) -> None:
        assert out is not None
        gap = (torch.log_softmax(out.float(), -1) - torch.log_softmax(ref.float(), -1)).abs().max()
        assert gap < TOL
        assert int(out.argmax()) == int(ref.argmax())

    _decode_in_slab(engine, prompts, 6, check)


def test_a_borrowed_row_copies_before_its_first_write() -> None:
    """Even when the lender is a view with room after it (a window buffer's rows, a reserved cache)."""
    engine = tiny_engine("llama")
    res = run_forward(engine.model, torch.tensor(random_ids(9, 71)), None, 0)
    spare = []
    for layer in res.cache.layers:
        k, v = (
            torch.zeros(*t.shape[:2], 16, t.shape[3], dtype=t.dtype, device=t.device)
            for t in (layer.keys, layer.values)
        )
        k[:, :, :9], v[:, :, :9] = layer.keys, layer.values
        spare.append((k, v))
    layers = [(k[:, :, :9], v[:, :, :9]) for k, v in spare]
    before = [(k.clone(), v.clone()) for k, v in layers]
    row = RowCache.borrowing(layers)
    assert len(row) == 9  # nothing copied: the row reads the lender's storage
    assert all(k.data_ptr() == lk.data_ptr() for (k, _), (lk, _) in zip(row.layers(), layers, strict=True))
    (out,) = batched_forward(engine.model, [Row.at(row, [5], 9)])
    assert out is not None and len(row) == 10
    for (k, v), (k0, v0), (rk, rv) in zip(layers, before, row.layers(), strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # the lender's tensors are as they were
        assert torch.equal(rk[:, :, :9], k0) and torch.equal(rv[:, :, :9], v0)
    assert all(not k[:, :, 9:].any() and not v[:, :, 9:].any() for k, v in spare)  # nothing written past the view
    with pytest.raises(InvalidInputError, match="same number of tokens"):
        RowCache.borrowing([layers[0], (spare[1][0], spare[1][1])])


def test_a_growing_slab_leaves_nothing_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Growing in slots and in tokens, the slab copies what it held and zeroes the rest: attention reads masked
    keys and values too, so none may be left as whatever the allocator returned (here: NaN)."""
    engine = tiny_engine("llama")
    real = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *a, **k: real(t, *a, **k).fill_(float("nan")))
    slab = DecodeSlab()
    rows, lengths = [], (3, 17, 8, 29, 5, 11)
    for n in lengths:
        cache, _ = _prefilled(engine, random_ids(n, 600 + n), 4)
        slab.admit(cache, n + 4)  # the fifth row grows the slab from 4 slots to 8
        rows.append(cache)
    slab.reserve(slab.capacity + 1)  # and in tokens
    assert slab.slots == 8 and slab.capacity > 64
    for bufs in (slab._keys, slab._values):
        for buf in bufs:
            assert not buf.isnan().any()
            for row, n in zip(rows, lengths, strict=True):
                assert not buf[row._slot, :, n:].any()
            assert not buf[len(rows) :].any()
    for row, n in zip(rows, lengths, strict=True):
        assert len(row) == n


@pytest.mark.parametrize("budget", [None, "tight"])
def test_answers_from_one_prefilled_prompt_leave_it_as_it_was(
    budget: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two answers decoded from the same snapshot (``submit_prefilled``), in the slab or, under a budget with no
    room for the slab's padded slots, each from a cache of its own: both equal the unbatched decode, and the
    snapshot's tensors, which the scheduler reads in place, are bit for bit unchanged. A row bound for the slab
    is copied once, into its slot; only a row left outside gets buffers of its own."""
    engine = tiny_engine("llama")
    real, copies = RowCache.from_layers.__func__, [0]

    def from_layers(cls, *args, **kwargs):
        copies[0] += 1
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(RowCache, "from_layers", classmethod(from_layers))
    prompt = random_ids(11, 72)
    snap = engine.forward(prompt, None, 0, logits="last").prefilled(len(prompt))
    before = [(k.clone(), v.clone()) for k, v in snap.layers]
    params = [dict(max_new_tokens=6), dict(max_new_tokens=6, temperature=0.8, seed=3)]
    want = [list(engine.continue_ids(snap, SamplingParams(**kw))) for kw in params]
    sched = Scheduler(engine)
    if budget == "tight":
        need = sum((len(prompt) + kw["max_new_tokens"]) * sched.bytes_per_token for kw in params)
        sched = Scheduler(engine, kv_budget_bytes=need)
    reqs = [sched.submit_prefilled(snap, SamplingParams(**kw)) for kw in params]
    outs = [[next(r)] for r in reqs]
    assert sched.stats().slab_rows == (0 if budget else 2)
    outs = [o + list(r) for o, r in zip(outs, reqs, strict=True)]
    assert outs == want
    assert copies[0] == (2 if budget else 0)
    for (k, v), (k0, v0) in zip(snap.layers, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert sched.stats().kv_bytes == 0 and sched.stats().slab_bytes == 0


@pytest.mark.slow
def test_default_model_mixed_step_is_the_same_with_small_kernels_inline(
    default_cpu_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real model, a step as a server runs it (slab decode rows, a question after a window, a page after the
    anchor): with its small kernels inline (the default at this size) every logit and every new key and value is
    the one the pool everywhere gives, to the bit."""
    import dataclasses

    import kamera_engine.threads as threads

    # this test process imported torch first, so its thread plan runs nothing inline: the plan of one that did not
    monkeypatch.setattr(threads, "_plan", dataclasses.replace(threads.thread_plan(), inline_small_kernels=True))
    engine = default_cpu_engine  # a CPU's small kernels: a GPU's run on the device, never inline
    assert batch.inlines_small_kernels(engine.model, 6 + 78 + 57)
    seen: list[int] = []
    real_pooled = batch.pooled

    def counting(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(int(threads._inline.pool or 0))  # set while the forward's small kernels run inline
        return real_pooled(fn, *args, **kwargs)

    monkeypatch.setattr(batch, "pooled", counting)

    def step() -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        slab = DecodeSlab()
        rows = []
        for n in (40, 70, 55, 90, 62, 81):
            cache, _ = _prefilled(engine, random_ids(n, 700 + n, vocab=engine.vocab_size), 2)
            slab.admit(cache, n + 2)
            rows.append(Row.at(cache, [11], n))
        window = run_forward(engine.model, torch.tensor(random_ids(136, 3, vocab=engine.vocab_size)), None, 0).kv
        anchor = run_forward(engine.model, torch.tensor(random_ids(24, 4, vocab=engine.vocab_size)), None, 0).kv
        ask = RowCache.from_past(window, engine.num_layers, reserve=78)
        page = RowCache.from_past(anchor, engine.num_layers, reserve=57)
        rows.append(Row.at(ask, random_ids(78, 5, vocab=engine.vocab_size), 136))
        rows.append(Row.at(page, random_ids(57, 6, vocab=engine.vocab_size), 24, logits="none"))
        outs = batched_forward(engine.model, rows)
        kv = [c.kv(n, n + k, None) for c, n, k in ((ask, 136, 78), (page, 24, 57))]
        return outs, [t for x in kv for t in (x.keys, x.values)]

    inline_logits, inline_kv = step()
    assert seen and all(seen)  # the step did run its small kernels inline
    monkeypatch.setattr(batch, "inlines_small_kernels", lambda model, tokens: False)
    pooled_logits, pooled_kv = step()
    assert all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(inline_logits, pooled_logits, strict=True)
    )
    assert all(torch.equal(a, b) for a, b in zip(inline_kv, pooled_kv, strict=True))


def test_a_steps_own_copies_run_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's own work around a forward (a request's KV into the slab, a finished one out) runs its
    kernels on the stepping thread alone where pool threads sleep; the forward itself keeps the pool."""
    import dataclasses

    import kamera_engine.threads as threads

    monkeypatch.setattr(threads, "_plan", dataclasses.replace(threads.thread_plan(), inline_small_kernels=True))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = tiny_engine("llama")
        counts: dict[str, set[int]] = {"admit": set(), "release": set(), "forward": set()}
        real_admit, real_release, real_forward = DecodeSlab.admit, DecodeSlab.release, batch.batched_forward

        def admit(self: DecodeSlab, *args: object, **kwargs: object) -> None:
            counts["admit"].add(torch.get_num_threads())
            real_admit(self, *args, **kwargs)  # type: ignore[arg-type]

        def release(self: DecodeSlab, *args: object, **kwargs: object) -> None:
            counts["release"].add(torch.get_num_threads())
            real_release(self, *args, **kwargs)  # type: ignore[arg-type]

        def forward(*args: object, **kwargs: object) -> object:
            counts["forward"].add(torch.get_num_threads())
            return real_forward(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(DecodeSlab, "admit", admit)
        monkeypatch.setattr(DecodeSlab, "release", release)
        monkeypatch.setattr("kamera_engine.scheduler.batched_forward", forward)
        sched = Scheduler(engine)
        cases = _cases()
        reqs = [sched.submit(None, p, 0, SamplingParams(**kw)) for p, kw in cases]
        assert [list(r) for r in reqs] == [_alone(engine, p, kw) for p, kw in cases]
        assert counts == {"admit": {1}, "release": {1}, "forward": {2}}
    finally:
        torch.set_num_threads(before)

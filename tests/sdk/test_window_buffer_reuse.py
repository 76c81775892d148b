"""The window keeps its KV buffer from one step to the next and rewrites only the rows whose placed KV
changed: over sequences of adds, slides, recalls, evictions, reorders and forks, the next-token log-probs,
greedy answers and assembled KV are the bits of the same window assembling a new buffer every step; rows
are really reused; and a view handed out before a step stays as it was."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kamera_engine import Engine, SamplingParams
from kamera_engine.window_buffer import WindowBuffer
from kamera_sdk import ContextWindow, WindowConfig
from tests.conftest import ANCHOR, random_ids, tiny_model

PROMPT = [9, 10, 11]
BUDGET = 200  # the buffer is sized for it: no step outgrows it (growth alone would move it to new tensors)
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


def _engine(name: str = "llama") -> Engine:
    return Engine(tiny_model(name, 3), None, name=f"tiny-{name}", anchor_ids=ANCHOR)


def _observe(engine: Engine, win: ContextWindow) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
    lp = win.next_token_logprobs(PROMPT)
    window = win.assemble()
    answer = list(engine.generate_ids(window, PROMPT, len(window), GREEDY))
    return lp, answer, window.keys.clone(), window.values.clone()


Op = Callable[[ContextWindow, list[str]], None]


def _add(seed: int, n: int = 8) -> Op:
    return lambda win, ids: ids.append(win.add(random_ids(n, seed=seed)))


def _slide(win: ContextWindow, ids: list[str]) -> None:
    win.slide(1)


def _recall_first(win: ContextWindow, ids: list[str]) -> None:
    win.recall(next(c for c in ids if c not in win))


def _evict_second(win: ContextWindow, ids: list[str]) -> None:
    win.evict(win.chunks[1])


def _reverse(win: ContextWindow, ids: list[str]) -> None:
    win.reorder(list(reversed(win.chunks)))


def _swap_last(win: ContextWindow, ids: list[str]) -> None:
    order = list(win.chunks)
    order[-1], order[-2] = order[-2], order[-1]
    win.reorder(order)


SCRIPT: list[Op] = [
    _add(100),
    _add(101, 6),
    _add(102),
    _add(103, 5),
    _swap_last,  # the leading slots keep their rows
    _slide,  # every survivor moves: rewritten
    _add(104),
    _recall_first,
    _evict_second,
    _reverse,
    _add(105, 7),
]


def _run(engine: Engine, policy: str, reuse: bool, options: dict | None = None) -> list[tuple]:
    config = WindowConfig(reuse_buffer=reuse, budget_tokens=BUDGET, **(options or {}))
    win = ContextWindow(engine, policy=policy, config=config)
    ids: list[str] = []
    out = []
    for op in SCRIPT:
        op(win, ids)
        out.append(_observe(engine, win))
        out.append(_observe(engine, win))  # asked again: nothing changed
    return out


def _assert_same(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b)
    for step, ((lp1, ans1, k1, v1), (lp2, ans2, k2, v2)) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(lp1, lp2), step
        assert ans1 == ans2, step
        assert torch.equal(k1, k2) and torch.equal(v1, v2), step


class _Counts:
    """Rows the window's buffers reused and wrote (a spy on ``WindowBuffer``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reused = self.written = 0
        reuse, write = WindowBuffer.reuse, WindowBuffer.write

        def counting_reuse(buf, keys):
            got = reuse(buf, keys)
            self.reused += 0 if got is None else len(got[0])
            return got

        def counting_write(buf, start, kv, **kw):
            self.written += len(kv)
            return write(buf, start, kv, **kw)

        monkeypatch.setattr(WindowBuffer, "reuse", counting_reuse)
        monkeypatch.setattr(WindowBuffer, "write", counting_write)


@pytest.mark.parametrize(
    "policy, config",
    [
        ("kamera", None),
        ("kamera", {"survivors": "patch"}),
        ("blind", None),
        ("prefix", None),
        ("cacheblend", None),
        ("recompute", None),
    ],
    ids=["kamera", "kamera-survivors-patch", "blind", "prefix", "cacheblend", "recompute"],
)
def test_reuse_gives_the_bits_of_a_new_buffer_every_step(
    policy: str, config: dict | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine()
    fresh = _run(engine, policy, reuse=False, options=config)
    counts = _Counts(monkeypatch)
    kept = _run(engine, policy, reuse=True, options=config)
    _assert_same(fresh, kept)
    if policy in ("kamera", "blind"):  # they place kept slots by rotation: those rows are reused
        assert counts.reused > 0


@pytest.mark.parametrize("name", ["qwen2", "phi3"])
def test_reuse_over_other_rope_styles(name: str) -> None:
    engine = _engine(name)
    _assert_same(_run(engine, "kamera", reuse=False), _run(engine, "kamera", reuse=True))


def test_an_add_rewrites_only_the_new_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four chunks admitted (each rotated once), then a fifth: with reuse, every earlier slot's rows are taken
    as they were; without it, every slot is placed again."""
    engine = _engine()

    def rows_after_fifth(reuse: bool) -> tuple[int, int]:
        win = ContextWindow(engine, policy="blind", config=WindowConfig(reuse_buffer=reuse, budget_tokens=BUDGET))
        for i in range(4):
            win.add(random_ids(8, seed=400 + i))
        win.next_token_logprobs(PROMPT)
        counts = _Counts(monkeypatch)
        win.add(random_ids(8, seed=404))
        win.next_token_logprobs(PROMPT)
        monkeypatch.undo()
        return counts.reused, counts.written

    reused, written = rows_after_fifth(True)
    assert reused == len(ANCHOR) + 4 * 8 and written == 8
    reused, written = rows_after_fifth(False)
    assert reused == 0 and written == len(ANCHOR) + 5 * 8


def test_forks_do_not_share_a_buffer() -> None:
    """Parent and fork go on differently; each gives the bits of its twin that never reuses rows."""
    engine = _engine()

    def run(reuse: bool) -> list[tuple]:
        win = ContextWindow(engine, policy="kamera", config=WindowConfig(reuse_buffer=reuse, budget_tokens=BUDGET))
        ids: list[str] = []
        for op in SCRIPT[:4]:
            op(win, ids)
        out = [_observe(engine, win)]
        child = win.fork()
        _add(500)(child, ids)
        _slide(win, ids)
        out += [_observe(engine, child), _observe(engine, win)]
        _reverse(child, ids)
        _add(501)(win, ids)
        out += [_observe(engine, win), _observe(engine, child)]
        return out

    _assert_same(run(False), run(True))


def test_a_view_handed_out_stays_as_it_was() -> None:
    """The window assembled at one step, held by the caller, is not written over by later steps (the buffer
    moves to new tensors); once nothing holds a view, the buffer is written in place again."""
    engine = _engine()
    win = ContextWindow(engine, policy="kamera", config=WindowConfig(budget_tokens=BUDGET))
    for i in range(3):
        win.add(random_ids(8, seed=600 + i))
    win.next_token_logprobs(PROMPT)  # the buffer sized for the window and a prompt: later steps fit
    held = win.assemble()
    keys, values = held.keys.clone(), held.values.clone()
    win.reorder(list(reversed(win.chunks)))
    win.next_token_logprobs(PROMPT)
    win.slide(1)
    win.next_token_logprobs(PROMPT)
    assert torch.equal(held.keys, keys) and torch.equal(held.values, values)
    ptr = win.assemble().keys.data_ptr()
    assert ptr != held.keys.data_ptr()
    del held
    win.add(random_ids(8, seed=700))
    assert win.assemble().keys.data_ptr() == ptr  # nothing held the old window: same tensors


def test_the_bench_compares_the_two_arms() -> None:
    """``kamera bench window``'s buffer comparison: both traces, both arms, the same log-probs bit for bit."""
    from kamera_sdk.bench.window import buffer_reuse
    from tests.conftest import tiny_chat_engine

    out = buffer_reuse(tiny_chat_engine(), quick=True)
    for name in ("agent", "grow"):
        assert out[name]["logprobs_equal"] is True
        assert set(out[name]["place_s_median"]) == {"reuse", "no_reuse"}
        assert out[name]["place_speedup"] > 0

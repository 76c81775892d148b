"""Windows on one engine used from several threads at once: each window's calls exclude each other (and
its forks'), other windows' calls run at the same time, and every window answers as it does alone:
next-token log-probs within float32 1e-4, and the same greedy tokens wherever the window alone picked its
token by more than the tolerance can move (a step whose top two log-probs are closer may flip, and its
answer may go another way from there). With a scheduler driving, the windows' forwards run in shared
steps (batched or alone, by timing: within 1e-4 of each other, not bit for bit); without one, they run
side by side on their threads."""

from __future__ import annotations

import threading

import pytest
import torch

from kamera_engine import Engine
from kamera_engine.scheduler import Scheduler
from kamera_sdk import ContextWindow
from kamera_sdk.config import WindowConfig
from tests.conftest import random_ids, tiny_model

TOL = 1e-4
#: a greedy pick whose top-two log-prob margin is below this may flip between a lone and a batched forward
MARGIN = 4 * TOL
ROUNDS = 4


class _CharTokenizer:
    """Token i decodes to the character U+0100 + i (one character per token, so an answer's text gives
    back its tokens): text answers from a tiny model."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x100 + i) for i in ids)


def _tokens(text: str) -> list[int]:
    return [ord(c) - 0x100 for c in text]


def _margin(logprobs: torch.Tensor) -> float:
    top = torch.topk(logprobs.float(), 2).values
    return float(top[0] - top[1])


@pytest.fixture
def engine() -> Engine:
    return Engine(tiny_model("llama"), _CharTokenizer(), name="tiny-llama", anchor_ids=[1, 2, 3, 4])


def _agent(window: ContextWindow, seed: int) -> list[tuple[str, object]]:
    """An agent loop: add a page, read log-probs, answer greedily, slide once three pages are held."""
    out: list[tuple[str, object]] = []
    for r in range(ROUNDS):
        window.add(random_ids(5 + (seed + r) % 7, 1000 * seed + r))
        prompt = random_ids(3 + r % 3, 500 * seed + r)
        out.append(("logprobs", window.next_token_logprobs(prompt)))
        answer = window.generate(prompt, max_new_tokens=6)
        tokens = _tokens(answer)
        # how clearly each greedy pick won (the log-probs after the prompt and the answer so far)
        margins = [_margin(window.next_token_logprobs(prompt + tokens[:k])) for k in range(len(tokens))]
        out.append(("answer", (tokens, margins)))
        if len(window) >= 3:
            out.append(("slid", window.slide(1)))
    return out


def _same_logprobs(a: torch.Tensor, b: torch.Tensor) -> None:
    """``a`` within the tolerance of ``b`` (the window alone), the same greedy pick where ``b``'s is clear."""
    assert (a - b).abs().max().item() < TOL
    if _margin(b) > MARGIN:
        assert int(a.argmax()) == int(b.argmax())


def _same(got: list[tuple[str, object]], want: list[tuple[str, object]]) -> None:
    assert [k for k, _ in got] == [k for k, _ in want]
    compared = 0
    for (kind, a), (_, b) in zip(got, want, strict=True):
        if kind == "logprobs":
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            _same_logprobs(a, b)
        elif kind == "answer":
            (tokens, _), (want_tokens, margins) = a, b  # type: ignore[misc]
            for k, (t, w) in enumerate(zip(tokens, want_tokens, strict=False)):
                if margins[k] <= MARGIN:
                    break  # a near tie: from here the answer may go another way
                assert t == w
                compared += 1
            else:
                assert len(tokens) == len(want_tokens)
        else:
            assert a == b
    assert compared > 0  # the answers were really compared (not every step a near tie)


def _windows(engine: Engine, policies: list[str], config: WindowConfig | None = None) -> list[ContextWindow]:
    return [ContextWindow(engine, policy=p, config=config) for p in policies]


def _hammer(windows: list[ContextWindow], sched: Scheduler | None) -> list[list[tuple[str, object]]]:
    out: list[list[tuple[str, object]]] = [[] for _ in windows]
    errors: list[BaseException] = []
    start = threading.Barrier(len(windows))

    def run(i: int) -> None:
        try:
            start.wait()
            if sched is None:
                out[i] = _agent(windows[i], i)
            else:
                with sched.serving(key=i):
                    out[i] = _agent(windows[i], i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(windows))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("policies", [["kamera", "kamera"], ["kamera", "recompute"], ["prefix", "cacheblend"]])
def test_two_windows_hammered_from_two_threads_answer_as_alone(engine: Engine, policies: list[str]) -> None:
    alone = [_agent(w, i) for i, w in enumerate(_windows(engine, policies))]
    sched = Scheduler(engine)
    sched.start()
    try:
        together = _hammer(_windows(engine, policies), sched)
    finally:
        sched.stop()
    for got, want in zip(together, alone, strict=True):
        _same(got, want)
    stats = sched.stats()
    assert stats.carried + stats.carried_alone > 0 and stats.carried_waiting == 0 and stats.kv_bytes == 0


def test_two_windows_forwards_run_in_one_step(engine: Engine) -> None:
    """A driver that steps once both windows' forwards wait: their materialisations share one forward."""
    pages = [[random_ids(7, 40 + i), random_ids(5 + i, 60 + i)] for i in range(2)]
    prompts = [random_ids(4, 90), random_ids(6, 91)]

    def window(i: int) -> ContextWindow:
        w = ContextWindow(engine, policy="kamera")
        for p in pages[i]:
            w.add(p)
        return w

    alone = [window(i).next_token_logprobs(prompts[i]) for i in range(2)]
    windows = [window(i) for i in range(2)]
    sched = Scheduler(engine)
    out: list[torch.Tensor | None] = [None, None]

    def run(i: int) -> None:
        with sched.serving(key=i):
            out[i] = windows[i].next_token_logprobs(prompts[i])

    with sched.driving():
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            waiting, live = sched.stats().carried_waiting, sum(t.is_alive() for t in threads)
            if waiting and waiting >= live:
                sched.step()
            else:
                threads[0].join(0.002)
    assert sched.stats().carried_rows_max == 2
    for got, want in zip(out, alone, strict=True):
        assert got is not None
        _same_logprobs(got, want)


def test_windows_on_threads_without_a_scheduler_answer_as_alone(engine: Engine) -> None:
    policies = ["kamera", "kamera", "recompute"]
    alone = [_agent(w, i) for i, w in enumerate(_windows(engine, policies))]
    for got, want in zip(_hammer(_windows(engine, policies), None), alone, strict=True):
        _same(got, want)


def test_windows_with_idle_work_on_threads_answer_as_alone(engine: Engine) -> None:
    """Background work on idle threads (every window's) while two windows' foreground calls run at once."""
    config = WindowConfig(rank=4, background="auto")
    alone = [_agent(w, i) for i, w in enumerate(_windows(engine, ["kamera", "kamera"], config))]
    sched = Scheduler(engine)
    sched.start()
    try:
        together = _hammer(_windows(engine, ["kamera", "kamera"], config), sched)
    finally:
        sched.stop()
    for got, want in zip(together, alone, strict=True):
        _same(got, want)


def test_a_window_and_its_fork_on_two_threads_answer_as_alone(engine: Engine) -> None:
    """A fork shares its parent's chunks: their calls exclude each other (one gate), in any interleaving."""
    base = ContextWindow(engine)
    base.add(random_ids(9, 77))
    base_alone = ContextWindow(engine)
    base_alone.add(random_ids(9, 77))
    fork_alone = base_alone.fork()
    alone = [_agent(base_alone, 0), _agent(fork_alone, 1)]
    fork = base.fork()
    assert fork._gate is base._gate
    sched = Scheduler(engine)
    sched.start()
    try:
        together = _hammer([base, fork], sched)
    finally:
        sched.stop()
    for got, want in zip(together, alone, strict=True):
        _same(got, want)

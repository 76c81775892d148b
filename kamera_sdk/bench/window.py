"""``kamera bench window``: a scripted agent trace, every policy side by side.

A web-research agent keeps a window of four pages (200-400 tokens each) over a growing stream of pages:
every step the oldest page slides out and a new one arrives; every 4th step the agent looks back and
recalls an evicted page instead; every 5th step it reranks the window. After each step it asks a
question. Per policy: time to first token (planning + assembling the window + the prompt's prefill),
tokens prefilled, next-token KL to ``recompute`` and whether the greedy 16-token answer equals
``recompute``'s. Work off the answer's path is timed too: ingest (a new page's canonical, compiled at
arrival) and ops (the slide, recall and reorder calls, which also form the patches set aside at the last
use), so that step time (ingest + ops + TTFT) counts everything a policy spends per step.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kamera_engine import Engine

from ..config import WindowConfig
from ..console import err, track
from ..window import ContextWindow
from .corpus import Page, Question, load_corpus
from .metrics import kl, mean, timed

POLICIES = ("recompute", "prefix", "blind", "cacheblend", "mpic", "kamera")
#: Extra arms: a policy under a non-default config, reported next to the policies.
ARMS: dict[str, tuple[str, WindowConfig]] = {
    # survivors re-conditioned on what remains (removal patch): where the default's drift comes from
    "kamera_survivors_patch": ("kamera", WindowConfig(survivors="patch")),
}


def _window(engine: Engine, name: str) -> ContextWindow:
    if name in ARMS:
        policy, config = ARMS[name]
        return ContextWindow(engine, policy=policy, config=config)
    return ContextWindow(engine, policy=name)


@dataclass
class Step:
    """One step of the trace: what happens to the window, then the question asked."""

    index: int
    ops: list[tuple[str, Any]] = field(
        default_factory=list
    )  # ("add", page) | ("slide", n) | ("recall", page) | ("reorder", seed)
    question: str = ""

    @property
    def kind(self) -> str:
        """What dominates the step's cost: ``first`` (the window filled), ``rerank``, ``recall`` or ``slide``."""
        ops = {op for op, _ in self.ops}
        if self.index == 0:
            return "first"
        return "rerank" if "reorder" in ops else "recall" if "recall" in ops else "slide"

    def describe(self) -> str:
        parts = []
        for op, arg in self.ops:
            parts.append(f"{op} {arg.id}" if isinstance(arg, Page) else f"{op} {arg}")
        return ", ".join(parts)


def build_trace(steps: int = 24, window: int = 4, seed: int = 0) -> list[Step]:
    """The scripted trace over the corpus pages (deterministic)."""
    corpus = load_corpus()
    pages = list(corpus.pages)
    questions = corpus.trace_questions
    rng = random.Random(seed)
    trace: list[Step] = []
    incoming = iter(pages)
    live: list[Page] = []
    gone: list[Page] = []
    first = Step(0)
    for _ in range(window):
        page = next(incoming)
        first.ops.append(("add", page))
        live.append(page)
    first.question = _question_for(live, questions, rng)
    trace.append(first)
    for i in range(1, steps):
        step = Step(i)
        step.ops.append(("slide", 1))
        gone.append(live.pop(0))
        if i % 4 == 0 and gone[:-1]:
            back = gone.pop(rng.randrange(len(gone) - 1))  # look back at an older page
            step.ops.append(("recall", back))
            live.append(back)
        else:
            page = next(incoming)
            step.ops.append(("add", page))
            live.append(page)
        if i % 5 == 0:
            step.ops.append(("reorder", i))
            rng_i = random.Random(i)
            rng_i.shuffle(live)
        step.question = _question_for(live, questions, rng)
        trace.append(step)
    return trace


def _question_for(live: list[Page], questions: list[Question], rng: random.Random) -> str:
    ids = {p.id for p in live}
    scored = sorted(questions, key=lambda q: -len(ids & set(q.pages)))
    best = [q for q in scored if len(ids & set(q.pages)) == len(ids & set(scored[0].pages))]
    return rng.choice(best).question


def apply_step(win: ContextWindow, step: Step, ids: dict[str, str]) -> tuple[float, float]:
    """Apply the step's operations to ``win``; returns the seconds spent in ingest (adds: canonical
    compiles at arrival) and in the other operations (slide, recall, reorder, with the patch forming
    they do off the answer's path)."""
    ingest = ops = 0.0
    for op, arg in step.ops:
        t0 = time.perf_counter()
        if op == "add":
            ids[arg.id] = win.add_text(arg.text + "\n\n")
            ingest += time.perf_counter() - t0
            continue
        if op == "slide":
            win.slide(arg)
        elif op == "recall":
            win.recall(ids[arg.id])
        elif op == "reorder":
            order = list(win.chunks)
            random.Random(arg).shuffle(order)
            win.reorder(order)
        else:
            raise ValueError(f"unknown trace operation {op!r}")
        ops += time.perf_counter() - t0
    return ingest, ops


def run_trace(
    engine: Engine, trace: list[Step], policies: tuple[str, ...] = POLICIES, answer_tokens: int = 16
) -> dict[str, Any]:
    wins = {p: _window(engine, p) for p in policies}
    ids: dict[str, dict[str, str]] = {p: {} for p in policies}
    rows: dict[str, dict[str, list]] = {
        p: {"ttft": [], "kl": [], "match": [], "ingest": [], "ops": []} for p in policies
    }
    per_step: list[dict[str, Any]] = []
    for step in track(trace, "window trace"):
        lps: dict[str, torch.Tensor] = {}
        answers: dict[str, str] = {}
        for p, win in wins.items():
            ingest, ops = apply_step(win, step, ids[p])
            rows[p]["ingest"].append(ingest)
            rows[p]["ops"].append(ops)
            t0 = time.perf_counter()
            lps[p] = win.next_token_logprobs(step.question)
            rows[p]["ttft"].append(time.perf_counter() - t0)
            answers[p] = win.generate(step.question, max_new_tokens=answer_tokens)
        for p in policies:
            rows[p]["kl"].append(kl(lps["recompute"], lps[p]))
            rows[p]["match"].append(answers[p].strip() == answers["recompute"].strip())
        per_step.append(
            {
                "step": step.index,
                "kind": step.kind,
                "ops": step.describe(),
                "ttft_s": {p: rows[p]["ttft"][-1] for p in policies},
                "kl": {p: rows[p]["kl"][-1] for p in policies},
                "answer": answers,
            }
        )
    result: dict[str, Any] = {}
    for p, win in wins.items():
        st = win.stats()
        result[p] = {
            "ttft_s_mean": mean(rows[p]["ttft"]),
            "prefill_tokens": st.tokens_prefilled,
            "kl_mean": mean(rows[p]["kl"]),
            "answers_match_recompute": mean([float(m) for m in rows[p]["match"]]),
            "ingest_s_mean": mean(rows[p]["ingest"]),
            "ingest_tokens": st.ingest_tokens,
            "ops_s_mean": mean(rows[p]["ops"]),
            "step_s_mean": mean([sum(t) for t in zip(rows[p]["ttft"], rows[p]["ingest"], rows[p]["ops"], strict=True)]),
            "forwards": st.forwards,
            "patches_formed": st.patches_formed,
            "patches_reused": st.patches_reused,
            "survivors_rotated": st.survivors_rotated,
            "kl_max": max(rows[p]["kl"]),
        }
    result["steps"] = per_step
    if "prefix" in result and "kamera" in result:
        result["kamera_ttft_over_prefix"] = result["kamera"]["ttft_s_mean"] / result["prefix"]["ttft_s_mean"]
        result["kamera_ttft_over_prefix_by_kind"] = {
            kind: mean([r["ttft_s"]["kamera"] for r in rows_k]) / mean([r["ttft_s"]["prefix"] for r in rows_k])
            for kind in ("first", "slide", "recall", "rerank")
            if (rows_k := [r for r in per_step if r["kind"] == kind])
        }
    return result


def slide_floor(engine: Engine, step: Step, repeats: int = 3) -> dict[str, float]:
    """What a slide step cannot go below: prefilling the new page (and the question) over the other pages,
    against prefilling the whole window, side by side (best of ``repeats``). The new page's conditioning
    needs its forward in context (the paper's open problem is estimating it without one)."""
    pages = [arg.text + "\n\n" for op, arg in step.ops if op == "add"]
    if len(pages) < 2:
        raise ValueError("slide_floor needs a step that adds at least two pages")
    ids = [engine.tokenize(t) for t in pages]
    q = engine.prompt_ids(step.question)
    a = len(engine.anchor_ids)
    old = [t for page in ids[:-1] for t in page]
    past = engine.forward(old, engine.anchor_kv, a, logits="none").kv
    window = [engine.anchor_kv, past]

    new_s = timed(lambda: engine.forward(ids[-1] + q, window, a + len(old)), repeat=repeats, warmup=0, reduce=min)
    full_s = timed(lambda: engine.forward(old + ids[-1] + q, engine.anchor_kv, a), repeat=repeats, warmup=0, reduce=min)
    return {
        "new_page_tokens": len(ids[-1]),
        "window_tokens": len(old) + len(ids[-1]),
        "new_page_forward_s": new_s,
        "window_prefill_s": full_s,
        "ratio": new_s / full_s,
    }


def run(engine: Engine, *, quick: bool = False) -> dict[str, Any]:
    steps = 8 if quick else 24
    trace = build_trace(steps=steps)
    err.print(f"[bold]window[/] trace on {engine.name}: {steps} steps, window of 4 pages")
    result = run_trace(engine, trace, (*POLICIES, *ARMS))
    result["trace"] = {"steps": steps, "window_chunks": 4, "ops": [s.describe() for s in trace]}
    result["slide_floor"] = slide_floor(engine, trace[0])
    return result

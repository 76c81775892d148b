"""``kamera bench window``: a scripted agent trace, every policy side by side.

A web-research agent keeps a window of four pages (200-400 tokens each) over a growing stream of pages:
every step the oldest page slides out and a new one arrives; every 4th step the agent looks back and
recalls an evicted page instead; every 5th step it reranks the window. After each step it asks a
question. Per policy: time to first token (planning + assembling the window + the prompt's prefill),
tokens prefilled, next-token KL to ``recompute`` and whether the greedy 16-token answer equals
``recompute``'s. Work off the answer's path is timed too: ingest (a new page's canonical, compiled at
arrival) and ops (the slide, recall and reorder calls, which also form the patches set aside at the last
use), so that step time (ingest + ops + TTFT) counts everything a policy spends per step.

``ttft_floor`` times, in the same run, what no policy that conditions new material exactly can skip: each
step's new or recalled pages prefilled over the exact window in front of them, and the prompt.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from kamera_engine import KV, Engine, InvalidInputError

from ..config import WindowConfig
from ..console import err, track
from ..stats import Work
from ..window import ContextWindow
from .corpus import Page, Question, load_corpus
from .metrics import kl, mean, timed_result

POLICIES = ("recompute", "prefix", "blind", "cacheblend", "mpic", "kamera")
#: Extra arms: a policy under a non-default config, reported next to the policies.
ARMS: dict[str, tuple[str, WindowConfig]] = {
    # survivors re-conditioned on what remains (removal patch): where the default's drift comes from
    "kamera_survivors_patch": ("kamera", WindowConfig(survivors="patch")),
}


#: The policies of the run with idle time (``--act-seconds``): Kamera with background work (``kamera``, run
#: by ``prepare`` in the idle time, as the idle thread would) and without (``kamera_sync``), the prefix cache
#: without and with idle pre-prefill, and recompute.
ACT_POLICIES = ("recompute", "prefix", "prefix_idle", "kamera_sync", "kamera")
ACT_ARMS: dict[str, tuple[str, WindowConfig]] = {
    "kamera": ("kamera", WindowConfig(background="manual")),
    "kamera_sync": ("kamera", WindowConfig()),
}


def _window(engine: Engine, name: str, arms: dict[str, tuple[str, WindowConfig]] = ARMS) -> ContextWindow:
    if name in arms:
        policy, config = arms[name]
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


def grow_trace(steps: int = 12, seed: int = 0) -> list[Step]:
    """A window that only grows: one new page per step, none leaving, a question after each (what reuse of
    the window's buffer serves best: every slot already there keeps its rows)."""
    corpus = load_corpus()
    rng = random.Random(seed)
    live: list[Page] = []
    trace = []
    for i, page in zip(range(steps), corpus.pages, strict=False):
        live.append(page)
        trace.append(Step(i, [("add", page)], _question_for(live, corpus.trace_questions, rng)))
    return trace


def buffer_reuse(engine: Engine, *, quick: bool = False) -> dict[str, Any]:
    """Assembly time per step with the window's KV buffer kept between steps (only the rows whose placed KV
    changed are written) against a new buffer every step (``WindowConfig(reuse_buffer=False)``: every slot
    rotated and written again), side by side in one run, policy ``kamera``, on two traces: the agent trace
    (every step slides, so every survivor moves and is rewritten: little to reuse) and a growing window.
    ``place_s_mean`` / ``place_s_median``: seconds per step placing slots into the buffer (rotations, patch
    GEMMs, writes; forwards excluded); ``place_speedup``: no_reuse over reuse, of the medians (a busy
    machine's outliers left out); ``ttft_s_mean``: the whole first token. The two arms' next-token
    log-probs are compared bit for bit (``logprobs_equal``)."""
    traces = {"agent": build_trace(steps=8 if quick else 24), "grow": grow_trace(steps=6 if quick else 12)}
    out: dict[str, Any] = {}
    for name, trace in traces.items():
        arms = {arm: WindowConfig(reuse_buffer=arm == "reuse") for arm in ("reuse", "no_reuse")}
        wins = {arm: ContextWindow(engine, policy="kamera", config=config) for arm, config in arms.items()}
        ids: dict[str, dict[str, str]] = {arm: {} for arm in arms}
        place: dict[str, list[float]] = {arm: [] for arm in arms}
        ttft: dict[str, list[float]] = {arm: [] for arm in arms}
        equal = True
        for step in track(trace, f"buffer reuse ({name})"):
            lps = {}
            order = list(arms) if step.index % 2 == 0 else list(reversed(arms))  # neither arm always first
            for arm in order:
                win = wins[arm]
                apply_step(win, step, ids[arm])
                before = _place_seconds(win)
                t0 = time.perf_counter()
                lps[arm] = win.next_token_logprobs(step.question)
                ttft[arm].append(time.perf_counter() - t0)
                place[arm].append(_place_seconds(win) - before)
            equal = equal and torch.equal(lps["reuse"], lps["no_reuse"])
        out[name] = {
            "steps": len(trace),
            "place_s_mean": {arm: mean(place[arm]) for arm in arms},
            "place_s_median": {arm: statistics.median(place[arm]) for arm in arms},
            "ttft_s_mean": {arm: mean(ttft[arm]) for arm in arms},
            "place_speedup": statistics.median(place["no_reuse"]) / max(statistics.median(place["reuse"]), 1e-12),
            "logprobs_equal": equal,
        }
    return out


def _place_seconds(win: ContextWindow) -> float:
    timing = win.stats().timings.get("place")
    return 0.0 if timing is None else timing.total_s


def known_ahead(step: Step) -> int:
    """How many of the step's leading operations the agent knows before the step (its slides: it chose
    what to drop); the rest (a new page, a recall, a rerank) arrives with the step."""
    n = 0
    while n < len(step.ops) and step.ops[n][0] == "slide":
        n += 1
    return n


def apply_step(
    win: ContextWindow, step: Step, ids: dict[str, str], ops_slice: slice = slice(None)
) -> tuple[float, float]:
    """Apply the step's operations (``ops_slice`` of them) to ``win``; returns the seconds spent in
    ingest (adds: canonical compiles at arrival) and in the other operations (slide, recall, reorder, with
    the patch forming they do off the answer's path)."""
    ingest = ops = 0.0
    for op, arg in step.ops[ops_slice]:
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


@dataclass
class PolicyStep:
    """One policy's step of the trace: seconds spent and work run, the next-token log-probs and the answer."""

    ingest: float
    ops: float
    idle: float
    ttft: float
    critical: float
    work: tuple[int, int]  # (forwards, tokens) on the critical path
    logprobs: torch.Tensor
    answer: str


def run_policy_step(
    win: ContextWindow, step: Step, ids: dict[str, str], act_seconds: float | None, answer_tokens: int
) -> PolicyStep:
    """Run one step of the trace on one window: the operations known ahead, the idle time (with
    ``act_seconds``), the rest of the step, the question (timed), then the greedy answer (untimed)."""
    ahead = known_ahead(step) if act_seconds is not None else 0
    ingest0, ops0 = apply_step(win, step, ids, slice(0, ahead))
    t0 = time.perf_counter()
    if act_seconds is not None:
        win.prepare(act_seconds)
    idle = time.perf_counter() - t0
    work0 = _critical_work(win)
    ingest, ops = apply_step(win, step, ids, slice(ahead, None))
    t0 = time.perf_counter()
    lps = win.next_token_logprobs(step.question)
    ttft = time.perf_counter() - t0
    work1 = _critical_work(win)
    answer = win.generate(step.question, max_new_tokens=answer_tokens)
    return PolicyStep(
        ingest=ingest0 + ingest,
        ops=ops0 + ops,
        idle=idle,
        ttft=ttft,
        critical=ingest + ops + ttft,
        work=(work1[0] - work0[0], work1[1] - work0[1]),
        logprobs=lps,
        answer=answer,
    )


def repeat_pass(
    engine: Engine,
    trace: list[Step],
    policies: tuple[str, ...],
    answer_tokens: int,
    act_seconds: float | None,
    arms: dict[str, tuple[str, WindowConfig]],
    label: str = "window trace (repeat)",
) -> dict[str, list[PolicyStep]]:
    """The trace once more on fresh windows (each its own chunk table, no store: nothing the earlier passes
    compiled or formed is found), policies interleaved per step as in the main pass. Per policy, its steps."""
    wins = {p: _window(engine, p, arms) for p in policies}
    ids: dict[str, dict[str, str]] = {p: {} for p in policies}
    out: dict[str, list[PolicyStep]] = {p: [] for p in policies}
    for step in track(trace, label):
        for p, win in wins.items():
            out[p].append(run_policy_step(win, step, ids[p], act_seconds, answer_tokens))
    return out


def work_differs(
    first: dict[str, list[tuple[int, int]]], other: dict[str, list[tuple[int, int]]], pass_index: int
) -> list[dict[str, Any]]:
    """The (policy, step) pairs where pass ``pass_index`` ran other critical-path (forwards, tokens) than the
    first pass (the idle time reached more or less background work): their timings are left out of that
    step's minimum, which only compares equal work."""
    return [
        {"pass": pass_index, "policy": p, "step": i, "work": list(b), "first_work": list(a)}
        for p, works in other.items()
        for i, (a, b) in enumerate(zip(first[p], works, strict=True))
        if a != b
    ]


def max_ratio(critical: list[float], reference: list[float]) -> float:
    """The largest per-step ratio of ``critical`` over ``reference`` seconds."""
    return max(c / r for c, r in zip(critical, reference, strict=True))


def run_trace(
    engine: Engine,
    trace: list[Step],
    policies: tuple[str, ...] = POLICIES,
    answer_tokens: int = 16,
    *,
    act_seconds: float | None = None,
    arms: dict[str, tuple[str, WindowConfig]] = ARMS,
    repeat: int = 1,
) -> dict[str, Any]:
    """Run the trace through a window per policy. ``act_seconds``: the agent acts that long before each
    step; the operations it knows ahead (``known_ahead``) are applied first, then every window gets the
    same idle time (``ContextWindow.prepare(seconds)``: policies with no idle work return at once, which
    changes nothing for them), then the rest of the step and the question. ``critical_s`` per step:
    the operations after the idle time, ingest and TTFT (what the agent waits for once it knows the step);
    ``critical_forwards`` / ``critical_tokens`` per step: the forwards and tokens run in that span (canonical
    compiles, slots prefilled in context, the prompt; idle-time work excluded), next to ``floor_tokens``.

    ``repeat`` > 1: after the main pass, ``repeat - 1`` further passes of the same trace on fresh windows for
    every policy (same act time); per step ``critical_s_min`` and ``ttft_s_min`` are each policy's least
    ``critical_s`` and TTFT over the passes (noise only adds time; the floor is a best of three too), and
    ``critical_over_recompute_max``, ``ttft_over_floor_by_kind_min`` and the ``*_ttft_over_prefix_min``
    ratios are taken from those minima (the keys without ``_min``, and ``critical_over_recompute_max_single``:
    the main pass's alone). Every pass must run the same critical work as the first (a pass that ran other
    work at a step is left out of that step's minima and listed in ``repeat_work_differs``)."""
    if repeat < 1:
        raise InvalidInputError(f"repeat must be at least 1, got {repeat}")
    wins = {p: _window(engine, p, arms) for p in policies}
    ids: dict[str, dict[str, str]] = {p: {} for p in policies}
    rows: dict[str, dict[str, list]] = {
        p: {"ttft": [], "kl": [], "match": [], "ingest": [], "ops": [], "critical": [], "idle": [], "work": []}
        for p in policies
    }
    per_step: list[dict[str, Any]] = []
    floor_tokens = 0
    before: set[str] = set()
    for step in track(trace, "window trace"):
        lps: dict[str, torch.Tensor] = {}
        answers: dict[str, str] = {}
        for p, win in wins.items():
            done = run_policy_step(win, step, ids[p], act_seconds, answer_tokens)
            for key in ("ingest", "ops", "idle", "ttft", "critical", "work"):
                rows[p][key].append(getattr(done, key))
            lps[p], answers[p] = done.logprobs, done.answer
        for p in policies:
            rows[p]["kl"].append(kl(lps["recompute"], lps[p]))
            rows[p]["match"].append(answers[p].strip() == answers["recompute"].strip())
        win = next(iter(wins.values()))  # every policy holds the same chunks in the same order
        chunks = [win.chunk(c).token_ids for c in win.chunks]
        floor_s, tokens = floor_step(
            engine, chunks, [c not in before for c in win.chunks], engine.prompt_ids(step.question)
        )
        floor_tokens += tokens
        before = set(win.chunks)
        per_step.append(
            {
                "step": step.index,
                "kind": step.kind,
                "ops": step.describe(),
                "ttft_s": {p: rows[p]["ttft"][-1] for p in policies},
                "ttft_floor_s": floor_s,
                "floor_tokens": tokens,
                "critical_s": {p: rows[p]["critical"][-1] for p in policies},
                "critical_forwards": {p: rows[p]["work"][-1][0] for p in policies},
                "critical_tokens": {p: rows[p]["work"][-1][1] for p in policies},
                "kl": {p: rows[p]["kl"][-1] for p in policies},
                "answer": answers,
            }
        )
    # per policy, per step: critical and TTFT seconds of every pass (the main pass first)
    passes: dict[str, dict[str, list[list[float]]]] = {
        key: {p: [[c] for c in rows[p][key]] for p in policies} for key in ("critical", "ttft")
    }
    first_work = {p: rows[p]["work"] for p in policies}
    differs: list[dict[str, Any]] = []
    for n in range(1, repeat):
        again = repeat_pass(engine, trace, policies, answer_tokens, act_seconds, arms, f"window trace (pass {n + 1})")
        found = work_differs(first_work, {p: [s.work for s in again[p]] for p in policies}, n + 1)
        differs.extend(found)
        left_out = {(d["policy"], d["step"]) for d in found}
        for key, seconds_of in passes.items():
            for p in policies:
                for i, (seconds, done) in enumerate(zip(seconds_of[p], again[p], strict=True)):
                    if (p, i) not in left_out:  # a minimum over equal work only
                        seconds.append(getattr(done, key))
    critical_min = {p: [min(s) for s in passes["critical"][p]] for p in policies}
    for i, row in enumerate(per_step):
        row["critical_s_min"] = {p: critical_min[p][i] for p in policies}
        row["critical_s_passes"] = {p: passes["critical"][p][i] for p in policies}
        row["ttft_s_min"] = {p: min(passes["ttft"][p][i]) for p in policies}
        row["ttft_s_passes"] = {p: passes["ttft"][p][i] for p in policies}
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
            "critical_s_mean": mean(rows[p]["critical"]),
            "idle_s_mean": mean(rows[p]["idle"]),
            "background_tokens": st.background_tokens,
            "answers_equal_recompute": sum(rows[p]["match"]),
            "ttft_over_floor_by_kind": _over_floor(per_step, lambda r, p=p: r["ttft_s"][p]),
            "ttft_over_floor_by_kind_min": _over_floor(per_step, lambda r, p=p: r["ttft_s_min"][p]),
            "kl_mean_by_kind": {
                kind: mean([r["kl"][p] for r in rows_k])
                for kind in ("first", "slide", "recall", "rerank")
                if (rows_k := [r for r in per_step if r["kind"] == kind])
            },
            "answers_equal_recompute_by_kind": {
                kind: sum(r["answer"][p].strip() == r["answer"]["recompute"].strip() for r in rows_k)
                for kind in ("first", "slide", "recall", "rerank")
                if (rows_k := [r for r in per_step if r["kind"] == kind])
            },
        }
        if "recompute" in result and p != "recompute":
            single = max_ratio(rows[p]["critical"], rows["recompute"]["critical"])
            result[p]["critical_over_recompute_max_single"] = single
            result[p]["critical_over_recompute_max"] = max_ratio(critical_min[p], critical_min["recompute"])
            works = zip(rows[p]["work"], rows["recompute"]["work"], strict=True)
            result[p]["critical_tokens_over_recompute_max"] = max(w[1] / max(r[1], 1) for w, r in works)
    result["steps"] = per_step
    result["repeat"] = repeat
    result["repeat_policies"] = list(policies)
    result["repeat_work_differs"] = differs  # steps of later passes left out of the minima (other work)
    result["ttft_floor"] = {
        "ttft_s_mean": mean([r["ttft_floor_s"] for r in per_step]),
        "prefill_tokens": floor_tokens,
    }
    if "prefix" in result:
        for suffix, key in (("", "ttft_s"), ("_min", "ttft_s_min")):
            ttfts: dict[str, Callable[[dict[str, Any]], float]] = {"floor": lambda r: r["ttft_floor_s"]}
            for name in ("kamera", "kamera_sync", "prefix_idle"):
                if name in result:
                    ttfts[name] = lambda r, name=name, key=key: r[key][name]
            for name, ttft in ttfts.items():
                result[f"{name}_ttft_over_prefix{suffix}"] = _over_prefix(per_step, ttft, key)
                result[f"{name}_ttft_over_prefix_by_kind{suffix}"] = {
                    kind: _over_prefix(rows_k, ttft, key)
                    for kind in ("first", "slide", "recall", "rerank")
                    if (rows_k := [r for r in per_step if r["kind"] == kind])
                }
    return result


def _critical_work(win: ContextWindow) -> tuple[int, int]:
    """(forwards, tokens) the window has run on answers' critical paths so far: canonical compiles, slots
    prefilled in context and prompts; work run in idle time is counted apart and left out."""
    work = win.stats().work
    counted = [work[w] for w in (Work.INGEST, Work.CONTEXT, Work.PROMPT) if w in work]
    return sum(c.forwards for c in counted), sum(c.tokens for c in counted)


def _over_prefix(steps: list[dict[str, Any]], ttft: Callable[[dict[str, Any]], float], key: str = "ttft_s") -> float:
    """Mean of ``ttft`` (read off each step) over prefix's mean TTFT (``key``: the main pass's, or the
    least over the passes), on ``steps``."""
    return mean([ttft(r) for r in steps]) / mean([r[key]["prefix"] for r in steps])


def _over_floor(steps: list[dict[str, Any]], ttft: Callable[[dict[str, Any]], float]) -> dict[str, float]:
    """Per step kind (and ``all``): mean of ``ttft`` over the floor's mean TTFT."""
    return {
        kind: mean([ttft(r) for r in rows_k]) / mean([r["ttft_floor_s"] for r in rows_k])
        for kind in ("first", "slide", "recall", "rerank", "all")
        if (rows_k := [r for r in steps if kind in (r["kind"], "all")])
    }


def floor_step(
    engine: Engine, chunks: list[list[int]], new: list[bool], prompt: list[int], repeats: int = 3
) -> tuple[float, int]:
    """The least a step's first token costs when new material is conditioned exactly: the chunks new to
    the window (added or recalled; the leading one excepted, its canonical is exact and compiled at
    ingest) are prefilled in context over the exact KV in front of them, and the prompt over the whole
    window, in as few forwards as the layout allows; everything else is taken as free (survivors, and
    chunks that a new one now precedes, keep what they had). Each forward is timed best of ``repeats``,
    so the floor errs low. Returns (seconds, tokens prefilled).

    No such policy gets below it: the paper leaves estimating a chunk's conditioning without its
    conditioned forward open (appendix B), and on the default model a partial re-prefill that keeps even
    a tenth of the layers from the canonical costs 47 times the rank-32 patch's KL (``kamera bench
    operator``, ``partial_reprefill_kl``).
    """
    a = len(engine.anchor_ids)
    past: list[KV] = [engine.anchor_kv]
    pos, seconds, tokens, i = a, 0.0, 0, 0
    prompt_done = False
    while i < len(chunks):
        if i == 0 or not new[i]:  # exact KV of what re-prefill holds here (not timed)
            past.append(engine.forward(chunks[i], past, pos, logits="none").kv)
            pos, i = pos + len(chunks[i]), i + 1
            continue
        j = i
        while j < len(chunks) and new[j]:
            j += 1
        run = [t for c in chunks[i:j] for t in c]
        prompt_done = j == len(chunks)  # the prompt rides in the last forward, as the policies do
        ids = run + prompt if prompt_done else run
        forward = partial(engine.forward, ids, past, pos, logits="last" if prompt_done else "none")
        t, res = timed_result(forward, repeat=repeats, warmup=0, reduce=min)
        seconds += t
        tokens += len(ids)
        past.append(res.kv.slice(0, len(run)))
        pos, i = pos + len(run), j
    if not prompt_done:
        seconds += timed_result(partial(engine.forward, prompt, past, pos), repeat=repeats, warmup=0, reduce=min)[0]
        tokens += len(prompt)
    return seconds, tokens


def run(engine: Engine, *, quick: bool = False, act_seconds: float | None = None, repeat: int = 1) -> dict[str, Any]:
    """The trace, every policy side by side; with ``act_seconds``, the idle-time run (``ACT_POLICIES``).
    ``repeat``: passes of the trace, every policy in each (``run_trace``)."""
    steps = 8 if quick else 24
    trace = build_trace(steps=steps)
    err.print(f"[bold]window[/] trace on {engine.name}: {steps} steps, window of 4 pages")
    if act_seconds is not None:
        result = run_trace(engine, trace, ACT_POLICIES, act_seconds=act_seconds, arms=ACT_ARMS, repeat=repeat)
        result["act_seconds"] = act_seconds
    else:
        result = run_trace(engine, trace, (*POLICIES, *ARMS), repeat=repeat)
        result["buffer_reuse"] = buffer_reuse(engine, quick=quick)
    result["trace"] = {"steps": steps, "window_chunks": 4, "ops": [s.describe() for s in trace]}
    return result

"""What a plan costs on the critical path, and the cheapest of a plan's exact alternatives.

A policy's plan says how each slot is served at the least *work per slot*; it does not see what the
plan costs as a whole: every run of ``forward`` slots is a forward of its own, a canonical still to be
compiled is one more, and the prompt is one more unless it rides in a trailing run. Recompute pays one
forward over the whole window and the prompt. So a use may do better by prefilling more tokens in fewer
forwards. Before a use executes, the window prices its policy's plan against two exact alternatives:

* ``merged``: every slot from the first ``forward`` slot to the end prefilled in one forward (with the
  prompt): the slots after the first run stop costing forwards of their own;
* ``fused``: one re-prefill of the whole window with the prompt, recompute's own build. It is exact, so
  it is always admissible, and it bounds the use's cost by recompute's.

Both only turn slots into ``forward`` slots (prefilled in context on exactly what is in front of them),
so the answer is never less exact than the policy's plan. The cheapest is taken (the policy's plan on a
tie, then ``merged``).

The model is linear in three things a forward does, in units of one token through the model:

    cost = forwards * per_forward + tokens * per_token + sum over forwards of n * (start + n) * per_span

``per_forward`` is what a pass costs whatever it runs (weights read once per layer, kernel launches, the
Python around it), ``per_span`` the attention a token pays per key it is scored against. A forward of
``n`` tokens after ``start`` scores each of them against all ``start + n`` keys: behind a past, the model's
attention gets an explicit causal mask, and the CPU kernel computes the masked half too (a 1,200-token
forward took 2.31 s on the default model, where 300 tokens and then 900 behind them took 0.47 + 1.77 s;
counting only the unmasked half would price the one forward cheaper). Rotations and
rank-m GEMMs are left out: they are memory-bound and small next to a forward. ``calibrate`` fits the
three from timed forwards on an engine; the defaults are rounded from such a fit on the default model
(float32, a busy 2-core CPU: a one-token forward took the time of about 15 tokens, 64 tokens behind 512
paid about 25 tokens' worth of attention).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kamera_engine import Engine

from .chunks import Chunk, PatchKind
from .plan import Plan, SlotPlan, Source

#: sources served from the chunk's canonical: one that is still to be compiled costs a forward
FROM_CANONICAL = frozenset({Source.LEAD, Source.PATCH, Source.BLIND, Source.SELECTIVE})


@dataclass(frozen=True, slots=True)
class PlanCost:
    """What one use runs on the critical path: forwards, tokens through the model, and attention span
    (the sum over tokens of the keys each is scored against: its forward's past and all its forward's
    tokens)."""

    forwards: int
    tokens: int
    span: float

    def total(self, model: CostModel) -> float:
        return self.forwards * model.per_forward + self.tokens * model.per_token + self.span * model.per_span

    def describe(self, model: CostModel) -> str:
        return f"{self.forwards} fwd, {self.tokens} tok, cost {self.total(model):.0f}"


@dataclass(frozen=True, slots=True)
class CostModel:
    """Coefficients of the linear model above, in units of one token's forward work."""

    per_forward: float = 16.0
    per_token: float = 1.0
    per_span: float = 3e-4

    def estimate(self, plan: Plan, prompt_len: int, missing: Callable[[Chunk], bool]) -> PlanCost:
        """The plan's critical-path work: a canonical compile for each slot served from a canonical that is
        ``missing``, one forward per run of ``forward`` slots, and the prompt's forward (riding in the
        trailing run when the plan ends with one)."""
        forwards, tokens, span = 0, 0, 0.0

        def run(n: int, start: int) -> None:
            nonlocal forwards, tokens, span
            forwards += 1
            tokens += n
            span += n * (start + n)

        for sp in plan.slots:
            if sp.source in FROM_CANONICAL and missing(sp.chunk):
                run(len(sp.chunk), plan.anchor_len)  # compiled after the chat anchor
        i, slots = 0, plan.slots
        while i < len(slots):
            if slots[i].source is not Source.FORWARD:
                i += 1
                continue
            j = i
            while j < len(slots) and slots[j].source is Source.FORWARD:
                j += 1
            n = sum(len(sp.chunk) for sp in slots[i:j])
            if j == len(slots):
                n += prompt_len  # the prompt rides in the trailing run
            run(n, slots[i].start)
            i = j
        if not slots or slots[-1].source is not Source.FORWARD:
            run(prompt_len, plan.end)
        return PlanCost(forwards, tokens, span)


def _prefilled(sp: SlotPlan, why: str) -> SlotPlan:
    """``sp`` as a ``forward`` slot: prefilled in context, forming the patch later reuse needs (none for the
    lead: it has nothing in front to be conditioned on)."""
    if sp.source is Source.FORWARD:
        return sp
    exact = PatchKind.EXACT
    return replace(sp, source=Source.FORWARD, patch=None, form_patch=bool(sp.antecedent), patch_kind=exact, reason=why)


def merged(plan: Plan) -> Plan | None:
    """Every slot from the plan's first ``forward`` slot on prefilled in one forward, or None when that is
    the plan itself (no forward, or one trailing run)."""
    first = next((i for i, sp in enumerate(plan.slots) if sp.source is Source.FORWARD), None)
    if first is None or all(sp.source is Source.FORWARD for sp in plan.slots[first:]):
        return None
    why = "cost plan: merged into one forward with the slots before it"
    slots = plan.slots[:first] + [_prefilled(sp, why) for sp in plan.slots[first:]]
    return Plan(plan.policy, slots, plan.anchor_len, plan.recompute)


def fused(plan: Plan) -> Plan:
    """One re-prefill of the whole window (with the prompt behind it): recompute's build, exact."""
    why = "cost plan: one fused re-prefill of the window"
    return Plan(plan.policy, [_prefilled(sp, why) for sp in plan.slots], plan.anchor_len, plan.recompute)


@dataclass(frozen=True, slots=True)
class Choice:
    """The plan a use executes, which candidate it was, and every candidate's estimate."""

    plan: Plan
    name: str  # "policy", "merged" or "fused"
    costs: dict[str, PlanCost]

    def describe(self, model: CostModel) -> str:
        others = ", ".join(f"{k} {c.describe(model)}" for k, c in self.costs.items())
        return f"cost plan: {self.name} ({others})"


def choose(plan: Plan, prompt_len: int, missing: Callable[[Chunk], bool], model: CostModel) -> Choice:
    """The cheapest of the policy's plan, ``merged`` and ``fused`` under ``model`` (in that order on a tie).
    A plan with selective recompute is left as it is (its repair is not a forward of slots)."""
    if plan.recompute is not None or not plan.slots:
        return Choice(plan, "policy", {"policy": model.estimate(plan, prompt_len, missing)})
    candidates: dict[str, Plan] = {"policy": plan}
    m = merged(plan)
    if m is not None:
        candidates["merged"] = m
    if any(sp.source is not Source.FORWARD for sp in plan.slots):
        candidates["fused"] = fused(plan)
    costs = {k: model.estimate(p, prompt_len, missing) for k, p in candidates.items()}
    best = min(candidates, key=lambda k: costs[k].total(model))  # dict order breaks ties
    return Choice(candidates[best], best, costs)


def calibrate(
    engine: Engine, sizes: Sequence[tuple[int, int]] = ((1, 0), (64, 0), (256, 0), (64, 512)), reps: int = 3
) -> CostModel:
    """Fit ``CostModel`` to timed forwards on ``engine``: (new tokens, tokens in front) per size, best of
    ``reps``. ``per_forward`` is the one-token time over the per-token slope, ``per_span`` the extra time
    the context in front adds, both in units of one token's time."""
    anchor = len(engine.anchor_ids)
    vocab = 100

    def timed(n: int, ctx: int) -> float:
        parts = [engine.anchor_kv]
        if ctx:
            parts.append(engine.forward([vocab + i % 50 for i in range(ctx)], parts, anchor, logits="none").kv)
        ids = [vocab + 7 + i % 50 for i in range(n)]
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            engine.forward(ids, parts, anchor + ctx, logits="none")
            best = min(best, time.perf_counter() - t0)
        return best

    times = {s: timed(*s) for s in sizes}
    (n1, _), (n2, _) = sizes[0], sizes[2]
    slope = max((times[sizes[2]] - times[sizes[0]]) / (n2 - n1), 1e-9)  # seconds per token
    per_forward = max(times[sizes[0]] / slope - n1, 0.0)
    n3, ctx3 = sizes[3]
    extra = max(times[sizes[3]] - times[sizes[1]], 0.0) / slope  # token units the context added
    per_span = extra / (n3 * ctx3) if ctx3 else 0.0
    return CostModel(per_forward=per_forward, per_token=1.0, per_span=per_span)

"""Reuse-aware placement (core paper, appendix E): choose the order of the window's chunks.

Because reorder is cheap, a window's contents are a set and their order is a free variable. The
objective is the work the next use would do: the tokens that must be prefilled in context (slots the
plan serves with FORWARD) for a candidate order; ties are broken by the number of chunks that move
(fewer is better, so answers stay stable) and then by the current order. Orders are searched
exhaustively up to ``EXHAUSTIVE_MAX`` chunks. Beyond, three starts are scored (the current order; the
order the chunks were conditioned in, each by the size of the antecedent it was formed on; a greedy
best-next-chunk build) and the best is improved by moving one chunk at a time while that lowers the
prefill (at most ``IMPROVE_PLANS`` orders tried).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from .chunks import ChunkId
from .plan import Source
from .policies.base import ReusePolicy, WindowView

EXHAUSTIVE_MAX = 6
#: orders the local search beyond EXHAUSTIVE_MAX tries at most (one plan each)
IMPROVE_PLANS = 2000


def order_cost(view: WindowView, order: list[ChunkId], policy: ReusePolicy) -> int:
    """Tokens ``policy`` (the window's) would prefill in context to serve ``order`` (its plan has no side
    effects, so trying orders changes nothing)."""
    by_id = {s.chunk_id: s for s in view.slots}
    trial = WindowView(view.engine, view.config, view.table, [by_id[c] for c in order], view.graph, view.step)
    plan = policy.plan(trial)
    return sum(len(sp.chunk) for sp in plan.slots if sp.source is Source.FORWARD)


def best_order(view: WindowView, policy: ReusePolicy) -> list[ChunkId]:
    """The order minimising (prefill tokens under ``policy``, chunks moved)."""
    current = [s.chunk_id for s in view.slots]
    if len(current) <= 1:
        return current

    def key(order: list[ChunkId]) -> tuple[int, int]:
        moved = sum(1 for a, b in zip(order, current, strict=True) if a != b)
        return order_cost(view, order, policy), moved

    if len(current) <= EXHAUSTIVE_MAX:
        return min((list(p) for p in itertools.permutations(current)), key=key)
    if key(current) == (0, 0):
        return current  # nothing to prefill and nothing moved: no order does better
    by_id = {s.chunk_id: s for s in view.slots}
    here = set(current)

    def conditioned_at(c: ChunkId) -> tuple[int, int]:
        """Where a chunk was conditioned: after the chunks still here that its KV was formed on (new ones
        last)."""
        slot = by_id[c]
        return (0, sum(1 for a in slot.antecedent or () if a in here)) if slot.materialised() else (1, 0)

    formed = sorted(current, key=conditioned_at)
    best = min((current, formed, _greedy(current, key)), key=key)
    return _improve(best, key)


def _greedy(current: list[ChunkId], key: Callable[[list[ChunkId]], tuple[int, int]]) -> list[ChunkId]:
    """Build the order one chunk at a time, each the best next one (the rest kept in the current order)."""
    order: list[ChunkId] = []
    rest = list(current)
    while rest:
        nxt = min(rest, key=lambda c: key([*order, c, *[r for r in rest if r != c]]))
        order.append(nxt)
        rest.remove(nxt)
    return order


def _improve(
    order: list[ChunkId], key: Callable[[list[ChunkId]], tuple[int, int]], budget: int = IMPROVE_PLANS
) -> list[ChunkId]:
    """Move one chunk to another place while that lowers the cost, trying at most ``budget`` orders (each
    is one plan of the window) so a long window's search stays bounded."""
    best, best_key = order, key(order)
    tried = 0
    while best_key > (0, 0) and tried < budget:
        for i, j in itertools.permutations(range(len(best)), 2):
            trial = [c for k, c in enumerate(best) if k != i]
            trial.insert(j, best[i])
            tried += 1
            trial_key = key(trial)
            if trial_key < best_key:
                best, best_key = trial, trial_key
                break
            if tried >= budget:
                break
        else:
            break  # a full pass without a better order: a local optimum
    return best

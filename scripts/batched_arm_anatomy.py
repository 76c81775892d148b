"""Where the serve loop's 8-session batched arm spends its model thread's time, on the default model, as JSON.

    OMP_NUM_THREADS=2 python scripts/batched_arm_anatomy.py profile      # ops of the stepping thread, one run
    OMP_NUM_THREADS=2 python scripts/batched_arm_anatomy.py round        # one round's forwards, linears timed
    OMP_NUM_THREADS=2 python scripts/batched_arm_anatomy.py switch [pairs] [intervals]
    OMP_NUM_THREADS=2 python scripts/batched_arm_anatomy.py kernels      # the same products and attention alone
    OMP_NUM_THREADS=2 python scripts/batched_arm_anatomy.py steps [runs] [step_tokens]
    OMP_NUM_THREADS=2 python scripts/batched_arm_anatomy.py fused [pairs]   # q|k|v and gate|up as one product each

``profile``: ``torch.profiler`` over one batched run on every thread (``kamera_sdk.bench.serve``'s loop: add a page,
ask, slide; 6 rounds, answers up to 48 tokens), the server's stepping thread picked out by a marker its first step
records (a ``Scheduler.observe`` observer): its ten costliest ops and the packed linears grouped by the rows they
multiply (decode steps, prompt steps, the head) with their FLOP and weight-read rates. ``round``: the forwards of
one steady-state round as ``round_ceiling`` runs them (8 pages in one forward, 8 asks in one, decode steps of 8 rows
and of 1), each with the time inside its linears. ``switch``: batched runs at the interpreter's default switch
interval and at others, alternated, with the stepping thread's run and runqueue time from ``/proc`` (Linux) between
the end of its first step and of its last, and its time in forwards and waiting for work over the sessions' loops
(``forward_s`` and ``idle_s``, as ``kamera bench serve`` reports them). ``kernels``: the model's own packed linears
run alone, all 210 layer linears in sequence at a number of rows, and a prompt's attention call (the ask's queries
over its keys) in the forms it could take, each the best of several runs. ``steps``: every step of batched runs as
``Scheduler.observe`` reports it (the packed steps and what ran alone), the run's time by kind of step, and its
tail: the time from the start of the last step that still held four or more decode rows or two window forwards, when
one or two sessions finish their answers nearly alone (with the steps after that one and the tokens their decode
rows made); with several ``step_tokens`` (comma-separated), runs alternate between them. ``fused``: each layer's
sibling linears (the attention's q, k and v projections; the MLP's gate and up) packed as one weight each, so a
layer runs four products instead of seven: the 30 layers' products alone at a number of rows, both ways (with
whether their outputs are bit-identical), then the 8-session loop batched and one at a time, plain and fused
alternated.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import kamera_engine  # noqa: F401  (before torch: the engine sets OpenMP's wait policy as torch loads)

# isort: split
import torch

from kamera_engine import Engine
from kamera_engine.packed_linear import PackedLinear
from kamera_engine.scheduler import StepRecord
from kamera_sdk.bench.metrics import timed
from kamera_sdk.bench.serve import arm, round_ids, round_shape

SESSIONS, ROUNDS, MAX_NEW = 8, 6, 48


class _SteppingThread:
    """Learns which thread steps the arm's scheduler from its first step (a ``Scheduler.observe`` observer, so it
    runs there): its native id, and a profiler marker recorded on it so its ops can be told apart; with
    ``schedstat``, its ``/proc`` times at its first step's end and at its last's."""

    MARK = "kamera.stepping_thread"

    def __init__(self, *, schedstat: bool = False) -> None:
        self.reads = schedstat
        self.native_id: int | None = None
        self.first: tuple[float, float, float] | None = None
        self.last: tuple[float, float, float] | None = None

    def schedstat(self) -> tuple[float, float, float]:
        """The thread's time on a core and waiting for one (``/proc``, Linux), and the wall clock, in seconds."""
        with open(f"/proc/self/task/{self.native_id}/schedstat") as f:
            run_ns, wait_ns, _ = f.read().split()
        return int(run_ns) / 1e9, int(wait_ns) / 1e9, time.perf_counter()

    def __call__(self, _: StepRecord) -> None:
        if self.native_id is None:
            self.native_id = threading.get_native_id()
            with torch.profiler.record_function(self.MARK):
                pass
            if self.reads:
                self.first = self.schedstat()
        if self.reads:
            self.last = self.schedstat()


def profile(engine: Engine) -> dict[str, Any]:
    thread = _SteppingThread()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        record_shapes=True,
        experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True),
    ) as p:
        run = arm(engine, SESSIONS, True, ROUNDS, MAX_NEW, observer=thread)
    events = p.events()
    marks = {e.thread for e in events if e.name == thread.MARK}
    if len(marks) != 1:
        raise RuntimeError(f"the stepping thread's marker was recorded on {len(marks)} threads, not one")
    self_s: dict[str, float] = defaultdict(float)  # each op's own time on the stepping thread
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for e in events:
        if e.thread not in marks or e.name == thread.MARK:
            continue
        self_s[e.key] += e.self_cpu_time_total / 1e6
        if e.key != "mkldnn::_linear_pointwise" or not e.input_shapes or len(e.input_shapes[1]) != 2:
            continue
        x, (n, k) = e.input_shapes[0], e.input_shapes[1]
        rows = 1
        for d in x[:-1]:
            rows *= d
        name = (
            "head"
            if n == engine.vocab_size
            else "decode (<= 8 rows)"
            if rows <= 8
            else ("prompt (9-128 rows)" if rows <= 128 else "prompt (> 128 rows)")
        )
        g = groups[name]
        g[0] += e.self_cpu_time_total / 1e6
        g[1] += 2 * rows * n * k
        g[2] += 4 * n * k
        g[3] += 1
    top = sorted(self_s.items(), key=lambda kv: kv[1], reverse=True)[:10]
    return {
        "tokens_per_s": run["tokens_per_s"],
        "stepping_thread_op_s": sum(self_s.values()),
        "top_ops_s": dict(top),
        "linears": {
            name: {"s": s, "gflop_per_s": fl / s / 1e9, "weight_gb_per_s": by / s / 1e9, "calls": calls}
            for name, (s, fl, by, calls) in sorted(groups.items())
        },
    }


def _timed_linears() -> tuple[list[float], Any]:
    spent = [0.0]
    original = PackedLinear.forward

    def forward(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        try:
            return original(self, x)
        finally:
            spent[0] += time.perf_counter() - t

    PackedLinear.forward = forward  # type: ignore[method-assign]
    return spent, original


def round_parts(engine: Engine, repeat: int = 5) -> dict[str, Any]:
    from kamera_engine.batch import DecodeSlab, Row, RowCache, batched_forward
    from kamera_engine.decode import step_logits

    shape = round_shape(engine)
    a, w, page, ask = shape["anchor_tokens"], shape["window_tokens"], shape["page_tokens"], shape["ask_tokens"]
    anchor = engine.forward(round_ids(engine, a, 0), None, 0, logits="none").kv if a else None
    window = engine.forward(round_ids(engine, w, 1), None, 0, logits="none").kv
    spent, original = _timed_linears()

    def runs(fn: Any, n: int) -> list[tuple[float, float]]:
        """``n`` calls of ``fn(k)``, each as (seconds, seconds inside the linears)."""
        out = []
        for k in range(n):
            spent[0] = 0.0
            t = time.perf_counter()
            fn(k)
            out.append((time.perf_counter() - t, spent[0]))
        return out

    def best(fn: Any) -> dict[str, float]:
        fn(0)  # warm-up
        total, linears = min(runs(fn, repeat))
        return {"s": total, "linears_s": linears}

    def median(steps: list[tuple[float, float]]) -> dict[str, float]:
        return {"s": statistics.median(s for s, _ in steps), "linears_s": statistics.median(x for _, x in steps)}

    def caches(rows: int, past: Any, reserve: int) -> list[RowCache]:
        return [RowCache.from_past(past, engine.num_layers, reserve=reserve) for _ in range(rows)]

    @torch.inference_mode()
    def pages(_: int) -> None:
        rows = caches(SESSIONS, anchor, page)
        batched_forward(
            engine.model, [Row.at(c, round_ids(engine, page, 10 + i), a, logits="none") for i, c in enumerate(rows)]
        )

    @torch.inference_mode()
    def asks(_: int) -> None:
        rows = caches(SESSIONS, window, ask)
        batched_forward(engine.model, [Row.at(c, round_ids(engine, ask, 50 + i), w) for i, c in enumerate(rows)])

    @torch.inference_mode()
    def decode(n: int) -> dict[str, float]:
        """Decode steps of ``n`` slab rows after the ask, as the scheduler runs them."""
        rows = caches(n, window, ask + 20)
        batched_forward(engine.model, [Row.at(c, round_ids(engine, ask, 50 + i), w) for i, c in enumerate(rows)])
        slab, pos = DecodeSlab(), w + ask
        for c in rows:
            slab.admit(c, pos + 20)
        return median(runs(lambda k: batched_forward(engine.model, [Row.at(c, [5], pos + k) for c in rows]), 15))

    @torch.inference_mode()
    def single_steps() -> dict[str, float]:
        """The one-at-a-time server's decode steps after the ask."""
        res = engine.forward(round_ids(engine, ask, 3), window, w, logits="last")
        return median(runs(lambda k: step_logits(engine.model, res.cache, 5, w + ask + k, engine.device), 15))

    try:
        out: dict[str, Any] = {"round_shape": shape, f"{SESSIONS}_pages": best(pages), f"{SESSIONS}_asks": best(asks)}
        decode(SESSIONS)  # warm-up
        out[f"decode_step_{SESSIONS}_rows"] = decode(SESSIONS)
        out["decode_step_1_row_slab"] = decode(1)
        out["decode_step_alone"] = single_steps()
    finally:
        PackedLinear.forward = original  # type: ignore[method-assign]
    return out


def switch(engine: Engine, pairs: int, intervals: list[float]) -> dict[str, Any]:
    default = sys.getswitchinterval()
    runs: dict[str, list[dict[str, float]]] = {str(s): [] for s in intervals}
    try:
        for i in range(pairs):
            for s in intervals if i % 2 == 0 else intervals[::-1]:
                sys.setswitchinterval(s)
                thread = _SteppingThread(schedstat=True)
                r = arm(engine, SESSIONS, True, ROUNDS, MAX_NEW, observer=thread)
                assert thread.first is not None and thread.last is not None
                a, b = thread.first, thread.last  # from the end of the first step to the end of the last
                runs[str(s)].append(
                    {
                        "tokens_per_s": r["tokens_per_s"],
                        "run_s": b[0] - a[0],
                        "runqueue_s": b[1] - a[1],
                        "wall_s": b[2] - a[2],
                        "forward_s": r["forward_s"],
                        "idle_s": r["idle_s"],
                    }
                )
                print(s, json.dumps(runs[str(s)][-1]), file=sys.stderr, flush=True)
    finally:
        sys.setswitchinterval(default)
    return {
        "runs": runs,
        "median_tokens_per_s": {s: statistics.median(r["tokens_per_s"] for r in rs) for s, rs in runs.items()},
    }


@torch.inference_mode()
def kernels(engine: Engine) -> dict[str, Any]:
    import torch.nn.functional as F

    layers = [m for n, m in engine.model.named_modules() if isinstance(m, PackedLinear) and "lm_head" not in n]
    linears = {}
    for rows in (1, 8, 56, 80, 96, 218, 448, 512):
        xs = {k: torch.randn(1, rows, k) for k in {m.in_features for m in layers}}
        s = timed(lambda xs=xs: [m(xs[m.in_features]) for m in layers], 5, reduce=min)
        flops = sum(2 * rows * m.in_features * m.out_features for m in layers)
        linears[str(rows)] = {"s": s, "gflop_per_s": flops / s / 1e9}
    cfg = engine.model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = cfg.hidden_size // heads
    group = heads // kv_heads
    q_len, kv_len = 80, 218  # the ask's forward: its tokens over the window's and its own
    q = torch.randn(1, heads, q_len, dim)
    k, v = torch.randn(1, kv_heads, kv_len, dim), torch.randn(1, kv_heads, kv_len, dim)
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]
    grouped = q.view(1, kv_heads, group * q_len, dim)
    grouped_mask = mask.repeat(1, 1, group, 1)

    def products() -> torch.Tensor:
        scores = (grouped @ k.transpose(-1, -2)) * dim**-0.5
        return scores.masked_fill(~grouped_mask, float("-inf")).softmax(-1) @ v

    forms = {
        "sdpa, grouped query heads, boolean mask (as the engine calls it)": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True
        ),
        "sdpa, no mask (not causal: a floor)": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "sdpa, query heads folded per key head, mask": lambda: F.scaled_dot_product_attention(
            grouped, k, v, attn_mask=grouped_mask
        ),
        "two products and a softmax": products,
    }
    attention = {name: timed(fn, 20, reduce=min) for name, fn in forms.items()}
    return {"linears_in_sequence": linears, "ask_attention_s_per_layer": attention, "threads": torch.get_num_threads()}


def _step_kind(step: StepRecord) -> str:
    if step.alone and not step.window_forwards:
        return "work run alone between steps"
    if step.window_forwards:
        return "window forwards (pages, asks), with any decode rows"
    if step.prompt_tokens:
        return "prompt chunks, with any decode rows"
    rows = step.decode_rows
    return "decode only, " + ("8 rows" if rows >= 8 else "4-7 rows" if rows >= 4 else "1-3 rows")


def steps(engine: Engine, runs: int, budgets: list[int]) -> dict[str, Any]:
    log: list[StepRecord] = []
    out: dict[str, list[dict[str, Any]]] = {str(b): [] for b in budgets}
    for i in range(runs):
        for b in budgets if i % 2 == 0 else budgets[::-1]:
            log.clear()
            r = arm(engine, SESSIONS, True, ROUNDS, MAX_NEW, app_options={"step_tokens": b}, observer=log.append)
            if not any(s.decode_rows >= 4 or s.window_forwards >= 2 for s in log):
                raise RuntimeError(f"no wide step in a run of {len(log)} steps: is the server batching?")
            start, end = min(s.ended - s.seconds for s in log), max(s.ended for s in log)
            wide = max(s.ended - s.seconds for s in log if s.decode_rows >= 4 or s.window_forwards >= 2)
            tail = [s for s in log if s.ended - s.seconds > wide]
            kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
            for s in log:
                k = kinds[_step_kind(s)]
                k[0] += 1
                k[1] += s.seconds
            in_steps = sum(s.seconds for s in log)
            out[str(b)].append(
                {
                    "tokens_per_s": r["tokens_per_s"],
                    "elapsed_s": r["elapsed_s"],
                    "steps": len(log),
                    "in_steps_s": in_steps,
                    "between_steps_s": end - start - in_steps,
                    "by_kind": {k: {"steps": n, "s": s} for k, (n, s) in sorted(kinds.items())},
                    "tail_s": end - wide,
                    "tail_steps": len(tail),
                    "tail_decode_tokens": sum(s.decode_rows for s in tail),
                }
            )
            print(b, json.dumps(out[str(b)][-1]), file=sys.stderr, flush=True)
    return {
        "runs": out,
        "median_tokens_per_s": {b: statistics.median(r["tokens_per_s"] for r in rs) for b, rs in out.items()},
    }


class _Siblings:
    """Linears of one parent that read the same input (``names``), run as one ``PackedLinear`` over their stacked
    weights: the first member called with an input computes all of them, the others take their columns while the
    parent's forward lasts (the cache is dropped as the parent's forward starts and ends). Off unless ``on[0]``."""

    def __init__(self, parent: torch.nn.Module, names: list[str], on: list[bool]) -> None:
        self.members = [getattr(parent, n) for n in names]
        if any(m.bias is not None for m in self.members):
            raise SystemExit("fused: the default model's sibling linears have no bias; this one has")
        weight = torch.cat([m.weight.detach() for m in self.members])
        self.fused = PackedLinear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.fused.weight = torch.nn.Parameter(weight, requires_grad=False)
        ends = list(itertools.accumulate(m.out_features for m in self.members))
        self.columns = list(zip([0, *ends[:-1]], ends, strict=True))
        self.on, self.local = on, threading.local()
        self.handles = [
            parent.register_forward_pre_hook(lambda *_: self.reset()),
            parent.register_forward_hook(lambda *_: self.reset()),
        ]
        for i, m in enumerate(self.members):
            m.forward = lambda x, i=i, own=m.forward: self.call(i, x) if self.on[0] else own(x)

    def reset(self) -> None:
        self.local.x = self.local.out = None

    def call(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.local, "x", None) is not x:
            self.local.x = x
            self.local.out = self.fused(x)
        a, b = self.columns[i]
        return self.local.out[..., a:b]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for m in self.members:
            del m.forward


def _layer_products(layers: Any, groups: list[_Siblings], x: torch.Tensor, xi: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's seven linears on ``x`` (``xi`` for the down projection), as the model calls them."""
    for g in groups:
        g.reset()  # outside a parent's forward nothing drops the cache: each pass computes afresh
    out = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.o_proj(x)]
        out += [mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj(xi)]
    return out


@torch.inference_mode()
def fused(engine: Engine, pairs: int) -> dict[str, Any]:
    on = [False]
    layers = engine.model.model.layers
    groups = []
    for layer in layers:
        groups.append(_Siblings(layer.self_attn, ["q_proj", "k_proj", "v_proj"], on))
        groups.append(_Siblings(layer.mlp, ["gate_proj", "up_proj"], on))
    try:
        products: dict[str, Any] = {}
        flops_per_row = sum(2 * m.in_features * m.out_features for m in layers.modules() if isinstance(m, PackedLinear))
        for rows in (1, 8, 56, 80, 136, 448):
            torch.manual_seed(rows)
            x = torch.randn(1, rows, layers[0].self_attn.q_proj.in_features)
            xi = torch.randn(1, rows, layers[0].mlp.down_proj.in_features)
            outs: dict[bool, list[torch.Tensor]] = {}
            times: dict[bool, float] = {}
            for way in (False, True):
                on[0] = way
                outs[way] = _layer_products(layers, groups, x, xi)
                times[way] = timed(lambda x=x, xi=xi: _layer_products(layers, groups, x, xi), 7, reduce=min)
            products[str(rows)] = {
                "plain_s": times[False],
                "fused_s": times[True],
                "speedup": times[False] / times[True],
                "gflop_per_s": {
                    k: rows * flops_per_row / times[w] / 1e9 for k, w in (("plain", False), ("fused", True))
                },
                "bit_identical": all(torch.equal(a, b) for a, b in zip(outs[False], outs[True], strict=True)),
            }
            print(rows, json.dumps(products[str(rows)]), file=sys.stderr, flush=True)
        arms: dict[str, dict[str, list[float]]] = {}
        for batch in (True, False):
            runs: dict[str, list[float]] = {"plain": [], "fused": []}
            for i in range(pairs):
                for way in (False, True) if i % 2 == 0 else (True, False):
                    on[0] = way
                    r = arm(engine, SESSIONS, batch, ROUNDS, MAX_NEW)
                    runs["fused" if way else "plain"].append(r["tokens_per_s"])
                    print("batched" if batch else "sequential", way, r["tokens_per_s"], file=sys.stderr, flush=True)
            arms["batched" if batch else "sequential"] = runs
        ratio = {
            way: statistics.median(arms["batched"][way]) / statistics.median(arms["sequential"][way])
            for way in ("plain", "fused")
        }
        return {"products_of_30_layers": products, "arms_tokens_per_s": arms, "ratio_of_medians": ratio}
    finally:
        on[0] = False
        for g in groups:
            g.remove()


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "profile"
    engine = Engine.load()
    if what == "kernels":
        print(json.dumps(kernels(engine), indent=1))
        return
    arm(engine, 2, True, 2, 8)  # warm-up
    if what == "profile":
        result = profile(engine)
    elif what == "round":
        result = round_parts(engine)
    elif what == "switch":
        pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 6
        intervals = [float(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [0.005, 0.0002]
        result = switch(engine, pairs, intervals)
    elif what == "steps":
        runs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
        budgets = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [512]
        result = steps(engine, runs, budgets)
    elif what == "fused":
        result = fused(engine, int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    else:
        raise SystemExit(f"unknown measurement {what!r}: use profile, round, switch, kernels, steps or fused")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

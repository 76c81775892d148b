"""``kamera bench serve``: concurrent agent sessions on one server, batched vs one answer at a time.

The engine is served on loopback twice (``create_app(engine, batch=True)`` and ``batch=False``); for N
in 1, 8, 32 concurrent sessions, each session runs an agent-like loop per round: add a page (a tool
result of about 56 tokens), ask for a one-sentence answer about it (streamed, ``max_new_tokens`` 48, or
32 with ``quick``), then slide the oldest page out once the window holds three; 6 rounds (4 with
``quick``), so that from the fourth round on every ask follows a slide. Per mode and N:
tokens/s and requests/s over the run (and tokens/s until the first session ends: the run without its
drain), TTFT and latency p50/p95 of the answers, mean answer length, the process's peak RSS and,
batched, the scheduler's batch sizes, window forwards batched (and how many sessions' window forwards
shared a step) or run alone, and peak KV bytes.

The run also measures the ceiling batching has on this machine (``ceiling``): one decode step of 1, 8
and 32 rows against one row (the decode-only speedup; rows in a decode slab as the scheduler runs them,
and with per-row attention for comparison), and a page-sized prefill against a decode step (prefill is
compute-bound: its cost grows with its tokens and a batch does not make it cheaper), and one round of the
loop's forwards batched perfectly against one session after another (``round_ceiling``): the forwards'
bound on the ratio for this loop on this machine, so a run's ratio can be read against it
(``round_ratio_reached``).
"""

from __future__ import annotations

import bisect
import json
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import httpx

from kamera_engine import KV, Engine, InvalidInputError
from kamera_engine.scheduler import SchedulerStats, StepRecord

from ..server.loadgen import StartBarrier, run_together
from .machine import machine
from .metrics import timed

_WORDS = "river stone lamp orchard violin harbor ledger copper meadow lantern".split()


def _page(session: int, step: int) -> str:
    words = [_WORDS[(session * 7 + step * 3 + k) % len(_WORDS)] for k in range(40)]
    return f"Report {step} of agent {session}: the {words[0]} is at number {session * 13 + step}. " + " ".join(words)


@contextmanager
def _served(engine: Engine, batch: bool, app_options: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    import uvicorn

    from ..server import create_app

    app = create_app(engine, batch=batch, max_sessions=1024, session_ttl_s=None, **app_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def _question(session: int, step: int) -> str:
    """An agent step's question: one sentence about the page just added (answers of ~10 to 48 tokens)."""
    return f"In one sentence, what does report {step} say is at number {session * 13 + step}?"


def _ask(client: httpx.Client, sid: str, prompt: str, max_new_tokens: int) -> tuple[float, float, int, list[float]]:
    """One streamed answer: (TTFT, latency, tokens decoded, the clock at each text piece's arrival)."""
    t0 = time.perf_counter()
    ttft, tokens, event = None, 0, ""
    arrived: list[float] = []
    body = {"prompt": prompt, "max_new_tokens": max_new_tokens, "stream": True}
    with client.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                if event == "token":
                    arrived.append(time.perf_counter())
                    if ttft is None:
                        ttft = arrived[-1] - t0
                elif event == "done":
                    tokens = int(json.loads(line[5:])["tokens"])
                elif event == "error":
                    raise RuntimeError(line[5:])
    latency = time.perf_counter() - t0
    return (ttft if ttft is not None else latency), latency, tokens, arrived or [t0 + latency]


def all_running(
    start: float, ends: list[float], sessions: int, answers: list[tuple[int, list[float]]]
) -> dict[str, float]:
    """Throughput while every session is still in its loop: from ``start`` to the first session's end (``ends``,
    one per session that finished), each answer's ``(tokens, piece arrival clocks in order)`` counted for the
    share of its pieces that arrived by then. A closed loop of fixed rounds ends with a drain in which sessions
    finish one by one; this figure leaves the drain out. Zeros if a session did not finish."""
    if len(ends) != sessions or not ends or min(ends) <= start:
        return {"all_running_s": 0.0, "all_running_tokens_per_s": 0.0}
    cut = min(ends)
    made = sum(n * bisect.bisect_right(arrived, cut) / len(arrived) for n, arrived in answers if arrived)
    return {"all_running_s": cut - start, "all_running_tokens_per_s": made / (cut - start)}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _load(
    url: str,
    sessions: int,
    rounds: int,
    max_new_tokens: int,
    on_start: Callable[[], None] | None = None,
    on_end: Callable[[], None] | None = None,
) -> dict[str, Any]:
    # on_start: called as the sessions start their loops together; on_end: as the last one ends its loop
    barrier = StartBarrier(sessions + 1, action=on_start)  # its start and on_start before any session goes on
    lock = threading.Lock()
    ttfts: list[float] = []
    lats: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    ends: list[float] = []
    answers: list[tuple[int, list[float]]] = []

    def agent(i: int) -> None:
        client = httpx.Client(base_url=url, timeout=600)
        try:
            sid = client.post("/v1/sessions", json={}).raise_for_status().json()["id"]
        except Exception as exc:  # counted, never hidden
            errors.append(f"session {i}: {exc}")
            barrier.wait()
            return
        barrier.wait()
        try:
            held = 0
            for step in range(rounds):
                client.post(f"/v1/sessions/{sid}/chunks", json={"text": _page(i, step)}).raise_for_status()
                held += 1
                ttft, lat, n, arrived = _ask(client, sid, _question(i, step), max_new_tokens)
                with lock:
                    ttfts.append(ttft)
                    lats.append(lat)
                    tokens.append(n)
                    answers.append((n, arrived))
                if held >= 3:
                    client.post(f"/v1/sessions/{sid}/slide", json={"n": 1}).raise_for_status()
                    held -= 1
            with lock:
                ends.append(time.perf_counter())
                if len(ends) == sessions and on_end is not None:
                    on_end()
            client.delete(f"/v1/sessions/{sid}")
        except Exception as exc:
            with lock:
                errors.append(f"session {i}: {type(exc).__name__}: {exc}")
        finally:
            client.close()

    t0 = run_together(agent, sessions, barrier)
    elapsed = max(ends, default=time.perf_counter()) - t0
    return {
        "tokens_per_s": sum(tokens) / elapsed if elapsed > 0 else 0.0,
        "requests_per_s": len(lats) / elapsed if elapsed > 0 else 0.0,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else 0.0,
        "ttft_p95_s": _pct(ttfts, 0.95),
        "p50_s": statistics.median(lats) if lats else 0.0,
        "p95_s": _pct(lats, 0.95),
        "answers": len(lats),
        "tokens": sum(tokens),
        "answer_tokens_mean": sum(tokens) / len(tokens) if tokens else 0.0,
        "elapsed_s": elapsed,
        **all_running(t0, ends, sessions, answers),  # the same run without its drain (not the ratio's figure)
        "errors": errors,
    }


def reset_peak_rss() -> bool:
    """Start this process's peak-RSS count afresh from what it holds now (Linux: ``/proc/self/clear_refs``),
    so that an arm's peak is its own; False where the OS cannot (the peak is then the process's so far)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def rss_bytes() -> int | None:
    """The process's RSS now (Linux: ``/proc/self/statm``); None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int:
    """The process's peak RSS since it started, or since ``reset_peak_rss``."""
    try:  # Linux: the recorded peak or the RSS now, whichever is higher (the kernel records it lazily)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError, IndexError):
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def repeated_decode_step(
    engine: Engine, past: KV, past_tokens: int, rows: int, *, slabbed: bool = True
) -> Callable[[], None]:
    """A decode step of ``rows`` rows, each after ``past`` (``past_tokens`` long), as the scheduler runs it: the
    rows in a decode slab, or (``slabbed=False``) each attending its own cache. Every call rolls the rows back
    first, so the same step can be timed again and again."""
    from kamera_engine.batch import DecodeSlab, Row, RowCache, batched_forward

    caches = [RowCache.from_past(past, engine.num_layers, reserve=2, device=engine.device) for _ in range(rows)]
    slab = DecodeSlab()
    if slabbed:
        for c in caches:
            slab.admit(c, past_tokens + 2)
    marks = [c.mark() for c in caches]

    def step() -> None:
        for c, m in zip(caches, marks, strict=True):
            c.rollback(m)
        batched_forward(engine.model, [Row.at(c, [5], past_tokens) for c in caches])

    return step


def ceiling(engine: Engine, *, past_tokens: int = 300, page_tokens: int = 56, repeat: int = 5) -> dict[str, Any]:
    """What batching can gain on this machine: seconds of one decode step of 1, 8 and 32 rows (each row a
    window of ``past_tokens``) with the rows in a decode slab as the scheduler runs them, the same with each
    row's attention on its own cache (``decode_step_s_per_row``), the decode-only speedup of B rows over
    B single steps, and one prefill of ``page_tokens`` (a page) in decode steps. Each figure is the best of
    ``repeat`` timed steps (a shared machine's noise only ever adds time)."""
    import torch

    from kamera_engine.batch import Row, RowCache, batched_forward

    ids = [int(t) % engine.vocab_size for t in range(100, 100 + past_tokens)]
    past = engine.forward(ids, None, 0, logits="none").kv

    def decode_step(b: int, slabbed: bool) -> float:
        return timed(repeated_decode_step(engine, past, past_tokens, b, slabbed=slabbed), repeat, reduce=min)

    decode_s = {str(b): decode_step(b, True) for b in (1, 8, 32)}
    per_row_s = {str(b): decode_step(b, False) for b in (1, 8, 32)}
    page = RowCache.from_past(past, engine.num_layers, reserve=page_tokens)
    mark = page.mark()

    def prefill() -> None:
        page.rollback(mark)
        batched_forward(engine.model, [Row.at(page, ids[:page_tokens], past_tokens)])

    prefill_s = timed(prefill, repeat, reduce=min)
    one = decode_s["1"]
    return {
        "decode_step_s": decode_s,
        "decode_speedup": {b: int(b) * one / t for b, t in decode_s.items()},
        "decode_step_s_per_row": per_row_s,
        "decode_speedup_per_row": {b: int(b) * per_row_s["1"] / t for b, t in per_row_s.items()},
        "prefill_s": prefill_s,
        "prefill_tokens": page_tokens,
        "prefill_over_decode_step": prefill_s / one,
        "threads": torch.get_num_threads(),
    }


def round_shape(engine: Engine, held: int = 3) -> dict[str, int]:
    """The forwards of the loop's steady-state round as a window runs them, read off the calling thread's
    engine counters around one session's calls (rounds of the loop until a slide has happened): the page's
    compile (``page_tokens``, behind the anchor's ``anchor_tokens``) and the ask's forward (``ask_tokens``:
    the new page again with the question, behind the anchor and the ``held - 1`` pages before it,
    ``window_tokens``)."""
    from ..window import ContextWindow

    def tokens(call: Any) -> tuple[int, int]:
        counters = engine.thread_counters  # this thread's calls only: a server thread may still be closing
        forwards, prefilled = counters.forwards, counters.tokens_prefilled
        call()
        return counters.forwards - forwards, counters.tokens_prefilled - prefilled

    with ContextWindow(engine) as win:
        page = ask = (0, 0)
        for step in range(held + 1):
            page = tokens(lambda s=step: win.add_text(_page(0, s)))
            ask = tokens(lambda s=step: win.generate(_question(0, s), max_new_tokens=1))
            if len(win.chunks) >= held:
                win.slide(1)
    if page[0] != 1 or ask[0] != 1:
        raise RuntimeError(f"the loop's round is not one page compile and one ask forward: add {page}, ask {ask}")
    anchor = len(engine.anchor_kv)
    return {
        "anchor_tokens": anchor,
        "page_tokens": page[1],
        "ask_tokens": ask[1],
        "window_tokens": anchor + (held - 1) * page[1],
    }


def round_ids(engine: Engine, n: int, seed: int) -> list[int]:
    """``n`` synthetic token ids for the round ceiling's forwards (distinct per ``seed``, within the vocabulary)."""
    return [(1000 + 7919 * seed + 31 * t) % engine.vocab_size for t in range(n)]


def round_ceiling(engine: Engine, counts: tuple[int, ...], answer_tokens: int, *, repeat: int = 5) -> dict[str, Any]:
    """What perfect batching of the loop's forwards would gain on this machine: one steady-state round of
    N sessions (each: its page's compile, its ask's forward, an answer of ``answer_tokens``) with every
    session's page in one packed forward, every ask in one and every decode step holding all N rows,
    against N times one session's round (``Engine.forward`` and the decode loop's single steps, as the
    one-at-a-time server runs them). Synthetic token ids of the loop's own lengths (``round_shape``).
    Forwards only: no scheduler, no HTTP, no window planning or patch forming (which the one-at-a-time
    server runs between its forwards and a batched one can overlap on another core), so it is the
    forwards' bound on ``throughput_ratio`` for this loop, not a target. Each figure is the best of
    ``repeat`` runs after a warm-up run."""
    import torch

    from kamera_engine.batch import DecodeSlab, Row, RowCache, batched_forward
    from kamera_engine.decode import step_logits

    shape = round_shape(engine)
    a, w = shape["anchor_tokens"], shape["window_tokens"]

    def ids(n: int, seed: int) -> list[int]:
        return round_ids(engine, n, seed)

    anchor = engine.forward(ids(a, 0), None, 0, logits="none").kv if a else None
    window = engine.forward(ids(w, 1), None, 0, logits="none").kv
    steps = max(answer_tokens - 1, 0)  # the first token comes from the ask's logits

    @torch.inference_mode()  # as the decode loop runs its steps (no autograd graph across them)
    def one_session() -> None:
        engine.forward(ids(shape["page_tokens"], 2), anchor, a, logits="none")
        res = engine.forward(ids(shape["ask_tokens"], 3), window, w, logits="last")
        pos = w + shape["ask_tokens"]
        for k in range(steps):
            step_logits(engine.model, res.cache, 5, pos + k, engine.device)

    @torch.inference_mode()
    def batched(n: int) -> None:
        pages = [RowCache.from_past(anchor, engine.num_layers, reserve=shape["page_tokens"]) for _ in range(n)]
        batched_forward(
            engine.model, [Row.at(c, ids(shape["page_tokens"], 10 + i), a, logits="none") for i, c in enumerate(pages)]
        )
        asks = [RowCache.from_past(window, engine.num_layers, reserve=shape["ask_tokens"] + steps) for _ in range(n)]
        batched_forward(engine.model, [Row.at(c, ids(shape["ask_tokens"], 50 + i), w) for i, c in enumerate(asks)])
        slab = DecodeSlab()
        pos = w + shape["ask_tokens"]
        for c in asks:
            slab.admit(c, pos + steps)
        for k in range(steps):
            batched_forward(engine.model, [Row.at(c, [5], pos + k) for c in asks])

    single = timed(one_session, repeat, reduce=min)
    seconds = {
        str(n): {"batched": timed(lambda n=n: batched(n), repeat, reduce=min), "sequential": n * single}
        for n in counts
        if n > 1
    }
    return {
        "round_shape": {**shape, "answer_tokens": answer_tokens},
        "round_s": seconds,
        "round_ratio": {n: s["sequential"] / s["batched"] for n, s in seconds.items()},
    }


def arm_name(batch: bool) -> str:
    """An arm's key in the results: ``batched`` or ``sequential`` (one at a time)."""
    return "batched" if batch else "sequential"


def arm(
    engine: Engine,
    sessions: int,
    batch: bool,
    rounds: int,
    max_new_tokens: int,
    *,
    app_options: dict[str, Any] | None = None,
    observer: Callable[[StepRecord], None] | None = None,
) -> dict[str, Any]:
    """One arm: ``sessions`` concurrent sessions' loop (``rounds`` of add a page, ask with answers of at most
    ``max_new_tokens``, slide) against a fresh server on loopback, batched or one at a time; its figures.
    ``app_options``: more ``create_app`` keywords (``step_tokens``, ...); ``observer``: called with each of the
    batched server's steps while the sessions run (``Scheduler.observe``)."""
    print(f"serve: {sessions} sessions, {arm_name(batch)}", file=sys.stderr)
    own_peak = reset_peak_rss()  # else an arm would report the peak of the arms before it
    rss_start = rss_bytes()  # what the process holds as the arm starts (earlier arms' heap included)
    with _served(engine, batch, app_options or {}) as (url, app):
        sched = app.state.kamera.scheduler
        if observer is not None and sched is None:
            raise InvalidInputError("an observer watches a batched server's steps; this arm runs one at a time")
        marks: dict[str, SchedulerStats] = {}  # the scheduler's counters as the loops start and as the last ends

        def mark(name: str) -> Callable[[], None] | None:
            return None if sched is None else lambda: marks.setdefault(name, sched.stats())

        with sched.observe(observer) if observer is not None else nullcontext():
            figures = _load(url, sessions, rounds, max_new_tokens, on_start=mark("start"), on_end=mark("end"))
        figures["peak_rss_bytes"] = max(peak_rss_bytes(), rss_start or 0)  # never below an RSS seen in the arm
        figures["peak_rss_of"] = "arm" if own_peak else "process"  # whose peak: this arm's, or the process's so far
        figures["rss_start_bytes"] = rss_start
        figures["load_avg_1m"] = os.getloadavg()[0]
        if sched is not None:
            s = sched.stats()
            figures["batch_mean"] = s.batch_mean
            figures["batch_max"] = s.batch_max
            figures["carried_forwards"] = s.carried  # window forwards batched with other rows
            figures["carried_alone"] = s.carried_alone  # window forwards with nothing to share
            # window forwards' rows per step that held any: several sessions' pages in one forward
            figures["window_rows_mean"] = s.carried_rows_total / s.carried_steps if s.carried_steps else 0.0
            figures["window_rows_max"] = s.carried_rows_max
            figures["follow_ons"] = s.follow_ons  # answers queued by their prompt's forward's step
            figures["kv_bytes_peak"] = s.kv_bytes_peak
            figures["queue_wait_s_max"] = s.queue_wait_s_max
            # the stepping thread over the sessions' loops (``elapsed_s``): in forwards and waiting for work, the
            # rest its own work between forwards (planning, sampling, handing tokens out) and waits for a core or
            # the interpreter; not measured (None) when a session failed, so never ended its loop
            start, end = marks.get("start"), marks.get("end")
            span = start is not None and end is not None
            figures["forward_s"] = end.forward_s - start.forward_s if span else None
            figures["idle_s"] = end.idle_s - start.idle_s if span else None
            figures["step_tokens"], figures["max_batch_rows"] = s.step_tokens, s.max_rows  # what it ran under
    return figures


def _ratio(row: dict[str, Any], key: str = "tokens_per_s") -> float:
    seq = row["sequential"][key]
    return row["batched"][key] / seq if seq else 0.0


def run(
    engine: Engine, *, quick: bool = False, counts: tuple[int, ...] = (1, 8, 32), repeat: int = 1
) -> dict[str, Any]:
    """Batched vs one-at-a-time over ``counts`` concurrent sessions (``quick``: fewer rounds, shorter answers).
    ``repeat``: run the two arms that many times at each count, alternating which goes first, and report the
    pair whose throughput ratio is the median (the lower middle one for an even count); every pair's figures
    are in ``runs``. On a shared host the arms' speeds drift by a tenth from minute to minute, and the
    one-at-a-time arm runs three times longer than the batched one, so one pair can land on either side."""
    if repeat < 1:
        raise InvalidInputError(f"repeat must be at least 1, got {repeat}")
    # rounds: from the fourth on, every ask follows a slide (the loop's steady state: three pages held)
    rounds, max_new = (4, 32) if quick else (6, 48)
    load_before = os.getloadavg()
    host = machine()
    sessions: dict[str, dict[str, Any]] = {}
    ratio: dict[str, float] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    for n in counts:
        pairs: list[dict[str, Any]] = []
        for k in range(repeat):
            order = (True, False) if k % 2 == 0 else (False, True)  # the later arm of one pair goes first in the next
            pairs.append({arm_name(batch): arm(engine, n, batch, rounds, max_new) for batch in order})
        ratios = [_ratio(row) for row in pairs]
        middle = sorted(range(repeat), key=lambda i: ratios[i])[(repeat - 1) // 2]
        sessions[str(n)] = {"batched": pairs[middle]["batched"], "sequential": pairs[middle]["sequential"]}
        ratio[str(n)] = ratios[middle]
        runs[str(n)] = [
            {
                "throughput_ratio": r,
                "all_running_ratio": _ratio(row, "all_running_tokens_per_s"),
                "batched_tokens_per_s": row["batched"]["tokens_per_s"],
                "sequential_tokens_per_s": row["sequential"]["tokens_per_s"],
                "batched_p95_s": row["batched"]["p95_s"],
                "sequential_p95_s": row["sequential"]["p95_s"],
                "first": next(iter(row)),
            }
            for row, r in zip(pairs, ratios, strict=True)
        ]
    print("serve: ceiling (decode rows vs one, prefill vs decode, a round perfectly batched)", file=sys.stderr)
    answered = [arm["answer_tokens_mean"] for row in sessions.values() for arm in row.values() if arm["answers"]]
    answer_tokens = max(1, round(statistics.fmean(answered))) if answered else max_new
    bound = round_ceiling(engine, counts, answer_tokens)
    reached = {n: ratio[n] / r for n, r in bound["round_ratio"].items()}
    return {
        "sessions": sessions,
        "throughput_ratio": ratio,
        # the reported pairs' ratio while all their sessions ran (the drain left out): for reading, not the figure
        "all_running_ratio": {n: _ratio(row, "all_running_tokens_per_s") for n, row in sessions.items()},
        "repeat": repeat,
        "runs": runs,
        "ceiling": {**ceiling(engine), **bound, "round_ratio_reached": reached},
        "rounds": rounds,
        "max_new_tokens": max_new,
        "load_avg_before": list(load_before),
        "load_avg_after": list(os.getloadavg()),
        "cpu_count": os.cpu_count(),
        "machine": host,  # the CPU and its vector instructions: the ratio depends on them
        "model": engine.name,
        "device": str(engine.device),
    }

"""``kamera bench threads``: the demo's work under each CPU thread setting, on an idle and a contended CPU.

Each setting runs in its own process (OpenMP's wait policy is fixed when torch loads), doing a fixed
slice of ``kamera demo``: read the demo's four pages into a window and answer its first question (the
next-token distribution, then a short greedy answer). The contended case runs one CPU-bound process
beside it, started and stopped here. Settings: the engine's default (:mod:`kamera_engine.threads`),
the manual ``OMP_NUM_THREADS`` = 1 and = all CPUs, and ``KAMERA_THREADS=torch`` (torch's own threads
and spinning wait: the behaviour before the engine chose). The figure of merit is each setting's slice
time over the best manual one's. Every run also records how busy the rest of the machine was
(other processes' CPU share, from ``/proc/stat`` less this run's own CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from kamera_engine.threads import available_cpus

from .machine import machine

_CLEAR = ("OMP_NUM_THREADS", "KAMERA_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "MKL_NUM_THREADS")
_SPIN = "while True:\n    pass\n"


def settings(cpus: int) -> dict[str, dict[str, str]]:
    """Setting name -> the environment variables it sets (on top of an environment cleared of them)."""
    named = {"default": {}, "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"}}
    if cpus > 1:
        named[f"OMP_NUM_THREADS={cpus}"] = {"OMP_NUM_THREADS": str(cpus)}
    named["KAMERA_THREADS=torch"] = {"KAMERA_THREADS": "torch"}
    return named


def _busy_jiffies() -> int:
    """Busy CPU jiffies of the whole machine since boot (all CPUs; idle and iowait left out)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)


def _run_setting(env_vars: dict[str, str], quick: bool, model: str | None, timeout_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in _CLEAR} | env_vars
    cmd = [sys.executable, "-m", "kamera_sdk.bench.threads", "--worker"]
    cmd += ["--quick"] if quick else []
    cmd += ["--model", model] if model else []
    busy0 = _busy_jiffies()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # torch's spinning threads under contention can take very long
        proc.kill()
        proc.communicate()
        return {"timed_out_after_s": timeout_s, "loadavg_1min": os.getloadavg()[0]}
    wall = time.perf_counter() - t0
    busy1 = _busy_jiffies()
    if proc.returncode != 0:
        return {"failed": proc.returncode, "wall_s": wall}
    row = json.loads(stdout.strip().splitlines()[-1])
    tick = os.sysconf("SC_CLK_TCK")
    others = (busy1 - busy0) / tick - row["cpu_s"]  # CPU seconds everything else used meanwhile
    row["wall_s"] = wall
    row["others_cpu_share"] = max(0.0, others) / (wall * available_cpus())
    row["loadavg_1min"] = os.getloadavg()[0]
    return row


def _competitor() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _SPIN], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(*, quick: bool = False, repeat: int = 1, model: str | None = None, timeout_s: float = 300.0) -> dict:
    """Slice time per setting, idle and with one competing CPU-bound process; best of ``repeat``."""
    cpus = available_cpus()
    named = settings(cpus)
    result: dict[str, Any] = {
        "slice": "demo pages 1-4 into one kamera window + question 1 (next-token logprobs, greedy answer of "
        + ("8" if quick else "16")
        + " tokens)",
        "cpus": cpus,
        "machine": {**machine(), "loadavg_at_start": os.getloadavg()},
        "repeat": repeat,
        "conditions": {},
    }
    for condition in ("idle", "one competing process"):
        spinner = _competitor() if condition != "idle" else None
        try:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in named}
            for _ in range(repeat):  # interleaved, so slow drift in the machine's load hits every setting
                for name, env_vars in named.items():
                    runs[name].append(_run_setting(env_vars, quick, model, timeout_s))
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
        result["conditions"][condition] = _summarise(runs)
    result["loadavg_at_end"] = os.getloadavg()
    return result


def _summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name, tries in runs.items():
        ok = [r for r in tries if "slice_s" in r]
        best = min(ok, key=lambda r: r["slice_s"]) if ok else tries[-1]
        rows[name] = best | {"slice_s_all": [r.get("slice_s") for r in tries]}
    manual = {n: r["slice_s"] for n, r in rows.items() if n.startswith("OMP_NUM_THREADS") and "slice_s" in r}
    best_manual = min(manual, key=manual.__getitem__) if manual else None
    summary: dict[str, Any] = {"settings": rows, "best_manual": best_manual}
    if best_manual is not None:
        ref = manual[best_manual]
        summary["ratio_to_best_manual"] = {n: r["slice_s"] / ref for n, r in rows.items() if "slice_s" in r}
        summary["ratio_at_least"] = {  # a run cut off by the timeout: its slice took longer still
            n: r["timed_out_after_s"] / ref for n, r in rows.items() if "timed_out_after_s" in r
        }
    return summary


def run(engine: Any, quick: bool = False) -> dict[str, Any]:
    """``kamera bench threads``: the engine handed in only names the model; each setting loads its own."""
    info = engine.info()
    from kamera_engine import DEFAULT_MODEL_NAME

    model = None if info.model == DEFAULT_MODEL_NAME else info.model
    return measure(quick=quick, repeat=1 if quick else 2, model=model)


def _worker(quick: bool, model: str | None) -> None:
    t0 = time.perf_counter()
    from kamera_engine import Engine
    from kamera_engine.threads import thread_plan

    from ..window import ContextWindow
    from .corpus import load_corpus

    engine = Engine.load(model)
    corpus = load_corpus()
    pages = [corpus.page(pid) for pid in corpus.demo.pages[:4]]
    question = corpus.demo.questions[0].question
    t1 = time.perf_counter()
    win = ContextWindow(engine, policy="kamera")
    for page in pages:
        win.add_text(page.text + "\n\n")
    win.next_token_logprobs(question)
    answer = win.generate(question, max_new_tokens=8 if quick else 16, stop=["\n"])
    t2 = time.perf_counter()
    usage = os.times()
    plan = thread_plan()
    row = {
        "load_s": t1 - t0,
        "slice_s": t2 - t1,
        "cpu_s": usage.user + usage.system,
        "threads": plan.threads,
        "reason": plan.reason,
        "wait_policy": plan.wait_policy,
        "source": plan.source,
        "answer": answer,
    }
    print(json.dumps(row))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kamera_sdk.bench.threads", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a shorter answer, one try per setting")
    p.add_argument("--repeat", type=int, default=None, help="tries per setting and condition (best kept)")
    p.add_argument("--model", default=None, help="HF id or local path (default: the embedded model)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is cut off (default: 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.quick, args.model)
        return 0
    from ..console import write_json

    repeat = args.repeat or (1 if args.quick else 2)
    result = measure(quick=args.quick, repeat=repeat, model=args.model, timeout_s=args.timeout)
    if args.json:
        write_json(result)
    else:
        for condition, s in result["conditions"].items():
            print(condition, "best manual:", s["best_manual"])
            for name, r in s["settings"].items():
                ratio = s.get("ratio_to_best_manual", {}).get(name, float("nan"))
                print(f"  {name:24s} {r.get('slice_s', float('nan')):7.2f} s  x{ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

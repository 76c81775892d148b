"""A bounded load run against a fleet: sessions answering concurrently, throughput and latency percentiles.

    python -m kamera_fleet.load --store redis://127.0.0.1:6379/0 --replicas 1 2 --out fleet-load.json

For each replica count, a local Ray cluster (``--num-cpus``) runs the fleet; ``--sessions`` sessions each
hold two pages, then ``--requests`` generate requests (``--max-new-tokens`` each) are sent round-robin over
the sessions by ``--concurrency`` client threads, stopping early at ``--max-seconds``. Reported per replica
count: requests and tokens per second over the run, latency p50/p95, failed requests, and the machine
(CPU count, model, load average), so a figure is never read without the machine it was measured on.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import httpx

from kamera_sdk import Engine

PROMPT = "Summarise the pages in one sentence."


def _page(session: int, k: int) -> str:
    return f"Page {k} of session {session}: " + " ".join(
        f"item {session}-{k}-{j} weighs {j * 7 % 31} kg." for j in range(8)
    )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_load(url: str, *, sessions: int = 8, requests: int = 48, max_new_tokens: int = 8, concurrency: int = 8,
             max_seconds: float = 120.0) -> dict[str, Any]:  # fmt: skip
    """Open ``sessions`` sessions on the fleet at ``url``, then send at most ``requests`` generate requests
    (bounded by ``max_seconds``) from ``concurrency`` threads; the measured figures."""
    with httpx.Client(base_url=url, timeout=300) as c:
        ids = []
        for s in range(sessions):
            r = c.post("/v1/sessions", json={})
            r.raise_for_status()
            sid = r.json()["id"]
            for k in range(2):
                c.post(f"/v1/sessions/{sid}/chunks", json={"text": _page(s, k)}).raise_for_status()
            ids.append(sid)
    latencies: list[float] = []
    tokens = 0
    errors: list[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + max_seconds
    local = threading.local()

    def one(i: int) -> None:
        nonlocal tokens
        if time.monotonic() > stop:
            return
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=url, timeout=300)
        t0 = time.perf_counter()
        try:
            r = local.client.post(f"/v1/sessions/{ids[i % len(ids)]}/generate",
                                  json={"prompt": PROMPT, "max_new_tokens": max_new_tokens})  # fmt: skip
            r.raise_for_status()
            n = int(r.json()["tokens"])
        except Exception as exc:  # a failed request is a figure, not a crash of the run
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        with lock:
            latencies.append(time.perf_counter() - t0)
            tokens += n

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))
    elapsed = time.perf_counter() - t0
    return {
        "requests_sent": requests,
        "requests_ok": len(latencies),
        "failed": len(errors),
        "errors": errors[:5],
        "elapsed_s": elapsed,
        "requests_per_s": len(latencies) / elapsed,
        "tokens_per_s": tokens / elapsed,
        "latency_p50_s": statistics.median(latencies) if latencies else float("nan"),
        "latency_p95_s": _percentile(latencies, 0.95),
        "tokens": tokens,
    }


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model or platform.processor(), "load_avg_1m": os.getloadavg()[0],
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}  # fmt: skip


def _factory(spec: str | None) -> Callable[[], Engine]:
    """``module:function`` building an Engine, else ``Engine.load`` of a model id or path (None: the default)."""
    if spec and ":" in spec:
        module, name = spec.split(":", 1)
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    return partial(Engine.load, spec)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kamera_fleet.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="the fleet's Redis (redis://...)")
    p.add_argument("--engine", default=None, help="module:function building the Engine, or a model id/path")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from .app import FleetConfig, build_app

    factory = _factory(args.engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    command = " ".join(["python -m kamera_fleet.load", *(argv or sys.argv[1:])])
    result: dict[str, Any] = {"machine": machine(), "command": command, "runs": {}}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        for n in args.replicas:
            cfg = FleetConfig(factory, args.store, replicas=n, replica_cpus=args.replica_cpus,
                              journal_prefix=f"kamera:fleet-load-{n}:")  # fmt: skip
            serve.run(build_app(cfg), route_prefix="/", name="kamera")
            result["model"] = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
            run = run_load(url, sessions=args.sessions, requests=args.requests, max_new_tokens=args.max_new_tokens,
                           concurrency=args.concurrency, max_seconds=args.max_seconds)  # fmt: skip
            run["load_avg_1m_after"] = os.getloadavg()[0]
            result["runs"][str(n)] = run
            print(json.dumps({"replicas": n, **{k: v for k, v in run.items() if k != "errors"}}), flush=True)
            serve.delete("kamera")
    finally:
        serve.shutdown()
        ray.shutdown()
    result["settings"] = {k: getattr(args, k) for k in ("sessions", "requests", "max_new_tokens", "concurrency",
                                                         "max_seconds", "num_cpus", "replica_cpus")}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

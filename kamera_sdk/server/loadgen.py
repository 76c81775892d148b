"""Concurrent-session load on a Kamera server: requests/s and latency of a small generate.

    python -m kamera_sdk.server.loadgen --spawn --sessions 8 --requests 6 --max-new-tokens 4 --json

Each session (one thread, one ``RemoteWindow``) adds two chunks of its own, then all sessions start
together and each sends ``--requests`` generates. Afterwards every session checks isolation: its window
holds exactly its own chunks, and another session's chunk ids are unknown to it. ``--spawn`` starts
``kamera serve`` (the embedded default model) in a child process on a free loopback port and stops it
with SIGINT at the end; ``--url`` measures a server already running.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
from pydantic import BaseModel

from kamera_engine import ChunkNotFoundError

from .client import RemoteWindow

_FACTS = ["owns {n} red bicycles", "was born in {n} AD", "keeps {n} goldfish", "lives at number {n}"]


class LoadReport(BaseModel):
    """What a load run measured (latencies of the generate requests only)."""

    sessions: int
    requests: int
    warmup: int
    max_new_tokens: int
    errors: list[str]
    isolation_violations: list[str]
    elapsed_s: float
    requests_per_s: float
    latency_p50_s: float
    latency_p95_s: float
    latency_max_s: float


class StartBarrier(threading.Barrier):
    """A barrier that notes when it releases its parties (``started``), then runs ``action``: both before any
    party goes on, so a run timed from ``started`` holds everything the parties do after it."""

    def __init__(self, parties: int, action: Callable[[], None] | None = None) -> None:
        self.started: float | None = None

        def release() -> None:
            self.started = time.perf_counter()
            if action is not None:
                action()

        super().__init__(parties, action=release)


def run_together(target: Callable[[int], None], n: int, barrier: StartBarrier) -> float:
    """Run ``target(i)`` on ``n`` threads that meet at ``barrier`` (``n + 1`` parties, this one included)
    once set up; returns when all have finished, with the time the barrier released them."""
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    assert barrier.started is not None  # set by the release that let this thread's wait return
    return barrier.started


def _p95(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def run_load(
    base_url: str,
    *,
    sessions: int = 8,
    requests_per_session: int = 6,
    max_new_tokens: int = 4,
    api_key: str | None = None,
    warmup: int = 0,
) -> LoadReport:
    """Drive ``sessions`` concurrent sessions against ``base_url`` and measure their generates.

    ``warmup``: generates per session before the clock starts (the first use of a window forms its
    conditioning patches; with ``warmup=0`` that cost is part of the figures).
    """
    barrier = StartBarrier(sessions + 1)
    latencies: list[float] = []
    finished: list[float] = []
    errors: list[str] = []
    violations: list[str] = []
    own: dict[int, list[str]] = {}
    lock = threading.Lock()
    checked = threading.Barrier(sessions)

    def session(i: int) -> None:
        win: RemoteWindow | None = None
        try:
            win = RemoteWindow(base_url, api_key=api_key)
            ids = [win.add_text(f"Person {i} {fact.format(n=7 * i + k + 3)}.") for k, fact in enumerate(_FACTS[:2])]
            with lock:
                own[i] = ids
            for r in range(warmup):
                win.generate(f"Warm-up {r}: who is person {i}?", max_new_tokens=max_new_tokens)
        except Exception as exc:
            with lock:
                errors.append(f"session {i} setup: {type(exc).__name__}: {exc}")
        barrier.wait()
        if win is None:
            checked.wait()
            return
        try:
            for r in range(requests_per_session):
                t0 = time.perf_counter()
                win.generate(f"Question {r}: what does person {i} own?", max_new_tokens=max_new_tokens)
                t1 = time.perf_counter()
                with lock:
                    latencies.append(t1 - t0)
                    finished.append(t1)
        except Exception as exc:
            with lock:
                errors.append(f"session {i} generate: {type(exc).__name__}: {exc}")
        checked.wait()  # all sessions are done: now look for each other's chunks
        try:
            found: list[str] = []
            if sorted(win.chunks) != sorted(own.get(i, [])):
                found.append(f"session {i} holds {win.chunks}, expected {own.get(i)}")
            for j, theirs in own.items():
                if j == i:
                    continue
                try:
                    win.evict(theirs[0])
                    found.append(f"session {i} could evict session {j}'s chunk")
                except ChunkNotFoundError:
                    pass
            with lock:
                violations.extend(found)
        except Exception as exc:
            with lock:
                errors.append(f"session {i} check: {type(exc).__name__}: {exc}")
        finally:
            win.close()

    t0 = run_together(session, sessions, barrier)
    elapsed = max(finished, default=t0) - t0  # from the common start to the last generate's answer
    lat = sorted(latencies)
    return LoadReport(
        sessions=sessions,
        requests=len(lat),
        warmup=warmup,
        max_new_tokens=max_new_tokens,
        errors=errors,
        isolation_violations=violations,
        elapsed_s=elapsed,
        requests_per_s=len(lat) / elapsed if elapsed else 0.0,
        latency_p50_s=statistics.median(lat) if lat else 0.0,
        latency_p95_s=_p95(lat),
        latency_max_s=lat[-1] if lat else 0.0,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def spawned_server(api_key: str = "loadgen", threads: int | None = None, timeout_s: float = 180.0) -> Iterator[str]:
    """``kamera serve`` on a free loopback port in a child process; yields its URL; SIGINT at the end.

    ``threads``: torch's intra-op threads in the server (``OMP_NUM_THREADS``; default: torch's choice).
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "kamera_sdk.cli", "serve", "--port", str(port), "--api-key", api_key]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kamera serve exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("kamera serve did not come up")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Concurrent sessions against a Kamera server: req/s and p95 latency")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--spawn", action="store_true", help="start `kamera serve` (default model) for the run")
    p.add_argument("--api-key", default=None)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--requests", type=int, default=6, help="generates per session")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--warmup", type=int, default=0, help="untimed generates per session first")
    p.add_argument("--server-threads", type=int, default=None, help="with --spawn: OMP_NUM_THREADS of the server")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    def run(url: str, key: str | None) -> LoadReport:
        return run_load(
            url,
            sessions=args.sessions,
            requests_per_session=args.requests,
            max_new_tokens=args.max_new_tokens,
            api_key=key,
            warmup=args.warmup,
        )

    if args.spawn:
        key = args.api_key or "loadgen"
        with spawned_server(key, args.server_threads) as url:
            report = run(url, key)
    else:
        report = run(args.url, args.api_key)
    if args.json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        for k, v in report.model_dump().items():
            sys.stdout.write(f"{k:>22}: {v:.4g}\n" if isinstance(v, float) else f"{k:>22}: {v}\n")
    return 0 if not report.errors and not report.isolation_violations else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

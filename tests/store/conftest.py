"""Store fixtures: the entry helpers, a real redis-server on loopback for the session, subprocess env."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROC_SCRIPT = HERE / "_store_proc.py"


def _load_proc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kamera_store_test_proc", PROC_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def proc() -> ModuleType:
    """``_store_proc``: make_entry(i, ...), same(a, b), FP, OTHER_FP, content_hash(i)."""
    return _load_proc()


@pytest.fixture(scope="session")
def proc_env() -> dict[str, str]:
    """Environment for worker subprocesses: the repository importable, one thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], int] | str:
    """Start redis-server on a free loopback port; (process, port), or why it could not start."""
    exe = shutil.which("redis-server")
    if exe is None:
        return "no `redis-server` on PATH (install it: apt-get update && apt-get install -y redis-server)"
    try:
        import redis
    except ImportError:
        return "redis-py is not installed (pip install 'kamera[redis]')"
    log = workdir / "redis.log"
    last_error: Exception | None = None
    for _attempt in range(3):  # a port picked free can be taken before the server binds it
        port = _free_port()
        server = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
             "--appendonly", "no", "--logfile", str(log), "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and server.poll() is None:
            try:
                client.ping()
                client.close()
                return server, port
            except redis.exceptions.RedisError as exc:
                last_error = exc
                time.sleep(0.05)
        client.close()
        _stop(server)
    tail = log.read_text(errors="replace")[-600:] if log.exists() else "(no log)"
    return f"redis-server failed to start 3 times ({last_error}); log: {tail}"


def _unavailable(why: str) -> NoReturn:
    if os.environ.get("KAMERA_REQUIRE_SERVERS") == "1":
        pytest.fail(f"redis-server is required here (KAMERA_REQUIRE_SERVERS=1): {why}", pytrace=False)
    pytest.skip(f"REDIS STORE TESTS SKIPPED: {why}")


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on 127.0.0.1 (free port, temp dir, no persistence), stopped after the session.

    Without one the tests skip, saying exactly why; under ``make test`` (``KAMERA_REQUIRE_SERVERS=1``, which
    installs redis-server first) they fail instead: a missing server there is a broken set-up, not a skip.
    """
    started = _start_redis(tmp_path_factory.mktemp("redis"))
    if isinstance(started, str):
        _unavailable(started)
    server, port = started
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(server)


@pytest.fixture
def doomed_redis(redis_url: str, tmp_path: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    """A second, private redis-server: (url, stop) so a test can make the server go away."""
    started = _start_redis(tmp_path)
    if isinstance(started, str):
        _unavailable(started)
    server, port = started
    try:
        yield f"redis://127.0.0.1:{port}/0", lambda: _stop(server)
    finally:
        if server.poll() is None:
            _stop(server)


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[Any]:
    """A raw redis-py client on an emptied database."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()

"""``kamera fleet up`` for real: a subprocess starts a local Ray cluster and the fleet (its replica's scheduler
under the batching flags given), answers a session's request over HTTP, and stops cleanly on SIGINT. Runs
after test_fleet.py's cluster is down (one at a time)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from kamera_sdk import ContextWindow, Engine, RemoteWindow  # noqa: E402
from tests.conftest import tiny_chat_config  # noqa: E402
from tests.store.conftest import _free_port, _start_redis, _stop  # noqa: E402

CLI = "import sys; from kamera_sdk.cli import main; sys.exit(main())"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    started = _start_redis(tmp_path_factory.mktemp("fleet-cli-redis"))
    if isinstance(started, str):
        pytest.skip(f"FLEET CLI TEST SKIPPED: {started}")
    server, port = started
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(server)


def _tiny_model_dir(path: Path) -> Path:
    """The tiny chat model saved as a local model directory (what ``--model`` loads)."""
    import transformers as T

    from kamera_engine.default_model import ensure_converted

    tokenizer = T.AutoTokenizer.from_pretrained(str(ensure_converted()))
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(tiny_chat_config(len(tokenizer)), dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_fleet_up_serves_and_stops(tmp_path: Path, redis_url: str) -> None:
    model = _tiny_model_dir(tmp_path / "tiny")
    port = _free_port()
    cmd = [sys.executable, "-c", CLI, "fleet", "up", "--store", redis_url, "--replicas", "1", "--num-cpus", "2",
           "--replica-cpus", "0.5", "--port", str(port), "--model", str(model), "--secret", "k" * 32,
           "--kv-budget", "1GiB", "--step-tokens", "96", "--max-held-tokens", "4096"]  # fmt: skip
    log = (tmp_path / "fleet-up.log").open("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        deadline = time.monotonic() + 180
        while "kamera fleet serving on" not in (tmp_path / "fleet-up.log").read_text():
            assert proc.poll() is None, (tmp_path / "fleet-up.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "kamera fleet up did not come up in 180 s"
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port}"
        limits = httpx.get(f"{url}/v1/engine/stats", timeout=30).raise_for_status().json()
        assert (limits["kv_budget_bytes"], limits["step_tokens"], limits["max_rows"]) == (1 << 30, 96, 64)
        assert httpx.get(f"{url}/v1/server/stats", timeout=30).raise_for_status().json()["max_held_tokens"] == 4096
        with RemoteWindow(url, timeout=120) as w:
            w.add_text("The fleet was started by its command line.")
            answer = w.generate("Summarise.", max_new_tokens=5)
        with ContextWindow(Engine.load(str(model))) as fresh:
            fresh.add_text("The fleet was started by its command line.")
            assert answer == fresh.generate("Summarise.", max_new_tokens=5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, (tmp_path / "fleet-up.log").read_text()[-4000:]
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/healthz", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def test_fleet_up_takes_down_only_its_application_on_a_cluster_it_attached_to(monkeypatch) -> None:
    """Attached (``--address``), stopping or failing to start deletes the fleet's own application and
    disconnects: other applications on that cluster's Serve keep running. On the local cluster it started,
    Serve shuts down with it."""
    import argparse

    import ray
    from ray import serve

    from kamera_fleet import cli

    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(serve, "delete", lambda name, *a, **k: calls.append(("serve.delete", name)))
    monkeypatch.setattr(serve, "shutdown", lambda *a, **k: calls.append(("serve.shutdown",)))
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: calls.append(("ray.shutdown",)))
    cli._stop(argparse.Namespace(address="auto"))
    assert calls == [("serve.delete", cli.APP), ("ray.shutdown",)]
    calls.clear()
    cli._stop(argparse.Namespace(address=None))
    assert calls == [("serve.shutdown",), ("ray.shutdown",)]

"""Several processes on one disk store: a writer killed with SIGKILL mid-write, and two concurrent users."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from kamera_sdk.store import ChunkStore, DiskBackend

ELEMS = 32 * 1024  # ~390 KB per entry: each write takes long enough to be caught in the middle


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    script = Path(__file__).with_name("_store_proc.py")
    return subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def test_kill_9_mid_write_leaves_only_valid_entries(tmp_path: Path, proc: ModuleType, proc_env: dict[str, str]) -> None:
    root = tmp_path / "store"
    DiskBackend(root).close()
    # writers on one store, each SIGKILLed with a put in flight (start index -> acknowledged puts before the kill)
    plans = {0: 12}
    writers = {start: _spawn(["writer", str(root), str(start), "500", str(ELEMS)], proc_env) for start in plans}
    acknowledged: list[int] = []
    for start, kill_after in plans.items():
        writer = writers[start]
        assert writer.stdout is not None
        for _ in range(kill_after):
            line = writer.stdout.readline()
            assert line, f"writer died early: {writer.stderr.read() if writer.stderr else ''}"
            acknowledged.append(int(line))
        os.kill(writer.pid, signal.SIGKILL)
    for writer in writers.values():
        writer.wait(timeout=30)
        assert writer.returncode == -signal.SIGKILL
        assert writer.stdout is not None
        acknowledged += [int(x) for x in writer.stdout.read().split()]  # printed before it died

    backend = DiskBackend(root)  # reopen: sweeps the dead writers' temp files
    assert list(root.glob("objects/*/.tmp-*")) == []
    keys = backend.keys()
    present = {int(backend.get(k).meta["index"]) for k in keys}  # type: ignore[union-attr]
    assert set(acknowledged) <= present  # every acknowledged write survived the kill
    assert len(present) <= len(acknowledged) + len(plans)  # at most the one in-flight put per writer
    with ChunkStore(backend=backend) as store:
        for i in sorted(present):
            got = store.get(proc.make_entry(i, ELEMS).key)
            assert got is not None and proc.same(got, proc.make_entry(i, ELEMS)), i
        s = store.stats()
        assert s.backend_hits == len(present) >= 12
        assert (s.refused_checksum, s.refused_fingerprint, s.load_errors) == (0, 0, 0)
    # nothing was quarantined: no corrupt entry was ever indexed
    assert list((root / "quarantine").iterdir()) == []


def test_kill_at_each_crash_point_leaves_a_missing_entry(
    tmp_path: Path, proc: ModuleType, proc_env: dict[str, str]
) -> None:
    points = ["before-fsync", "after-rename"]
    roots = {p: tmp_path / p for p in points}
    workers = {p: _spawn(["crash", str(roots[p]), p, "2048"], proc_env) for p in points}
    for w in workers.values():
        out, err = w.communicate(timeout=60)
        assert w.returncode == -signal.SIGKILL, err
        assert out.split() == ["0"], out  # entry 0 acknowledged, the process died inside put(1)
    for point, root in roots.items():
        e0, e1 = proc.make_entry(0, 2048), proc.make_entry(1, 2048)
        leftovers = list(root.glob("objects/*/.tmp-*"))
        d = e1.key.digest
        orphan = root / "objects" / d[:2] / f"{d}.safetensors"
        assert (len(leftovers), orphan.exists()) == ((1, False) if point == "before-fsync" else (0, True)), point
        backend = DiskBackend(root)  # reopen
        assert list(root.glob("objects/*/.tmp-*")) == []
        assert [k.content_hash for k in backend.keys()] == [e0.key.content_hash]
        got = backend.get(e0.key)
        assert got is not None and proc.same(got, e0)
        assert backend.get(e1.key) is None  # missing, never torn
        backend.put(e1)  # the recompute writes it normally (over an orphan, if any)
        got = backend.get(e1.key)
        assert got is not None and proc.same(got, e1)


def test_two_processes_share_one_store(tmp_path: Path, proc: ModuleType, proc_env: dict[str, str]) -> None:
    root = tmp_path / "store"
    go = tmp_path / "go"
    shared = list(range(100, 106))  # both processes add these: idempotent puts
    a_ids = list(range(0, 14)) + shared
    b_ids = list(range(50, 64)) + shared
    elems = 4096
    workers = [
        _spawn(["mixer", str(root), "A", json.dumps(a_ids), json.dumps(b_ids), str(go), str(elems)], proc_env),
        _spawn(["mixer", str(root), "B", json.dumps(b_ids), json.dumps(a_ids), str(go), str(elems)], proc_env),
    ]
    deadline = time.monotonic() + 60
    while not all(Path(f"{go}.{n}.ready").exists() for n in "AB"):  # both imported: start together
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers), "a worker failed to start"
        time.sleep(0.02)
    go.touch()
    results = []
    for w in workers:
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    # each process read entries the other one wrote (ids it never wrote itself)
    assert any(set(r["seen"]) - set(shared) for r in results), results
    assert sum(r["reads"] for r in results) > 0
    backend = DiskBackend(root)
    union = set(a_ids) | set(b_ids)
    assert len(backend) == len(union) == 34
    for i in union:
        got = backend.get(proc.make_entry(i, elems).key)
        assert got is not None and proc.same(got, proc.make_entry(i, elems)), i
    assert list((root / "quarantine").iterdir()) == []
    assert list(root.glob("objects/*/.tmp-*")) == []

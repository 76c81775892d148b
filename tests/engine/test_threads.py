"""The engine's CPU thread policy, each case in a fresh interpreter (OpenMP settings are fixed at torch load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kamera_engine import InvalidInputError
from kamera_engine.threads import MAX_AUTO_THREADS, auto_threads, available_cpus, set_threads, thread_plan

_CLEARED = ("OMP_NUM_THREADS", "KAMERA_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "MKL_NUM_THREADS")
_PROBE = """
import json, os, sys
{before}
import kamera_engine, torch
plan = kamera_engine.threads.thread_plan()
print(json.dumps(plan.as_dict() | {{"torch": torch.get_num_threads(), "wait_env": os.environ.get("OMP_WAIT_POLICY")}}))
"""


def probe(env: dict[str, str], before: str = "") -> dict:
    full = {k: v for k, v in os.environ.items() if k not in _CLEARED} | env
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(before=before)], env=full, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_default_uses_the_usable_cpus_and_passive_waiting() -> None:
    plan = probe({})
    busy = "oversubscribed" in plan["reason"]  # the load average the child saw decides
    assert plan["source"] == "auto" and plan["threads"] == auto_threads(available_cpus(), 1e9 if busy else 0.0)[0]
    assert plan["torch"] == plan["threads"] and plan["cpus"] == available_cpus()
    assert plan["wait_env"] == "PASSIVE" and plan["wait_policy"].startswith("passive")
    assert plan["inline_small_kernels"] is True  # sleeping pool threads: small kernels run inline


def test_auto_halves_on_an_oversubscribed_machine() -> None:
    assert auto_threads(2, 0.3)[0] == 2 and auto_threads(2, 1.5)[0] == 2
    n, source, reason = auto_threads(2, 2.0)
    assert (n, source) == (1, "auto") and "oversubscribed" in reason
    assert auto_threads(16, 30.0)[0] == MAX_AUTO_THREADS // 2 and auto_threads(16, 3.0)[0] == MAX_AUTO_THREADS
    assert auto_threads(1, 50.0)[0] == 1


def test_user_choices_win() -> None:
    plan = probe({"KAMERA_THREADS": "1", "OMP_NUM_THREADS": "2"})
    assert (plan["source"], plan["threads"], plan["torch"]) == ("KAMERA_THREADS", 1, 1)
    plan = probe({"OMP_NUM_THREADS": "1"})
    assert (plan["source"], plan["threads"], plan["torch"]) == ("OMP_NUM_THREADS", 1, 1)
    plan = probe({"OMP_WAIT_POLICY": "ACTIVE"})  # the user's wait policy is kept
    assert plan["wait_env"] == "ACTIVE" and plan["wait_policy"] == "as set: OMP_WAIT_POLICY=ACTIVE"
    assert plan["inline_small_kernels"] is False  # spinning pool threads wake for free


def test_torch_first_or_torch_asked_for_leaves_openmp_alone() -> None:
    plan = probe({}, before="import torch; torch.set_num_threads(1)")
    assert plan["wait_env"] is None and "too late" in plan["wait_policy"]
    assert (plan["source"], plan["threads"]) == ("torch.set_num_threads", 1)
    assert plan["inline_small_kernels"] is False
    plan = probe({"KAMERA_THREADS": "torch"})
    assert plan["source"] == "torch" and plan["wait_env"] is None and plan["inline_small_kernels"] is False


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_thread_count_is_refused_at_import(value: str) -> None:
    full = {k: v for k, v in os.environ.items() if k not in _CLEARED} | {"KAMERA_THREADS": value}
    done = subprocess.run(
        [sys.executable, "-c", "import kamera_engine"], env=full, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0 and "InvalidInputError" in done.stderr and "KAMERA_THREADS" in done.stderr


def test_set_threads_at_run_time() -> None:
    import torch

    before = torch.get_num_threads()
    try:
        assert set_threads(1).threads == 1 and torch.get_num_threads() == 1
        assert thread_plan().source == "set_threads"
        with pytest.raises(InvalidInputError):
            set_threads(0)
        assert torch.get_num_threads() == 1  # a refused count changes nothing
    finally:
        torch.set_num_threads(before)


_LOCAL_PROBE = """
import ctypes, json, os, threading
import kamera_engine, torch
from kamera_engine.threads import lapack_on_one_thread
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
count = lib.MKL_Get_Max_Threads
count.restype = ctypes.c_int
x = torch.randn(64, 64, dtype=torch.float64)
want = torch.linalg.eigh(x @ x.T)[0]
out = {"outside": count()}
inside, done = threading.Event(), threading.Event()
def other():
    inside.wait(10)
    out["other_thread"] = count()
    done.set()
t = threading.Thread(target=other)
t.start()
with lapack_on_one_thread():
    out["inside"] = count()
    out["same"] = bool(torch.allclose(torch.linalg.eigh(x @ x.T)[0], want, rtol=1e-12, atol=1e-9))
    inside.set()
    done.wait(10)
out["after"] = count()
print(json.dumps(out))
"""


def test_lapack_on_one_thread_is_this_threads_alone() -> None:
    """Inside the block MKL runs on one thread for the calling thread only (another thread keeps the pool),
    the result is the same, and the count is back afterwards."""
    import torch

    if "mkl" not in torch.__config__.show().lower():
        pytest.skip("this torch build has no MKL: the block is a no-op")  # every x86 wheel we install has MKL
    full = {k: v for k, v in os.environ.items() if k not in _CLEARED} | {"OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", _LOCAL_PROBE], env=full, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    pool = out["outside"]  # MKL's count for OMP_NUM_THREADS=2 (2 wherever two CPUs are usable)
    assert pool >= 1 and out == {"outside": pool, "other_thread": pool, "inside": 1, "same": True, "after": pool}


_INLINE_PROBE = """
import json, threading
import kamera_engine, torch
from kamera_engine.threads import pooled, small_kernels_inline
out = {"outside": torch.get_num_threads()}
inside, done = threading.Event(), threading.Event()
def other():
    inside.wait(10)
    out["other_thread"] = torch.get_num_threads()
    done.set()
t = threading.Thread(target=other)
t.start()
with small_kernels_inline():
    out["inside"] = torch.get_num_threads()
    out["pooled"] = pooled(torch.get_num_threads)
    out["after_pooled"] = torch.get_num_threads()
    with small_kernels_inline():  # nested: nothing changes, and its end gives nothing back early
        out["nested"] = pooled(torch.get_num_threads)
    out["after_nested"] = torch.get_num_threads()
    inside.set()
    done.wait(10)
out["after"] = torch.get_num_threads()
out["plain_pooled"] = pooled(torch.get_num_threads)
print(json.dumps(out))
"""


def test_small_kernels_inline_is_this_threads_alone_and_pooled_gives_the_pool_back() -> None:
    """Inside the block the calling thread counts one OpenMP thread (another thread keeps its pool), ``pooled``
    runs its call on the pool and returns to one, a nested block changes nothing, and the count is back after."""
    full = {k: v for k, v in os.environ.items() if k not in _CLEARED} | {"OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", _INLINE_PROBE], env=full, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    pool = out["outside"]
    assert out == {
        "outside": pool,
        "other_thread": pool,
        "inside": 1,
        "pooled": pool,
        "after_pooled": 1,
        "nested": pool,
        "after_nested": 1,
        "after": pool,
        "plain_pooled": pool,
    }

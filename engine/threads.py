"""How many CPU threads the engine's kernels use, and how idle threads wait.

torch runs its CPU kernels on an OpenMP pool that, by default, takes one thread per core and keeps idle
threads spinning between kernels. On a machine that also runs other work (a browser, tools, another
agent), a spinning or descheduled thread stalls every parallel region: on a shared 2-core machine one
competing process made the demo ten times slower. The policy here keeps contention from compounding:

* idle threads sleep instead of spin (``OMP_WAIT_POLICY=PASSIVE`` and ``KMP_BLOCKTIME=0``). OpenMP reads
  these once, when torch loads its library, so this module sets them at ``kamera_engine`` import, and only
  when torch is not imported yet and the user has not set them;
* the intra-op thread count is the CPUs this process may use (affinity and cgroup quota), capped at
  :data:`MAX_AUTO_THREADS`; half of them when the machine is already oversubscribed (a 1-minute load
  average at or above the CPU count: every thread is then descheduled often, and each parallel region
  waits for its slowest thread). Unless the user chose: ``KAMERA_THREADS`` (a number, or ``torch`` to leave
  torch's own choice and wait policy alone), then ``OMP_NUM_THREADS``, then a count set with
  ``torch.set_num_threads`` before this module was imported.

:func:`thread_plan` says what was chosen and why (``kamera doctor`` prints it); :func:`set_threads`
changes the count at run time.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

from .errors import InvalidInputError, positive_int

T = TypeVar("T")

#: the most threads chosen automatically: a small model's kernels gain little past this, and a shared
#: machine loses less when a descheduled thread stalls a parallel region
MAX_AUTO_THREADS = 8
#: the environment variables that override the automatic choice, most specific first
THREADS_ENV = "KAMERA_THREADS"
#: OpenMP runtimes' wait settings: GNU libgomp reads the first, Intel/LLVM OpenMP the second
_WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


@dataclass(frozen=True)
class ThreadPlan:
    """The engine's CPU threading: ``threads`` intra-op threads and how idle ones wait, with the reason."""

    threads: int
    cpus: int
    source: str  # KAMERA_THREADS, OMP_NUM_THREADS, torch.set_num_threads, auto, set_threads or torch
    wait_policy: str
    reason: str
    #: a forward's small kernels run inline (:func:`small_kernels_inline`): where idle pool threads sleep
    inline_small_kernels: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, lowered by a cgroup v2 CPU quota if one is set."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def auto_threads(cpus: int, load: float | None = None) -> tuple[int, str, str]:
    """The automatic thread count for ``cpus`` usable CPUs and the 1-minute ``load`` average (read when
    None), as (count, source, reason)."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this platform
            load = 0.0
    n = min(cpus, MAX_AUTO_THREADS)
    if load >= cpus and cpus > 1:
        n = max(1, n // 2)
        why = f"{cpus} usable CPU(s) already oversubscribed (load average {load:.1f}): half of them"
    else:
        why = f"{cpus} usable CPU(s) (load average {load:.1f}), at most {MAX_AUTO_THREADS}"
    return n, "auto", f"{why}; set {THREADS_ENV} to choose"


def _parse_threads(value: str, name: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise InvalidInputError(f"{name}={value!r}: expected a positive thread count or 'torch'") from None
    if n < 1:
        raise InvalidInputError(f"{name}={value!r}: expected a positive thread count or 'torch'")
    return n


def _set_wait_policy(torch_loaded: bool) -> str:
    """Make idle OpenMP threads sleep, if it is still possible and the user did not choose; describe it."""
    user = {k: os.environ[k] for k in _WAIT_ENV if k in os.environ}
    if user:
        return "as set: " + ", ".join(f"{k}={v}" for k, v in user.items())
    if torch_loaded:
        return "torch default (torch was imported before kamera_engine, too late to change it)"
    os.environ.update(_WAIT_ENV)
    return "passive (" + ", ".join(f"{k}={v}" for k, v in _WAIT_ENV.items()) + ")"


def _configure() -> ThreadPlan:
    torch_loaded = "torch" in sys.modules
    cpus = available_cpus()
    chosen = os.environ.get(THREADS_ENV, "").strip()
    if chosen.lower() == "torch":
        import torch

        return ThreadPlan(torch.get_num_threads(), cpus, "torch", "torch default", f"{THREADS_ENV}=torch")
    wait = _set_wait_policy(torch_loaded)
    # waking a sleeping pool thread is what small kernels inline avoid; spinning ones wake for free
    sleeping = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
    import torch  # after the wait policy: OpenMP reads it when torch's library loads

    if chosen:
        n = _parse_threads(chosen, THREADS_ENV)
        source, reason = THREADS_ENV, f"{THREADS_ENV}={n}"
    elif os.environ.get("OMP_NUM_THREADS", "").strip():
        n, source = torch.get_num_threads(), "OMP_NUM_THREADS"
        reason = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} (respected; {THREADS_ENV} overrides)"
    elif torch_loaded and torch.get_num_threads() != cpus:
        n, source = torch.get_num_threads(), "torch.set_num_threads"
        reason = "a thread count set through torch before kamera_engine was imported"
    else:
        n, source, reason = auto_threads(cpus)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return ThreadPlan(n, cpus, source, wait, reason, sleeping)


_plan: ThreadPlan = _configure()


def thread_plan() -> ThreadPlan:
    """What the engine chose for CPU threads and why (the current count, if changed since)."""
    import torch

    if torch.get_num_threads() != _plan.threads:
        return replace(
            _plan,
            threads=torch.get_num_threads(),
            source="changed at run time",
            reason="torch.set_num_threads was called after kamera_engine was imported",
        )
    return _plan


def set_threads(n: int) -> ThreadPlan:
    """Use ``n`` intra-op threads from now on (the wait policy is fixed once torch has loaded)."""
    global _plan
    import torch

    n = positive_int("threads", n)
    torch.set_num_threads(n)
    _plan = replace(_plan, threads=n, source="set_threads", reason=f"set_threads({n})")
    return _plan


def _thread_count_setter(name: str, restype: Any) -> Any:
    """The function ``name`` (one ``int`` argument: a thread count) from the libraries torch's own CPU library
    links, or None (another platform, or a build without that runtime)."""
    try:
        import ctypes

        import torch

        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        setter = getattr(lib, name)
    except (OSError, AttributeError):
        return None
    setter.argtypes, setter.restype = [ctypes.c_int], restype
    return setter


@functools.cache
def _mkl_local_setter() -> Any:
    """MKL's thread-local thread count setter from torch's own library, or None (no MKL in this build)."""
    import ctypes

    return _thread_count_setter("MKL_Set_Num_Threads_Local", ctypes.c_int)


@functools.cache
def _omp_local_setter() -> Any:
    """OpenMP's ``omp_set_num_threads`` from the runtime torch's own library links, or None (a build without
    OpenMP). It sets the calling thread's count only (OpenMP keeps it per thread), unlike ``torch.set_num_threads``,
    which also changes the count every thread started later begins with."""
    return _thread_count_setter("omp_set_num_threads", None)


#: per thread: its pool's thread count while :func:`small_kernels_inline` runs its small kernels on it alone
_inline = threading.local()


@contextmanager
def small_kernels_inline() -> Iterator[None]:
    """In this block torch runs the calling thread's CPU kernels on that thread alone (OpenMP's count for this
    thread is one; other threads keep theirs), except those passed to :func:`pooled`, which get the pool back.

    For a forward whose few big kernels (linears, attention) are worth the pool and whose many small ones (norms,
    rotary embedding, activations over a few hundred tokens) are not: torch splits any kernel over more than
    32,768 elements across the pool, and with idle pool threads asleep (the wait policy above) each split first
    wakes one, which costs most where the machine is shared. On the 2-core VM while its host was busy, a packed
    forward of 57 to 300 prompt tokens ran 8 to 19% faster with those kernels inline; on the quiet host, 0 to 8%
    slower in the median (the same at best of 25), and the 8-session batched server 2 to 4% faster (bit for bit
    the same results: the kernels do not reduce across the split; ``batch.inlines_small_kernels`` decides which
    forwards, ``docs/batching.md``). A no-op where idle pool threads spin
    (the thread plan's ``inline_small_kernels``: a wait policy other than passive), where torch has no OpenMP, for
    a pool of one thread, or nested."""
    import torch

    setter = _omp_local_setter()
    pool = torch.get_num_threads()  # this thread's count (torch sets a new thread up on first use)
    if not _plan.inline_small_kernels or setter is None or pool <= 1 or getattr(_inline, "pool", None) is not None:
        yield
        return
    _inline.pool = pool
    setter(1)
    try:
        yield
    finally:
        setter(pool)
        _inline.pool = None


def pooled(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the calling thread's pool, inside :func:`small_kernels_inline` (elsewhere a
    plain call): for the big kernels of such a block."""
    pool = getattr(_inline, "pool", None)
    if pool is None:
        return fn(*args, **kwargs)
    setter = _omp_local_setter()
    setter(pool)
    try:
        return fn(*args, **kwargs)
    finally:
        setter(1)


@contextmanager
def lapack_on_one_thread() -> Iterator[None]:
    """MKL (torch's BLAS and LAPACK on x86 CPUs) runs on one thread in this block, for the calling thread
    only. A small factorisation (a patch's per-layer eigh of a Gram matrix, 192 x 192 at most on the default
    model) gains nothing from threads, and a threaded one stalls badly when another thread holds a core: on
    the 2-core machine, 30 such eigh of 192 x 192 took 1 to 24 s on two threads beside a busy core and 0.3
    to 0.5 s on one. The model's own thread keeps its count (MKL's thread-local setting). A no-op where torch
    has no MKL."""
    setter = _mkl_local_setter()
    if setter is None:
        yield
        return
    previous = setter(1)
    try:
        yield
    finally:
        setter(previous)  # 0: back to the global setting

"""The machine a benchmark ran on, kept with its figures: the same command gives other ratios on another CPU
(docs/batching.md measures one run on a host with AVX-512 and one without)."""

from __future__ import annotations

import platform
from typing import Any

from kamera_engine.threads import available_cpus


def machine() -> dict[str, Any]:
    """The CPU's model name, the vector instructions torch's kernels use on it (``AVX512``, ``AVX2``, ...),
    the CPUs this process may run on and the torch version."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": available_cpus(),
        "torch": torch.__version__,
    }

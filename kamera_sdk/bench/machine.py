"""The machine a benchmark ran on, kept with its figures: the same command gives other ratios on another CPU
(docs/batching.md measures one run on a host with AVX-512 and one without)."""

from __future__ import annotations

import platform
from typing import Any

from kamera_engine.threads import available_cpus


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block ends at its blank line
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def machine() -> dict[str, Any]:
    """The CPU's model name, its family and model numbers where the kernel gives them (two hosts both named
    "Intel(R) Xeon(R) Processor" under KVM can be different parts), the vector instructions torch's kernels use
    on it (``AVX512``, ``AVX2``, ...), the CPUs this process may run on and the torch version."""
    import torch

    info = _cpuinfo()
    out: dict[str, Any] = {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": available_cpus(),
        "torch": torch.__version__,
    }
    if "cpu family" in info and "model" in info:
        out["cpu_id"] = f"family {info['cpu family']} model {info['model']}"
    return out

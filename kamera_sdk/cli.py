"""The ``kamera`` command: ``demo``, ``bench <name>``, ``doctor``."""

from __future__ import annotations

import argparse
from typing import Any

from .cli_args import (
    add_batching_flags,
    add_limit_flags,
    add_vision_flags,
    batching_flags_given,
    batching_options,
    batching_refused,
    engine_loader,
    limit_options,
    port,
)
from .console import err, print_result
from .fleet_cli import add_fleet_command
from .store_cli import add_store_command


def _engine(args: argparse.Namespace):
    with err.status(f"loading {args.model or 'the embedded default model'}"):
        return engine_loader(args)()


def cmd_bench(args: argparse.Namespace) -> int:
    from kamera_engine import InvalidInputError

    from .bench import get_bench, preflight

    if args.shape is not None:  # a random-weight model of a known architecture: operator speed only
        from kamera_engine.shapes import random_engine

        from .bench.operator import run_shape

        if args.name != "operator":
            raise InvalidInputError(f"--shape goes with the operator benchmark, not {args.name!r}")
        with err.status(f"building a random-weight {args.shape}"):
            engine = random_engine(args.shape, args.layers, device=args.device, dtype=args.dtype)
        print_result(run_shape(engine, args.shape, quick=args.quick), args.json, f"kamera bench operator {args.shape}")
        return 0
    run = get_bench(args.name)
    preflight(args.name)
    extra: dict[str, Any] = {} if args.act_seconds is None else {"act_seconds": args.act_seconds}  # window only
    if args.repeat is not None:
        extra["repeat"] = args.repeat
    if args.act_seconds is not None and args.name != "window":
        raise InvalidInputError("--act-seconds goes with the window benchmark")
    if args.repeat is not None and args.name not in ("window", "serve"):
        raise InvalidInputError("--repeat goes with the window and serve benchmarks")
    result = run(_engine(args), quick=args.quick, **extra)
    print_result(result, args.json, f"kamera bench {args.name}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import platform

    import torch
    import transformers

    from kamera_engine import resolve_device
    from kamera_engine.attention import flash_attn_available, resolve_attention
    from kamera_engine.kernels.dispatch import status as gpu_kernel_status
    from kamera_engine.threads import thread_plan

    from .config import WindowConfig

    report: dict[str, Any] = {
        "kamera": __import__("kamera_sdk").__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
        "flash_attn_installed": flash_attn_available(),
        "gpu_kernels": gpu_kernel_status(),
        "threads": thread_plan().as_dict(),  # the count, the OpenMP wait policy, and why
        "window_buffer_reuse": WindowConfig.model_fields["reuse_buffer"].default,
    }
    try:
        device = resolve_device(args.device)  # known even if the model then fails to load
        report["device"], report["attention"] = str(device), resolve_attention(None, device)
        engine = _engine(args)
        report["model"] = engine.info().model_dump()
        report["default_model"] = args.model is None
        report["fingerprint"] = engine.fingerprint
        report["canonicals"] = _canonicals(engine)
        report["model_loads"] = True
    except Exception as exc:  # report, do not crash: this is the diagnostic command
        report["model_loads"] = False
        report["error"] = f"{type(exc).__name__}: {exc}"
    print_result(report, args.json, "kamera doctor")
    return 0 if report["model_loads"] else 1


def _canonicals(engine: Any) -> dict[str, Any]:
    """Where canonical keys come from, and the rotation placements use, per KV dtype (docs/gpu.md)."""
    import torch

    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return {
        "key_source": "pre-RoPE capture" if engine.canonical_source == "pre_rope" else "un-rotation",
        "fallback_reason": engine.canonical_source_reason,
        "rotation": engine.rotation,
        "rotation_by_dtype": {str(d).replace("torch.", ""): engine.default_rotation(d) for d in dtypes},
        "kernels_compute": "exact",  # the fused CPU and Triton kernels; "model" runs on torch's path
    }


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(_engine(args), quick=args.quick, as_json=args.json)


def cmd_serve(args: argparse.Namespace) -> int:
    from .server.cli import serve

    options = batching_options(args)  # a contradiction is refused before the model loads
    engine = _engine(args)
    given = batching_flags_given(args)
    if given and not engine.batchable:
        raise batching_refused(given, f"this model does not do ({type(engine).__name__} decodes one answer at a time)")
    options |= limit_options(args)
    return serve(engine, host=args.host, port=args.port, api_key=args.api_key, store=args.store, **options)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kamera",
        description="Kamera: a position-free KV cache for agents. Store each chunk once, place it anywhere.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="HF id or local path (default: the embedded SmolLM2-135M)")
    common.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    common.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    as_json = argparse.ArgumentParser(add_help=False)  # commands that print a result (not serve)
    as_json.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    report = argparse.ArgumentParser(add_help=False, parents=[as_json])  # ... and have a shorter run
    report.add_argument("--quick", action="store_true", help="a shorter run (fewer probes / steps)")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", parents=[common, report], help="a short agent session: slide, reorder, recall vs recompute/prefix"
    )
    demo.set_defaults(func=cmd_demo)
    bench = sub.add_parser(
        "bench",
        parents=[common, report],
        help="run a benchmark: operator, window, compare, store, gpu, serve or threads (JSON with --json)",
    )
    bench.add_argument(
        "name",
        help="operator (relocation error, eta vs rank, speed), window (agent trace per policy), "
        "compare (reuse and compression policies side by side), store (load vs recompute per tier), "
        "gpu (the GPU suite on CUDA, kept as docs/results/gpu-<device>.json), "
        "serve (concurrent sessions on one server, batched vs one at a time), "
        "threads (the demo slice per thread setting, idle and under a competing process)",
    )
    bench.add_argument("--shape", default=None, help="operator only: a random-weight model of this architecture")
    bench.add_argument("--layers", type=int, default=None, help="with --shape: keep only the first N layers")
    bench.add_argument(
        "--act-seconds",
        type=float,
        default=None,
        help="window only: idle time the agent spends acting before each step, the same for every policy",
    )
    bench.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="window: run the trace N times, every policy in each pass, and take each step's least "
        "operation-plus-question time and TTFT (critical_over_recompute_max, the _min ratios; the issue's "
        "figures use 3); serve: run both arms N times per session count, alternating which goes first, and "
        "report the pair with the median ratio (all pairs under runs); default 1",
    )
    bench.set_defaults(func=cmd_bench)
    doctor = sub.add_parser(
        "doctor", parents=[common, as_json], help="versions, device, attention backend, default model"
    )
    doctor.set_defaults(func=cmd_doctor)
    serve = sub.add_parser("serve", parents=[common], help="run one engine behind an HTTP API (sessions = windows)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s)")
    serve.add_argument("--port", type=port, default=8765, help="TCP port, 0 for a free one (default: %(default)s)")
    serve.add_argument("--api-key", default=None, help="require this bearer token on every request")
    serve.add_argument("--store", default=None, help="store path or redis:// URL shared by all sessions")
    add_batching_flags(serve)
    add_limit_flags(serve)
    add_vision_flags(serve)
    serve.set_defaults(func=cmd_serve)
    add_store_command(sub)
    add_fleet_command(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from kamera_engine import KameraError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KameraError as exc:
        err.print(f"[red]error:[/] {exc}")
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

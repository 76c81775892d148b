"""Realistic shapes without weights (engine/shapes.py), the operator's shape benchmark, ``kamera bench gpu``'s
refusal without CUDA and the GPU kernel line of ``kamera doctor``."""

from __future__ import annotations

import json

import pytest
import torch

from kamera_engine import InvalidInputError, KameraError
from kamera_engine.kernels import dispatch
from kamera_engine.shapes import random_engine, shape_config, shapes
from kamera_sdk.bench import gpu
from kamera_sdk.bench.operator import run_shape
from kamera_sdk.cli import main


def test_shapes_carry_the_released_architectures() -> None:
    assert {"llama-3.1-8b", "qwen2.5-7b", "qwen2.5-vl-7b", "smollm2-135m"} <= set(shapes())
    llama = shape_config("llama-3.1-8b")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads) == (4096, 32, 32)
    assert (llama.num_key_value_heads, llama.intermediate_size, llama.vocab_size) == (8, 14336, 128256)
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["rope_theta"] == 500000.0
    qwen = shape_config("qwen2.5-vl-7b", layers=3)
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_key_value_heads, qwen.vocab_size) == (3584, 3, 4, 152064)
    with pytest.raises(InvalidInputError, match="unknown shape"):
        shape_config("gpt-5")
    with pytest.raises(InvalidInputError, match=r"--layers must be in 1\.\.28"):
        shape_config("qwen2.5-7b", layers=29)


def test_shape_benchmark_reports_speed_on_a_random_model() -> None:
    engine = random_engine("smollm2-135m", 1, device="cpu")  # the CPU figures (a GPU loads bf16)
    assert engine.num_layers == 1 and (engine.num_kv_heads, engine.key_dim) == (3, 64)
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())
    out = run_shape(engine, "smollm2-135m", quick=True)
    assert out["shape"] == "smollm2-135m" and out["layers"] == 1 and out["device"] == "cpu"
    assert out["dtype"] == "float32" and set(out["speedup_by_tokens"]) == {"512", "2048"}
    assert all(v > 0 for v in out["speedup_by_tokens"].values())
    # rank 32 over 1024 tokens, 1 layer, 3 KV heads x 64: (T x m + m x F) x 4 bytes, for K and V
    assert out["patch_bytes"] == 2 * (1024 * 32 + 32 * 192) * 4
    assert out["patch_bytes_fraction"] == pytest.approx(out["patch_bytes"] / (2 * 1024 * 192 * 4))
    assert out["memcpy_gbps"] > 0 and out["apply_gbps"] > 0 and out["apply_kernel"] in ("c", "torch")


def test_bench_gpu_refuses_without_cuda_before_loading(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "gpu", "--model", "/nonexistent/model"]) == 2  # the refusal, not a load error
    assert "needs a CUDA device" in capsys.readouterr().err
    assert gpu.device_slug("NVIDIA H200") == "nvidia-h200"


def test_bench_gpu_keeps_each_section_and_names_the_ones_that_failed(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The suite's bookkeeping, without a GPU: the sections stand in for the measurements (which need CUDA).
    Its partial file is rewritten after every section, a failing section is recorded and the rest still run,
    and the run ends in an error naming it; a run stopped part way keeps what finished; only a run whose every
    section passed replaces the complete file."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(dispatch, "status", lambda device=None: "triton (test)")
    engine = type("E", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16})()
    path = tmp_path / "gpu-test-gpu.partial.json"
    done = tmp_path / "gpu-test-gpu.json"
    done.write_text('{"earlier": "complete"}')  # a complete earlier result: replaced only by another
    seen: list[str] = []

    def section(name: str, value: object):
        def run(*args: object, **kwargs: object) -> object:
            seen.append(name)
            if name == "operator":
                raise RuntimeError("Expected all tensors to be on the same device")
            if name == "window":
                assert json.loads(path.read_text())["kernels"] == {"half": 0.0}  # written before the next section
            return value

        return run

    monkeypatch.setattr(gpu, "kernel_check", section("kernels", {"half": 0.0}))
    monkeypatch.setattr(gpu.operator, "run", section("operator", {}))
    monkeypatch.setattr(gpu.window, "run", section("window", {"ttft": 1.0}))
    monkeypatch.setattr(gpu.operator, "run_shape", lambda big, shape, quick: {"shape": shape})
    monkeypatch.setattr("kamera_engine.shapes.random_engine", lambda *a, **k: object())
    failed = r"1 section\(s\) failed \(operator\); the others are in .*gpu-test-gpu\.partial\.json"
    with pytest.raises(KameraError, match=failed):
        gpu.run(engine, quick=True, results_dir=tmp_path)  # type: ignore[arg-type]
    assert seen == ["kernels", "operator", "window"]
    kept = json.loads(path.read_text())
    assert kept["failed"] == {"operator": "RuntimeError: Expected all tensors to be on the same device"}
    assert "operator" not in kept and kept["window"] == {"ttft": 1.0} and kept["quick"] is True
    assert kept["shapes"] == {s: {"shape": s} for s in gpu.SHAPES}

    def stopped(*args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt  # the lease ends: not a section's failure, and nothing after it runs

    monkeypatch.setattr(gpu.window, "run", stopped)
    monkeypatch.setattr(gpu.operator, "run", section("operator-ok", {"relocation_max_abs_err": 0.0}))
    with pytest.raises(KeyboardInterrupt):
        gpu.run(engine, quick=True, results_dir=tmp_path)  # type: ignore[arg-type]
    kept = json.loads(path.read_text())
    assert kept["failed"] == {} and kept["operator"] == {"relocation_max_abs_err": 0.0}
    assert "window" not in kept and "shapes" not in kept
    assert json.loads(done.read_text()) == {"earlier": "complete"}

    monkeypatch.setattr(gpu.window, "run", section("window", {"ttft": 2.0}))
    result = gpu.run(engine, quick=True, results_dir=tmp_path)  # type: ignore[arg-type]
    assert result["written_to"] == str(done) and not path.exists()
    complete = json.loads(done.read_text())
    assert complete["failed"] == {} and complete["window"] == {"ttft": 2.0}
    assert set(complete["shapes"]) == set(gpu.SHAPES)


def test_shape_flag_only_with_the_operator_bench(capsys) -> None:
    assert main(["bench", "window", "--shape", "qwen2.5-7b"]) == 2
    assert "--shape goes with the operator benchmark" in capsys.readouterr().err
    assert main(["bench", "operator", "--shape", "nope"]) == 2
    assert "unknown shape" in capsys.readouterr().err


def test_doctor_reports_the_gpu_kernel_choice(capsys, tmp_path) -> None:
    assert main(["doctor", "--json", "--model", str(tmp_path / "missing")]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["gpu_kernels"] == dispatch.status()

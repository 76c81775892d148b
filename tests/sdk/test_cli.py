"""The ``kamera`` command line: doctor reports in JSON, bad input gets a clear error and exit code 2."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest

from kamera_sdk.cli import build_parser, main


@pytest.mark.slow
def test_doctor_json_reports_the_default_model(capsys) -> None:
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model_loads"] is True and report["default_model"] is True
    assert report["model"]["num_layers"] == 30
    assert report["torch"].startswith("2.")
    assert (report["device"], report["attention"]) == (report["model"]["device"], report["model"]["attention"])


def test_doctor_reports_device_and_attention_when_the_model_does_not_load(capsys, tmp_path) -> None:
    from kamera_engine import resolve_device
    from kamera_engine.attention import resolve_attention

    assert main(["doctor", "--json", "--model", str(tmp_path / "missing")]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["model_loads"] is False and "missing" in report["error"]
    device = resolve_device(None)
    assert (report["device"], report["attention"]) == (str(device), resolve_attention(None, device))
    assert main(["doctor", "--json", "--device", "bogus"]) == 1  # a report, not a traceback
    report = json.loads(capsys.readouterr().out)
    assert report["error"].startswith("InvalidInputError: unknown device 'bogus'") and "device" not in report


def test_doctor_says_what_threads_the_engine_chose_and_why(capsys, tmp_path) -> None:
    import torch

    main(["doctor", "--json", "--model", str(tmp_path / "missing")])
    threads = json.loads(capsys.readouterr().out)["threads"]
    assert threads["threads"] == torch.get_num_threads() and threads["reason"] and threads["wait_policy"]


def test_unknown_bench_is_a_clear_error(capsys) -> None:
    assert main(["bench", "nope", "--model", "/nonexistent"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_help_explains_every_subcommand() -> None:
    text = build_parser().format_help()
    for sub in ("demo", "bench", "doctor"):
        assert sub in text


def test_json_output_is_strict_json(capsys) -> None:
    from kamera_sdk.console import print_result

    print_result({"kl_mean": float("nan"), "speedup": float("inf"), "rows": [1.5, float("-inf")]}, True, "t")

    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    assert json.loads(capsys.readouterr().out, parse_constant=refuse) == {
        "kl_mean": None,
        "speedup": None,
        "rows": [1.5, None],
    }


def test_a_port_out_of_range_is_an_argument_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--port", "99999"])
    assert exc.value.code == 2 and "port must be in 0..65535" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json", "--quick"])
def test_serve_refuses_the_report_flags_it_would_ignore(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", flag])
    assert exc.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err
    assert build_parser().parse_args(["bench", "window", flag, "--model", "m"]).model == "m"


def test_doctor_takes_json_but_not_quick(capsys) -> None:
    assert build_parser().parse_args(["doctor", "--json"]).json
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["doctor", "--quick"])  # it has no shorter run: refused, not ignored
    assert exc.value.code == 2 and "unrecognized arguments: --quick" in capsys.readouterr().err


def test_serve_help_shows_its_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "(default: 127.0.0.1)" in out and "(default: 8765)" in out


def test_serve_takes_the_batching_options(capsys) -> None:
    line = ["serve", "--kv-budget", "512MiB", "--step-tokens", "256", "--max-batch-rows", "16"]
    args = build_parser().parse_args(line)
    assert (args.batch, args.kv_budget, args.step_tokens, args.max_batch_rows) == (True, 512 << 20, 256, 16)
    assert not build_parser().parse_args(["serve", "--no-batch"]).batch
    sizes = {"4096": 4096, " 2 GiB ": 2 << 30, "2GB": 2 * 10**9, "1.5GiB": 3 << 29, "500m": 500 * 10**6, "7b": 7}
    for text, size in sizes.items():  # the grammar kamera store prune --max-bytes reads too
        assert build_parser().parse_args(["serve", "--kv-budget", text]).kv_budget == size
    for bad, message in [
        (["--kv-budget", "\u00b2"], "expected a size in bytes such as"),
        (["--kv-budget", "2 PB"], "expected a size in bytes such as"),
        (["--kv-budget", "1e9"], "expected a size in bytes such as"),
        (["--kv-budget", "1.5"], "'1.5' is not a whole number of bytes"),
        (["--kv-budget", "1.0000000000000000000000000001"], "is not a whole number of bytes"),  # exact, not rounded
        (["--kv-budget", "1k\u0131"], "expected a size in bytes such as"),  # ASCII units only
        (["--kv-budget", "0KiB"], "at least 1 byte"),
        (["--step-tokens", "0"], "must be at least 1"),
        (["--max-batch-rows", "x"], "expected a whole number, got 'x'"),
        (["--port", "80a"], "expected a whole number, got '80a'"),
    ]:
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["serve", *bad])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_serve_passes_them_on_and_refuses_them_without_batching(monkeypatch, capsys) -> None:
    import kamera_sdk.cli as cli
    import kamera_sdk.server.cli as server_cli

    served: list[dict] = []
    engine = SimpleNamespace(batchable=True)
    monkeypatch.setattr(cli, "_engine", lambda args: engine)
    monkeypatch.setattr(server_cli, "serve", lambda engine, **kw: served.append({"engine": engine, **kw}) or 0)
    assert main(["serve", "--kv-budget", "1GiB", "--step-tokens", "128"]) == 0
    (got,) = served
    assert got["engine"] is engine and got["batch"] is True
    assert (got["kv_budget_bytes"], got["step_tokens"]) == (1 << 30, 128)
    assert "max_batch_rows" not in got  # not given: create_app's default

    engine.batchable = False  # a model that decodes one answer at a time (vision)
    assert main(["serve", "--max-batch-rows", "4"]) == 2
    assert "--max-batch-rows configures batching, which this model does not do" in capsys.readouterr().err
    assert main(["serve"]) == 0 and len(served) == 2  # nothing to refuse without the flags

    def no_model(args: object) -> None:
        raise AssertionError("the model must not load for a refused command line")

    monkeypatch.setattr(cli, "_engine", no_model)
    assert main(["serve", "--no-batch", "--step-tokens", "8", "--kv-budget", "1KiB"]) == 2
    assert "--kv-budget, --step-tokens configure batching, which --no-batch turns off" in capsys.readouterr().err
    assert len(served) == 2


def test_serve_takes_the_held_tokens_limit_with_or_without_batching(monkeypatch, capsys) -> None:
    import kamera_sdk.cli as cli
    import kamera_sdk.server.cli as server_cli

    served: list[dict] = []
    monkeypatch.setattr(cli, "_engine", lambda args: SimpleNamespace(batchable=False))
    monkeypatch.setattr(server_cli, "serve", lambda engine, **kw: served.append(kw) or 0)
    assert main(["serve", "--max-held-tokens", "200000"]) == 0
    assert main(["serve", "--no-batch", "--max-held-tokens", "64"]) == 0  # a server limit, not a batching one
    assert main(["serve"]) == 0
    assert [kw.get("max_held_tokens") for kw in served] == [200000, 64, None]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--max-held-tokens", "0"])
    assert exc.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def test_serve_takes_the_vision_flags_and_refuses_them_for_a_text_model(monkeypatch, capsys, tmp_path) -> None:
    import transformers

    import kamera_sdk.server.cli as server_cli
    from kamera_engine.vision import VisionEngine
    from kamera_engine.vision.tiny import build_tiny_vlm

    served: list[object] = []
    monkeypatch.setattr(server_cli, "serve", lambda engine, **kw: served.append(engine) or 0)
    model = str(build_tiny_vlm("qwen2_vl", tmp_path / "vlm"))
    rows = tmp_path / "rows"
    line = ["serve", "--model", model, "--device", "cpu", "--vision-memory", "1MiB", "--vision-cache", str(rows)]
    assert main(line) == 0
    (engine,) = served
    assert isinstance(engine, VisionEngine)
    assert (engine.vision_cache.stats.max_memory_bytes, engine.vision_cache.directory) == (1 << 20, rows)
    assert main(["serve", "--model", model, "--device", "cpu"]) == 0  # the defaults: 1 GiB, no directory
    assert (served[-1].vision_cache.stats.max_memory_bytes, served[-1].vision_cache.directory) == (1 << 30, None)

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("a refused model's weights must not load")

    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained", no_weights)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    assert main(["serve", "--vision-memory", "1MiB"]) == 2  # the embedded default model is a text model
    said = " ".join(capsys.readouterr().err.split())
    assert "--vision-memory configures a vision-language model's tower outputs" in said
    assert "'llama' has no Kamera vision family" in said
    assert main(["serve", "--vision-cache", str(rows), "--vision-memory", "2G"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "--vision-memory, --vision-cache configure a vision-language model's" in said
    assert len(served) == 2
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--vision-memory", "0"])
    assert exc.value.code == 2 and "at least 1 byte" in capsys.readouterr().err


def test_fleet_up_takes_the_batching_flags_and_refuses_a_contradiction_before_ray(monkeypatch, capsys) -> None:
    import kamera_sdk.fleet_cli as fleet_cli

    line = ["fleet", "up", "--store", "redis://127.0.0.1:1/0", "--kv-budget", "1GiB", "--max-batch-rows", "8"]
    started: list[dict] = []
    fake = SimpleNamespace(up=lambda args: started.append(args.app_options) or 0)
    monkeypatch.setattr(fleet_cli, "import_module", lambda name: fake)
    assert main(line) == 0
    assert started == [{"batch": True, "kv_budget_bytes": 1 << 30, "max_batch_rows": 8}]
    assert main(["fleet", "up", "--store", "redis://127.0.0.1:1/0", "--no-batch"]) == 0
    assert started[-1] == {"batch": False}
    assert main(["fleet", "up", "--store", "redis://127.0.0.1:1/0", "--max-held-tokens", "4096"]) == 0
    assert started[-1] == {"batch": True, "max_held_tokens": 4096}  # each replica's bound
    loaders: list = []
    monkeypatch.setattr(fleet_cli, "import_module", lambda name: SimpleNamespace(up=lambda a: loaders.append(a) or 0))
    assert main(["fleet", "up", "--store", "redis://127.0.0.1:1/0", "--model", "m", "--vision-memory", "2GiB"]) == 0
    load = pickle.loads(pickle.dumps(loaders[-1].load_engine))  # each Ray replica gets it pickled
    assert load.args == ("m", None, None, {"vision_memory_bytes": 2 << 30})

    def no_fleet(name: str) -> None:
        raise AssertionError("Ray must not start for a refused command line")

    monkeypatch.setattr(fleet_cli, "import_module", no_fleet)
    assert main([*line, "--no-batch"]) == 2
    said = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "--kv-budget, --max-batch-rows configure batching, which --no-batch turns off" in said
    for bad, message in [(["--port", "70000"], "port must be in 0..65535"), (["--replicas", "0"], "at least 1")]:
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["fleet", "up", "--store", "redis://h/0", *bad])
        assert exc.value.code == 2 and message in capsys.readouterr().err

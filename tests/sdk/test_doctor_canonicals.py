"""``kamera doctor`` says how the window's buffer is kept and where canonical keys come from, per dtype."""

from __future__ import annotations

import json

import pytest

from kamera_sdk import WindowConfig
from kamera_sdk.cli import main


def test_doctor_reports_the_window_buffer_reuse_default(capsys, tmp_path) -> None:
    main(["doctor", "--json", "--model", str(tmp_path / "missing")])  # known without a model
    report = json.loads(capsys.readouterr().out)
    assert report["window_buffer_reuse"] is WindowConfig().reuse_buffer is True


@pytest.mark.slow
def test_doctor_reports_the_canonical_key_source_and_rotation_per_dtype(capsys) -> None:
    assert main(["doctor", "--json", "--device", "cpu", "--dtype", "bfloat16"]) == 0
    canonicals = json.loads(capsys.readouterr().out)["canonicals"]
    assert canonicals["key_source"] == "pre-RoPE capture" and canonicals["fallback_reason"] is None
    assert canonicals["rotation"] == "model"
    assert canonicals["rotation_by_dtype"] == {"float32": "exact", "bfloat16": "model", "float16": "model"}

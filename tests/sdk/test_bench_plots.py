"""The docs' plots redraw from the kept benchmark results (the JSON shapes the benchmarks write)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kamera_sdk.bench.plots import main

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


@pytest.mark.parametrize(
    ("name", "pictures"),
    [
        ("operator", {"eta_vs_rank.png", "eta_vs_partial_reprefill.png", "speedup_vs_length.png"}),
        ("window", {"window_trace.png"}),
        ("compare", {"eta_vs_bytes.png", "kl_vs_kv_budget.png"}),
    ],
)
def test_each_kept_result_redraws_its_pictures(
    name: str, pictures: set[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(RESULTS / f"{name}.json"), str(tmp_path)]) == 0
    drawn = {Path(line).name for line in capsys.readouterr().out.split()}
    assert drawn == pictures
    assert all((tmp_path / p).stat().st_size > 10_000 for p in pictures)


def test_a_window_result_without_the_floor_still_draws(tmp_path: Path) -> None:
    result = json.loads((RESULTS / "window.json").read_text())
    for step in result["steps"]:
        step.pop("ttft_floor_s", None)
    src = tmp_path / "old.json"
    src.write_text(json.dumps(result))
    assert main([str(src), str(tmp_path)]) == 0

"""``examples/video_agent.py`` runs end to end on tiny random VLMs (synthetic clip and a real video file):
it slides over segments, recalls the first one, encodes each segment once, and says what Kamera saved."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vision.conftest import write_video

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "video_agent.py"), "--short", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )
    assert proc.returncode == 0, f"video_agent failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_video_agent_short(family: str) -> None:
    out = run("--family", family)
    assert "slide: 1 segment(s) out" in out and "recall: segment 0" in out
    assert "survivor" in out  # a survivor of the slide was only rotated
    runs = re.search(r"vision tower runs: (\d+) for (\d+) distinct segments", out)
    assert runs is not None and runs.group(1) == runs.group(2)
    saved = re.search(r"Kamera saved (\d+) tokens prefilled: (\d+) with Kamera vs (\d+)", out)
    assert saved is not None and int(saved.group(2)) < int(saved.group(3))


def test_video_agent_on_a_video_file(tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    write_video(path, n_frames=8, fps=1)
    out = run("--video", str(path))
    assert "8 frames -> 4 segments" in out
    assert "Kamera saved" in out

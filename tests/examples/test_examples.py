"""Every example in ``examples/`` runs in ``--short`` mode on the embedded default model and says what it saved."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SAVED = "Kamera saved "


def _has_chat_kamera() -> bool:
    try:
        return hasattr(importlib.import_module("kamera_langchain"), "ChatKamera")
    except ImportError:
        return False


def run_example(name: str, *extra: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--short", *extra],
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=300,
        # one torch thread unless told otherwise: on a shared CI runner, intra-op threads that compete with
        # other jobs for the cores make every forward many times slower (measured 20x on a loaded 2-core VM)
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})},
    )
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert SAVED in proc.stdout, f"{name} did not print what it saved:\n{proc.stdout[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("name", ["web_research_agent.py", "document_agent.py"])
def test_example_short(name: str) -> None:
    out = run_example(name)
    assert "recall" in out  # both look back at an evicted page


def test_many_agents_short() -> None:
    out = run_example("many_agents.py")
    assert "2 agents x 2 rounds" in out
    assert "answers identical both ways: 4 of 4" in out  # batched with asyncio, each as alone


def test_gui_agent_short_on_accessibility_text() -> None:
    out = run_example("gui_agent.py")
    assert "accessibility-tree text" in out
    assert "slide" in out


def test_gui_agent_short_on_screenshots_with_a_tiny_vlm(tmp_path: Path) -> None:
    out = run_example("gui_agent.py", "--tiny-vlm", "qwen2_vl", env={"TMPDIR": str(tmp_path)})
    assert "screenshots (add_image)" in out
    assert "slide" in out
    assert "vision tower runs: 3 for 3 distinct screens" in out
    assert not list(tmp_path.glob("kamera-gui-agent-*"))


def test_video_agent_short_leaves_no_temporary_model_behind(tmp_path: Path) -> None:
    out = run_example("video_agent.py", env={"TMPDIR": str(tmp_path)})
    assert "vision tower runs: 4 for 4 distinct segments" in out
    assert not list(tmp_path.glob("kamera-video-agent-*"))  # the tiny model it built is removed at exit


@pytest.mark.skipif(not _has_chat_kamera(), reason="kamera_langchain has no ChatKamera yet (or langchain-core missing)")
def test_langchain_agent_short() -> None:
    out = run_example("langchain_agent.py")
    assert "dropped 2" in out  # trim_messages dropped the oldest turn: the window slid

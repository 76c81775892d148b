"""``scripts/serve_counts.py`` runs the serve bench one session count at a time and writes each count's result
when it ends (for a GPU lent by the minute): its plumbing, with the bench itself stood in for (the bench's own
tests run it for real)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kamera_engine import Engine
from kamera_sdk.bench import serve
from tests.conftest import script as load_script
from tests.conftest import tiny_engine


def test_each_count_is_written_as_it_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script("serve_counts")
    engine = tiny_engine("llama")
    seen: list[tuple[int, ...]] = []

    def stand_in(eng: Engine, *, quick: bool, counts: tuple[int, ...]) -> dict[str, Any]:
        assert eng is engine and quick
        seen.append(counts)
        n = str(counts[0])
        if n == "3":  # the later count fails: the earlier one is on disk already
            raise RuntimeError("device lease over")
        arm = {"tokens_per_s": 2.0 * counts[0]}
        return {"sessions": {n: {"batched": arm, "sequential": {"tokens_per_s": 1.0}}}, "throughput_ratio": {n: 2.0}}

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, device=None: engine))
    monkeypatch.setattr(serve, "run", stand_in)
    monkeypatch.setattr(sys, "argv", ["serve_counts.py", "2", "3", "--quick", "--out", str(tmp_path / "o")])
    with pytest.raises(RuntimeError, match="lease over"):
        script.main()
    assert seen == [(2,), (3,)]
    kind = engine.device.type
    written = json.loads((tmp_path / "o" / f"serve-{kind}-2.json").read_text())
    assert written["throughput_ratio"] == {"2": 2.0} and written["wall_s"] >= 0
    assert not (tmp_path / "o" / f"serve-{kind}-3.json").exists()

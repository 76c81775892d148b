"""Repeated passes of the window trace (``run_trace(repeat=N)``): each step's least operation-plus-question
time over the passes decides ``critical_over_recompute_max`` (and its least TTFT the ``_min`` ratios), and
a pass that ran different critical work than the first is left out rather than folded into a minimum."""

from __future__ import annotations

import pytest

import kamera_sdk.bench.window as bench
from kamera_engine import InvalidInputError
from kamera_sdk.bench.window import ACT_ARMS, build_trace, run_trace, work_differs
from tests.conftest import tiny_chat_engine

POLICIES = ("recompute", "prefix", "kamera")


@pytest.fixture(scope="module")
def trace():
    return build_trace(steps=6)  # first, slides, a recall (4) and a rerank (5)


@pytest.fixture(scope="module")
def result(trace):
    return run_trace(tiny_chat_engine(), trace, POLICIES, answer_tokens=2, act_seconds=60.0, arms=ACT_ARMS, repeat=2)


def test_the_figure_is_taken_from_each_steps_least_time(result, trace) -> None:
    assert result["repeat"] == 2 and result["repeat_policies"] == list(POLICIES)
    assert len(result["steps"]) == len(trace)
    for row in result["steps"]:
        for key in ("critical_s", "ttft_s"):
            assert set(row[f"{key}_min"]) == set(POLICIES)  # every policy timed in every pass
            for p, least in row[f"{key}_min"].items():
                seconds = row[f"{key}_passes"][p]
                assert len(seconds) == 2 and seconds[0] == row[key][p]  # the main pass first
                assert least == min(seconds) <= row[key][p]
    ratios = [r["critical_s_min"]["kamera"] / r["critical_s_min"]["recompute"] for r in result["steps"]]
    assert result["kamera"]["critical_over_recompute_max"] == max(ratios)
    single = [r["critical_s"]["kamera"] / r["critical_s"]["recompute"] for r in result["steps"]]
    assert result["kamera"]["critical_over_recompute_max_single"] == max(single)
    prefix = [r["critical_s_min"]["prefix"] / r["critical_s_min"]["recompute"] for r in result["steps"]]
    assert result["prefix"]["critical_over_recompute_max"] == max(prefix)


def test_ttft_ratios_from_the_minima(result) -> None:
    """The ``_min`` ratios read each step's least TTFT; the keys without it, the main pass's."""
    steps = result["steps"]

    def ratio(key: str, p: str, rows: list) -> float:
        return sum(r[key][p] for r in rows) / sum(r[key]["prefix"] for r in rows)

    assert result["kamera_ttft_over_prefix_min"] == pytest.approx(ratio("ttft_s_min", "kamera", steps))
    assert result["kamera_ttft_over_prefix"] == pytest.approx(ratio("ttft_s", "kamera", steps))
    slides = [r for r in steps if r["kind"] == "slide"]
    assert result["kamera_ttft_over_prefix_by_kind_min"]["slide"] == pytest.approx(
        ratio("ttft_s_min", "kamera", slides)
    )
    floor = sum(r["ttft_floor_s"] for r in slides)
    got = result["kamera"]["ttft_over_floor_by_kind_min"]["slide"]
    assert got == pytest.approx(sum(r["ttft_s_min"]["kamera"] for r in slides) / floor)
    assert got <= result["kamera"]["ttft_over_floor_by_kind"]["slide"]


def test_one_pass_reports_the_same_keys() -> None:
    steps = build_trace(steps=2)
    res = run_trace(
        tiny_chat_engine(), steps, ("recompute", "kamera"), answer_tokens=1, act_seconds=60.0, arms=ACT_ARMS
    )
    assert res["repeat"] == 1
    for row in res["steps"]:
        assert row["critical_s_min"] == row["critical_s"] and row["ttft_s_min"] == row["ttft_s"]
    kam = res["kamera"]
    assert kam["critical_over_recompute_max"] == kam["critical_over_recompute_max_single"]


def test_a_pass_that_ran_different_work_is_left_out_of_the_minima(monkeypatch, trace) -> None:
    """The second pass gets no idle time: kamera re-conditions survivors on the critical path, so its
    critical work differs from the first pass's at some steps; those timings are left out of the minima
    (which then are the first pass's there) and listed."""
    original = bench.repeat_pass

    def without_idle(engine, steps, policies, answer_tokens, act_seconds, arms, label=""):
        return original(engine, steps, policies, answer_tokens, None, arms, label)

    monkeypatch.setattr(bench, "repeat_pass", without_idle)
    res = run_trace(
        tiny_chat_engine(), trace, ("recompute", "kamera"), answer_tokens=1, act_seconds=60.0, arms=ACT_ARMS, repeat=2
    )
    differs = res["repeat_work_differs"]
    assert differs and all(d["pass"] == 2 and d["work"] != d["first_work"] for d in differs)
    for d in differs:
        row = res["steps"][d["step"]]
        assert row["critical_s_passes"][d["policy"]] == [row["critical_s"][d["policy"]]]
        assert row["critical_s_min"][d["policy"]] == row["critical_s"][d["policy"]]
        assert row["ttft_s_passes"][d["policy"]] == [row["ttft_s"][d["policy"]]]


def test_the_work_check_names_the_pass_policy_and_step() -> None:
    first = {"recompute": [(1, 100), (1, 120)], "kamera": [(1, 100), (1, 40)]}
    assert work_differs(first, {p: list(w) for p, w in first.items()}, 2) == []
    got = work_differs(first, {"recompute": first["recompute"], "kamera": [(1, 100), (2, 60)]}, 3)
    assert got == [{"pass": 3, "policy": "kamera", "step": 1, "work": [2, 60], "first_work": [1, 40]}]


def test_repeat_must_be_positive(trace) -> None:
    with pytest.raises(InvalidInputError):
        run_trace(tiny_chat_engine(), trace, ("recompute", "kamera"), repeat=0)


def test_the_repeat_flag_only_with_the_window_and_serve_benches(capsys) -> None:
    from kamera_sdk.cli import main

    assert main(["bench", "operator", "--repeat", "3", "--model", "/nonexistent/model"]) == 2  # before any load
    assert "--repeat goes with the window and serve benchmarks" in capsys.readouterr().err
    assert main(["bench", "serve", "--act-seconds", "1", "--model", "/nonexistent/model"]) == 2
    assert "--act-seconds goes with the window benchmark" in capsys.readouterr().err

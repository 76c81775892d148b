"""``kamera bench serve`` on a tiny engine: the fixed JSON keys, both arms answer every question, and the
batched arm really batches (tiny random model behind the default tokenizer, real uvicorn on loopback)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kamera_engine import InvalidInputError
from kamera_sdk.bench import serve
from tests.conftest import tiny_chat_engine


def test_bench_serve_reports_both_arms_and_the_ceiling(tmp_path: Path) -> None:
    result = serve.run(tiny_chat_engine(), quick=True, counts=(1, 3))
    assert set(result["sessions"]) == {"1", "3"} and set(result["throughput_ratio"]) == {"1", "3"}
    for n in ("1", "3"):
        for mode in ("batched", "sequential"):
            arm = result["sessions"][n][mode]
            assert arm["errors"] == [] and arm["answers"] == int(n) * result["rounds"]
            assert arm["tokens_per_s"] > 0 and arm["p95_s"] >= arm["p50_s"] > 0
        ratio = result["sessions"][n]["batched"]["tokens_per_s"] / result["sessions"][n]["sequential"]["tokens_per_s"]
        assert abs(result["throughput_ratio"][n] - ratio) < 1e-9
        # the drain left out: the run up to the first session's end, every arm's sessions all finished
        both = [result["sessions"][n][mode] for mode in ("batched", "sequential")]
        assert all(0 < arm["all_running_s"] <= arm["elapsed_s"] and arm["all_running_tokens_per_s"] > 0 for arm in both)
        if n == "1":  # one session: its end is the run's end, and every piece of every answer arrived before it
            for arm in both:
                assert arm["all_running_s"] == arm["elapsed_s"]
                assert arm["all_running_tokens_per_s"] == pytest.approx(arm["tokens_per_s"])
        assert (
            result["all_running_ratio"][n] == both[0]["all_running_tokens_per_s"] / both[1]["all_running_tokens_per_s"]
        )
    assert result["sessions"]["3"]["batched"]["batch_max"] >= 2
    assert result["repeat"] == 1
    assert result["machine"]["cpu_capability"] in ("DEFAULT", "NO AVX", "AVX2", "AVX512", "SVE256", "ZVECTOR")
    assert result["machine"]["cpus"] >= 1 and result["machine"]["cpu"]
    if "cpu_id" in result["machine"]:  # x86 Linux: the family and model numbers tell two same-named parts apart
        assert re.fullmatch(r"family \d+ model \d+", result["machine"]["cpu_id"])
    assert [r["throughput_ratio"] for r in result["runs"]["3"]] == [result["throughput_ratio"]["3"]]
    ceiling = result["ceiling"]
    assert set(ceiling["decode_step_s"]) == {"1", "8", "32"} and ceiling["decode_speedup"]["1"] == 1.0
    # the round ceiling: the loop's own forwards (a page's compile, the ask's forward behind the anchor and
    # two pages), for every count above one, read against the measured ratio
    shape = ceiling["round_shape"]
    engine = tiny_chat_engine()
    assert shape["page_tokens"] == len(engine.tokenize(serve._page(0, 3)))  # the page's compile, nothing else
    assert shape["anchor_tokens"] == len(engine.anchor_ids) and shape["ask_tokens"] > shape["page_tokens"]
    assert shape["window_tokens"] == shape["anchor_tokens"] + 2 * shape["page_tokens"]
    assert shape["answer_tokens"] >= 1
    assert set(ceiling["round_ratio"]) == set(ceiling["round_s"]) == set(ceiling["round_ratio_reached"]) == {"3"}
    seconds = ceiling["round_s"]["3"]
    assert ceiling["round_ratio"]["3"] == seconds["sequential"] / seconds["batched"] > 0
    assert ceiling["round_ratio_reached"]["3"] == result["throughput_ratio"]["3"] / ceiling["round_ratio"]["3"]
    from kamera_sdk.bench.plots import serve_plot

    (path,) = serve_plot(result, tmp_path)
    assert path.stat().st_size > 0


def test_an_arm_takes_create_app_options_and_reports_its_steps() -> None:
    """``arm(..., app_options=..., observer=...)``: the server's scheduler runs under the options given and
    every step reaches the observer (a 16-token step: answers' prompts are prefilled in chunks of at most 16)."""
    engine = tiny_chat_engine()
    log: list = []
    figures = serve.arm(engine, 2, True, 2, 4, app_options={"step_tokens": 16}, observer=log.append)
    assert figures["errors"] == [] and figures["answers"] == 4 and figures["tokens"] > 0
    assert (figures["step_tokens"], figures["max_batch_rows"]) == (16, 64)
    assert figures["peak_rss_of"] == "arm" and 0 < figures["rss_start_bytes"] <= figures["peak_rss_bytes"]
    assert sum(s.decode_rows for s in log) > 0 and sum(s.window_tokens for s in log) > 4 * 16
    assert max(s.prompt_tokens for s in log) == 16  # chunks (a prompt of the default step would run whole)
    # the stepping thread over the sessions' loops: its forwards are steps reported (others ran as the sessions
    # were opened and closed), and forwards and waits fit in the loops' time
    # (a step is counted before it is reported: the last one's report may come after the block, hence one step)
    assert 0.0 < figures["forward_s"] <= sum(s.seconds for s in log) + max(s.seconds for s in log)
    assert 0.0 <= figures["idle_s"] and figures["forward_s"] + figures["idle_s"] <= figures["elapsed_s"] + 0.25
    with pytest.raises(InvalidInputError, match="one at a time"):
        serve.arm(engine, 1, False, 1, 2, observer=log.append)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak restarts through Linux's /proc")
def test_an_arm_s_peak_rss_is_its_own_not_the_process_s() -> None:
    """256 MiB held and let go before the arm is not the arm's peak (Linux: the count starts afresh)."""
    held = bytearray(1 << 28)
    held[:: 1 << 12] = bytes(len(held) >> 12)  # every page written: resident
    before = serve.peak_rss_bytes()
    del held
    assert serve.reset_peak_rss()
    assert serve.peak_rss_bytes() < before - (1 << 27)


def test_an_arm_with_a_failed_session_does_not_measure_its_stepping_thread(monkeypatch) -> None:
    """A session that fails never ends its loop, so the loops' span has no end: no figure rather than a wrong one."""
    page = serve._page

    def failing(i: int, step: int) -> str:
        if i == 1:
            raise RuntimeError("session 1 fails")
        return page(i, step)

    monkeypatch.setattr(serve, "_page", failing)
    figures = serve.arm(tiny_chat_engine(), 2, True, 1, 4)
    assert len(figures["errors"]) == 1 and "session 1 fails" in figures["errors"][0] and figures["answers"] == 1
    assert figures["forward_s"] is None and figures["idle_s"] is None


def test_bench_serve_repeat_reports_the_median_pair_and_alternates_the_arms(monkeypatch) -> None:
    """``--repeat``: each count's arms run that many times, the first arm alternating; the pair with the median
    ratio is the one reported (its arms and ratio together), every pair under ``runs``."""
    speeds = iter([(30.0, 10.0), (28.0, 7.0), (33.0, 12.0)])  # ratios 3.0, 4.0, 2.75: the median is 3.0
    calls: list[str] = []
    current: dict[str, float] = {}

    def arm(engine, n, batch, rounds, max_new):  # the run passes no options
        mode = serve.arm_name(batch)
        if not current:
            current.update(zip(("batched", "sequential"), next(speeds), strict=True))
        calls.append(mode)
        speed = current.pop(mode)  # without the drain the batched arm is a tenth faster, the other the same
        figures = {"tokens_per_s": speed, "all_running_tokens_per_s": speed * (1.1 if batch else 1.0), "p95_s": 1.0}
        return {**figures, "answers": 0, "answer_tokens_mean": 0.0}

    monkeypatch.setattr(serve, "arm", arm)
    monkeypatch.setattr(serve, "ceiling", lambda engine: {})
    monkeypatch.setattr(serve, "round_ceiling", lambda engine, counts, answer_tokens: {"round_ratio": {}})
    engine = SimpleNamespace(name="stand-in", device="cpu")  # nothing runs on it: the arms are stand-ins
    result = serve.run(engine, quick=True, counts=(8,), repeat=3)  # type: ignore[arg-type]
    assert calls == ["batched", "sequential", "sequential", "batched", "batched", "sequential"]
    assert result["repeat"] == 3 and result["throughput_ratio"]["8"] == 3.0
    assert result["sessions"]["8"]["batched"]["tokens_per_s"] == 30.0
    assert [r["throughput_ratio"] for r in result["runs"]["8"]] == [3.0, 4.0, 2.75]
    assert [r["first"] for r in result["runs"]["8"]] == ["batched", "sequential", "batched"]
    # the reported pair's ratio without the drain, and every pair's: their own arms' figures, not the whole run's
    assert result["all_running_ratio"]["8"] == pytest.approx(3.3)
    assert [r["all_running_ratio"] for r in result["runs"]["8"]] == pytest.approx([3.3, 4.4, 3.025])
    with pytest.raises(InvalidInputError, match="repeat"):
        serve.run(engine, counts=(8,), repeat=0)  # type: ignore[arg-type]


def test_all_running_leaves_the_drain_out() -> None:
    """Tokens up to the first session's end, an answer in flight then counted for the share of its pieces
    that had arrived; zeros when a session did not finish (a failed session has no end)."""
    answers = [(4, [1.0, 2.0]), (6, [3.0, 5.0, 7.0]), (2, [9.0])]  # 4 + 4 + 0 tokens by t=5 (the cut)
    figures = serve.all_running(0.0, [5.0, 9.5], 2, answers)
    assert figures == {"all_running_s": 5.0, "all_running_tokens_per_s": 8.0 / 5.0}
    assert serve.all_running(0.0, [5.0], 2, answers) == {"all_running_s": 0.0, "all_running_tokens_per_s": 0.0}

"""The window on the real default model: single-chunk agreement for every policy, and fidelity on a
short stretch of the benchmark trace."""

from __future__ import annotations

import pytest

from kamera_engine import Engine
from kamera_sdk import POLICIES, ContextWindow
from kamera_sdk.bench.corpus import load_corpus
from kamera_sdk.bench.window import build_trace, run_trace

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_answers_like_recompute_on_one_chunk(default_engine: Engine, policy: str) -> None:
    single = load_corpus().single
    answers = {}
    for p in (policy, "recompute"):
        win = ContextWindow(default_engine, policy=p)
        win.add_text(single.text)
        answers[p] = win.generate(single.question, max_new_tokens=16)
    assert answers[policy] == answers["recompute"]
    assert answers["recompute"].strip()


def test_kamera_beats_blind_on_a_short_trace(default_engine: Engine) -> None:
    trace = build_trace(steps=5)
    result = run_trace(default_engine, trace, policies=("recompute", "blind", "kamera"), answer_tokens=8)
    assert result["recompute"]["kl_mean"] == 0.0
    assert result["kamera"]["kl_mean"] < result["blind"]["kl_mean"]
    assert result["kamera"]["kl_mean"] <= 0.02, result["kamera"]
    assert result["kamera"]["prefill_tokens"] < result["recompute"]["prefill_tokens"] / 2
    # step time counts everything spent per step: kamera's slides form the patches set aside at the last
    # use (blind forms none, so its operations are bookkeeping)
    k = result["kamera"]
    assert k["patches_formed"] > 0 and k["ops_s_mean"] > 10 * result["blind"]["ops_s_mean"]
    assert k["step_s_mean"] == pytest.approx(k["ttft_s_mean"] + k["ingest_s_mean"] + k["ops_s_mean"])
    # kamera conditions every new page exactly, so it prefills at least what the floor does
    floor = result["ttft_floor"]
    assert 0 < floor["prefill_tokens"] <= k["prefill_tokens"]
    assert all(0 < s["ttft_floor_s"] for s in result["steps"])

"""The operator bench's timing and reorder sections on the tiny engine, wherever the tests run
(``KAMERA_TEST_DEVICE``): a canonical is kept in host memory while a forward's KV is on the model's device, and on
a GPU these sections joined the two without a move (`kamera bench gpu` met the first such fault on an H200).
Token ids stand in for text: the tiny engine has no tokenizer."""

from __future__ import annotations

import pytest

from kamera_sdk.bench import operator
from kamera_sdk.bench.corpus import Probe
from tests.conftest import tiny_engine


def _ids(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 120 + 3 for i in range(n)]


def test_speed_and_bandwidth_time_on_the_models_device(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine("llama")
    monkeypatch.setattr(operator, "_text_tokens", lambda e, n: _ids(n))
    out = operator.speed(engine, lengths=(8, 16), context=16)
    assert set(out) == {"8", "16"}
    assert all(v["reprefill_s"] > 0 and v["reuse_s"] > 0 and v["patch_form_s"] > 0 for v in out.values())
    bw = operator.bandwidth(engine, n=96)
    assert bw["memcpy_gbps"] > 0 and bw["relocate_gbps"] > 0
    assert set(bw["apply_gbps_by_rank"]) == {str(r) for r in operator.RANKS}
    assert bw["kv_bytes_per_token"] > 0


def test_reorder_arms_join_a_forwards_head_with_a_placed_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine("llama")
    monkeypatch.setattr(engine, "tokenize", lambda text: _ids(4 + len(text) % 5, salt=len(text)))
    monkeypatch.setattr(engine, "prompt_ids", lambda text: _ids(3, salt=1))
    probes = [Probe(chunks=[f"page {i} " * (i + 1) for i in range(3)], question="q", answer="a") for _ in range(2)]
    out = operator.reorder_arms(engine, probes, rank=4)
    assert out["rank"] == 4 and set(out["kl"]) == {"exact", "transfer", "orbit"}
    assert out["kl"]["exact"] <= out["blind_kl"] + 1e-6  # the ordering's own patch is at least as good as none

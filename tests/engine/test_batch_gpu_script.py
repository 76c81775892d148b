"""``scripts/batch_gpu.py`` measures on a GPU only, but its parts run anywhere: on a tiny float32 engine on the
CPU they must run, and their batched answers must equal the one-at-a-time ones (so the script cannot rot
between GPU sessions unnoticed)."""

from __future__ import annotations

from kamera_engine import batch
from tests.conftest import script, tiny_engine


def test_batch_gpu_parts_run_on_a_cpu_and_batched_answers_equal_alone() -> None:
    bg = script("batch_gpu")
    engine = tiny_engine("llama")
    served = bg.serve(engine, 3, 20, 6, 5)
    assert served["tokens"] == 15 and served["same_tokens"] == 3
    kept = batch.KEY_BUCKET_DEVICES
    with bg._exact_key_lengths():
        assert batch.KEY_BUCKET_DEVICES == frozenset()
        exact = bg.serve(engine, 3, 20, 6, 5)
    assert batch.KEY_BUCKET_DEVICES is kept
    assert exact["same_tokens"] == 3
    ab = bg.served_ab(engine, 3, 2, 20, 6, 5)
    assert {k: len(v) for k, v in ab["tokens_per_s"].items()} == {"bucketed": 2, "exact": 2}
    assert all(x > 0 for v in ab["tokens_per_s"].values() for x in v)
    steps = bg.decode_steps(engine, 20, 1)
    assert set(steps["decode_step_ms"]) == {"1", "8", "32", "single"}
    threads = bg.driver_threads(engine, 2, 20, 6, 3)
    assert [len(threads[k]) for k in ("calling_thread_s", "fresh_thread_s", "one_new_thread_s")] == [3, 2, 3]

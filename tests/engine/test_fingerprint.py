"""Fingerprints: the same on every thread count, and they change with the weights and the tokenizer."""

from __future__ import annotations

import torch

from kamera_engine import Engine
from kamera_engine.fingerprint import SAMPLE_THRESHOLD, _tensor_bytes, processor_digest
from kamera_engine.vision.tiny import tiny_tokenizer
from tests.conftest import ANCHOR, tiny_model


def test_a_large_tensor_digests_the_same_on_any_thread_count() -> None:
    t = torch.randn(SAMPLE_THRESHOLD + 12345, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    digests = set()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            digests.add(_tensor_bytes(t))
            digests.add(_tensor_bytes(t.to(torch.bfloat16)) + b"bf16")
    finally:
        torch.set_num_threads(threads)
    assert len(digests) == 2  # one per dtype
    u = t.clone()
    u[7] += 1e-3  # off the strided sample: the integer checksum still sees it
    assert _tensor_bytes(u) != _tensor_bytes(t)


def test_the_tokenizer_is_part_of_the_fingerprint() -> None:
    model = tiny_model("llama")
    tok = tiny_tokenizer()
    other = tiny_tokenizer()
    other.add_tokens(["<extra>"])
    a, b, c = (Engine(model, t, anchor_ids=ANCHOR) for t in (tok, tiny_tokenizer(), other))
    assert a.fingerprint == b.fingerprint  # the same model and tokenizer, loaded twice
    assert a.fingerprint != c.fingerprint
    assert processor_digest(None) == "none" and Engine(model, None, anchor_ids=ANCHOR).fingerprint != a.fingerprint

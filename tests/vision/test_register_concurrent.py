"""Windows of one engine register media concurrently (each window's gate is its own): every image gets its
own range of virtual ids, and each of those ids maps back to that image's feature rows."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from kamera_engine.vision.mechanics import noise_image
from tests.vision.conftest import FAMILIES, vlm

THREADS = 6


def test_concurrent_registrations_get_distinct_ids(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = vlm(FAMILIES[0], tmp_path_factory.getbasetemp() / "vlm")
    offsets = e.family.chunk_offsets

    def slow_offsets(media):  # widen the window between reading the next free id and publishing the entry
        time.sleep(0.05)
        return offsets(media)

    monkeypatch.setattr(e.family, "chunk_offsets", slow_offsets)
    images = {f"concurrent-{i}": noise_image(500 + i, (60 + 8 * i, 40)) for i in range(THREADS)}
    start = threading.Barrier(THREADS)
    entries: dict[str, object] = {}
    errors: list[BaseException] = []

    def register(digest: str) -> None:
        try:
            start.wait()
            entries[digest] = e.register_image(images[digest], digest)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=register, args=(d,)) for d in images]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    spans = sorted((entry.base, entry.base + entry.rows) for entry in entries.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans)), spans
    for digest, entry in entries.items():
        assert e.media_entry(digest) is entry
        virtual = torch.tensor([t for t in entry.token_ids if t >= e.vocab_size])
        assert virtual.tolist() == list(range(entry.base, entry.base + entry.rows))
        rows, _, _ = e._lookup(virtual)
        own = e.vision_cache.get(entry.cache_key).embeds.to(rows.dtype)
        assert torch.equal(rows, own), digest

"""The vision cache's memory bound: what it pushes out goes to disk and comes back byte for byte, the tower never
runs twice for one picture, and an engine keeps no pixels once the tower has run."""

from __future__ import annotations

import pytest
import torch

from kamera_engine import InvalidInputError
from kamera_engine.vision.base import Features
from kamera_engine.vision.cache import VisionCache
from kamera_engine.vision.mechanics import noise_image, tiny_engine

ROW_BYTES = 8 * 4  # one row of 8 float32


def _feats(seed: int, rows: int = 4, deep: bool = False) -> Features:
    g = torch.Generator().manual_seed(seed)
    return Features(torch.randn(rows, 8, generator=g), torch.randn(2, rows, 8, generator=g) if deep else None)


def test_memory_stays_within_the_bound_and_spilled_entries_come_back_exact() -> None:
    cache = VisionCache("fp", max_memory_bytes=2 * 4 * ROW_BYTES)  # room for two 4-row entries
    made = {f"k{i}": _feats(i, deep=i == 0) for i in range(5)}
    for key, feats in made.items():
        cache.put(key, feats)
        assert cache.stats.bytes <= 2 * 4 * ROW_BYTES or cache.stats.entries == 1
    assert cache.stats.entries == 1 + (made["k4"].nbytes <= 4 * ROW_BYTES)
    assert cache.stats.spilled == 5 - cache.stats.entries
    for key, feats in made.items():  # every entry is still there: from memory or loaded back from disk
        assert key in cache
        got = cache.get(key)
        assert got is not None and torch.equal(got.embeds, feats.embeds)
        assert (got.deepstack is None) == (feats.deepstack is None)
        if feats.deepstack is not None:
            assert torch.equal(got.deepstack, feats.deepstack)
        assert cache.stats.bytes <= 2 * 4 * ROW_BYTES or cache.stats.entries == 1
    assert cache.stats.disk_hits >= 3 and cache.stats.tower_runs == 0


def test_the_newest_entry_stays_even_past_the_bound() -> None:
    cache = VisionCache("fp", max_memory_bytes=ROW_BYTES)
    cache.put("big", _feats(1, rows=16))
    assert cache.stats.entries == 1 and cache.stats.spilled == 0
    cache.put("next", _feats(2, rows=16))
    assert cache.stats.entries == 1 and cache.stats.spilled == 1 and "big" in cache


def test_least_recently_used_goes_first() -> None:
    cache = VisionCache("fp", max_memory_bytes=2 * 4 * ROW_BYTES)
    cache.put("a", _feats(1))
    cache.put("b", _feats(2))
    cache.get("a")  # a is now the most recent
    cache.put("c", _feats(3))
    hits = cache.stats.hits
    cache.get("a")
    assert cache.stats.hits == hits + 1  # a stayed in memory; b went to disk
    disk = cache.stats.disk_hits
    cache.get("b")
    assert cache.stats.disk_hits == disk + 1


def test_with_a_directory_entries_are_written_once_and_the_bound_moves_none_away(tmp_path) -> None:
    cache = VisionCache("fp", tmp_path / "vc", max_memory_bytes=4 * ROW_BYTES)
    cache.put("a", _feats(1))
    cache.put("b", _feats(2))
    assert sorted(p.name for p in (tmp_path / "vc").iterdir()) == ["a.safetensors", "b.safetensors"]
    assert cache.stats.spilled == 1 and cache.stats.entries == 1
    got = cache.get("a")
    assert got is not None and torch.equal(got.embeds, _feats(1).embeds)


def test_no_bound_keeps_everything_in_memory() -> None:
    cache = VisionCache("fp", max_memory_bytes=None)
    for i in range(10):
        cache.put(f"k{i}", _feats(i))
    assert cache.stats.entries == 10 and cache.stats.spilled == 0 and cache.stats.max_memory_bytes is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1GB"])
def test_a_bad_bound_is_refused(bad) -> None:
    with pytest.raises(InvalidInputError, match="max_memory_bytes"):
        VisionCache("fp", max_memory_bytes=bad)


def test_a_removed_file_is_a_miss() -> None:
    cache = VisionCache("fp", max_memory_bytes=4 * ROW_BYTES)
    cache.put("a", _feats(1))
    cache.put("b", _feats(2))  # a goes to disk
    path = cache.path_of("a")
    assert path is not None and path.is_file()
    path.unlink()
    assert "a" not in cache and cache.get("a") is None


def test_a_bounded_engine_gives_the_same_forwards_and_runs_the_tower_once_per_picture(tmp_path_factory) -> None:
    """Three pictures through an engine whose memory tier holds one: forwards equal an unbounded engine's bit for
    bit, the tower ran three times, and a picture whose file went missing is refused by name, then made again under
    its own ids when it is added again."""
    d = str(tmp_path_factory.getbasetemp() / "vlm-bound")
    free = tiny_engine("qwen2_vl", d, vision_memory_bytes=None)
    tight = tiny_engine("qwen2_vl", d, vision_memory_bytes=1)
    pics = [noise_image(90 + i) for i in range(3)]
    a = [free.register_image(p, f"bound-{i}") for i, p in enumerate(pics)]
    b = [tight.register_image(p, f"bound-{i}") for i, p in enumerate(pics)]
    assert tight.tower_runs == 3 and tight.vision_cache.stats.entries == 1 and tight.vision_cache.stats.spilled == 2

    def logits(e, entries) -> torch.Tensor:
        ids = e.anchor_ids + [t for x in entries for t in x.token_ids]
        return e.forward(ids, None, 0).logits

    want = logits(free, a)
    assert torch.equal(logits(tight, b), want)
    assert tight.tower_runs == 3 and tight.vision_cache.stats.disk_hits >= 2
    assert tight.register_image(pics[0], "bound-0") is b[0] and tight.tower_runs == 3

    tight.vision_cache.clear_memory()
    path = tight.vision_cache.path_of(b[1].cache_key)
    assert path is not None
    path.unlink()
    with pytest.raises(InvalidInputError, match="add the image again"):
        logits(tight, b)
    again = tight.register_image(pics[1], "bound-1")
    assert again is b[1] and tight.tower_runs == 4
    assert torch.equal(logits(tight, b), want)

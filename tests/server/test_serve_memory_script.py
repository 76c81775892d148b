"""``scripts/serve_memory.py``'s census of live tensors: each storage counted once, under its largest tensor's
shape, grouped by size and shape."""

from __future__ import annotations

import torch

from tests.conftest import script as load_script


def test_the_census_counts_each_storage_once() -> None:
    script = load_script("serve_memory")
    shape = [7, 1009, 13]  # 367,276 bytes of float32: 0.4 MB, a shape no other live tensor has
    before = [g for g in script.census(top=None)["groups"] if g["shape"] == shape]
    held = [torch.zeros(*shape) for _ in range(3)]
    views = [t[:, :5] for t in held] + [t[1] for t in held]  # views share their tensor's storage
    after = script.census(top=None)
    group = [g for g in after["groups"] if g["shape"] == shape]
    assert not before
    assert group == [{"mb_each": 0.4, "shape": shape, "count": 3, "gb": 0.4 * 3 / 1e3}]
    assert not [g for g in after["groups"] if g["shape"] in ([7, 5, 13], [1009, 13])]  # the views: not again
    assert after["tensor_gb"] >= 3 * 7 * 1009 * 13 * 4 / 1e9
    assert after["rss_gb"] > 0 and after["threads"] >= 1
    del held, views

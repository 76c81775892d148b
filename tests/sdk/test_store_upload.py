"""Entries loaded from the store reach the engine's device through ``upload`` (pinned memory and a side
CUDA stream on a GPU): on a CPU the loaded tensors are used as they are, nothing is pinned, and a window
served from the store holds the bits of the window that computed them."""

from __future__ import annotations

import pytest
import torch

import kamera_engine.window_buffer as wb
import kamera_sdk.persistence as persistence
from kamera_engine import KV, Engine
from kamera_sdk import ContextWindow
from kamera_sdk.store import open_store
from tests.conftest import ANCHOR, random_ids, tiny_model

PROMPT = [9, 10, 11]


def _trace(win: ContextWindow) -> list[torch.Tensor]:
    ids = [win.add(random_ids(9 + i, seed=800 + i)) for i in range(3)]
    out = [win.next_token_logprobs(PROMPT)]
    win.reorder(list(reversed(ids)))
    out.append(win.next_token_logprobs(PROMPT))
    return out


def test_store_loads_go_through_upload(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(tiny_model("llama", 3), None, name="tiny-llama", anchor_ids=ANCHOR)
    calls: dict[str, list] = {"kv": [], "tensors": [], "pinned": []}
    upload, upload_tensors, pinned = persistence.upload, persistence.upload_tensors, wb.pinned_for_upload

    def spy_upload(kv: KV, device, stream=None) -> KV:
        out = upload(kv, device, stream)
        calls["kv"].append((kv, device, out))
        return out

    def spy_tensors(tensors, device, stream=None):
        out = upload_tensors(tensors, device, stream)
        calls["tensors"].append((tensors, device, out))
        return out

    def spy_pinned(t: torch.Tensor) -> torch.Tensor:
        calls["pinned"].append(t)
        return pinned(t)

    monkeypatch.setattr(persistence, "upload", spy_upload)
    monkeypatch.setattr(persistence, "upload_tensors", spy_tensors)
    monkeypatch.setattr(wb, "pinned_for_upload", spy_pinned)
    with open_store(tmp_path) as store:
        first_win = ContextWindow(engine, policy="kamera", store=store)
        first = _trace(first_win)
        first_win.close()  # its patches formed and written
        assert not calls["kv"] and not calls["tensors"]  # nothing was loaded: everything computed
        second_win = ContextWindow(engine, policy="kamera", store=store)
        second = _trace(second_win)
    st = second_win.stats()
    assert st.canonicals_reused > 0 and st.canonicals_computed == 0
    assert len(calls["kv"]) == st.canonicals_reused  # every loaded canonical went through it
    assert calls["tensors"] and all("k_u" in t for t, _, _ in calls["tensors"])  # and every loaded patch
    on_cpu = engine.device.type == "cpu"
    for kv, device, out in calls["kv"]:
        assert torch.device(device) == engine.device
        assert out is kv if on_cpu else out.keys.device == engine.device  # on a CPU used as loaded, not copied
    for tensors, _, out in calls["tensors"]:
        # on a GPU the factors are uploaded; integer tensors (layer indices) stay on the host, where they are read
        want = {n: engine.device if t.is_floating_point() else torch.device("cpu") for n, t in tensors.items()}
        assert all(out[n] is t if on_cpu else out[n].device == want[n] for n, t in tensors.items())
    assert not on_cpu or not calls["pinned"]  # nothing is pinned for a CPU
    for cid in first_win.chunks:  # the canonicals served from the store are the bits the first window computed
        a, b = first_win.chunk(cid).canonical, second_win.chunk(cid).canonical
        assert a is not None and b is not None and a is not b
        assert torch.equal(a.keys.cpu(), b.keys.cpu()) and torch.equal(a.values.cpu(), b.values.cpu())
    assert len(first) == len(second)


def test_upload_moves_floating_tensors_only() -> None:
    """To another device (``meta`` here, the path CUDA shares but for pinning and the stream), keys, values
    and patch factors move; integer tensors (layer indices) stay on the host where they are read."""
    kv = KV(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4), torch.arange(3), None)
    moved = wb.upload(kv, "meta")
    assert moved.keys.device.type == "meta" and moved.values.device.type == "meta"
    assert moved.positions is kv.positions
    layers = torch.tensor([0, 1])
    out = wb.upload_tensors({"k_u": torch.randn(2, 3), "layers": layers}, "meta")
    assert out["k_u"].device.type == "meta" and out["layers"] is layers
    assert wb.upload(kv, "cpu") is kv

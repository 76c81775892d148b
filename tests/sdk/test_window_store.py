"""A window over a persistent store: a new process reuses canonicals and patches with zero forwards;
corrupted or foreign entries are refused, counted and recomputed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from kamera_sdk import ContextWindow
from kamera_sdk.store import DiskBackend
from tests.conftest import random_ids, tiny_engine

PROMPT = [9, 10, 11]
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {root!r})
    from kamera_sdk import ContextWindow
    from tests.conftest import random_ids, tiny_engine
    engine = tiny_engine("llama", seed=21)
    win = ContextWindow(engine, store={store!r})
    for i in range(3):
        win.add(random_ids(12, seed=900 + i))
    lp = win.next_token_logprobs([9, 10, 11])
    win.close()
    st = win.stats()
    print(json.dumps({{"forwards": st.forwards, "ingest": st.ingest_tokens, "computed": st.canonicals_computed,
                      "loads": st.store_loads, "lp": lp[:8].tolist()}}))
    """
)


def _run(store: Path) -> dict:
    code = SCRIPT.format(root=str(ROOT), store=str(store))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_new_process_reuses_canonicals_with_zero_canonical_forwards(tmp_path: Path) -> None:
    first = _run(tmp_path / "store")
    assert first["computed"] == 3 and first["ingest"] == 36
    second = _run(tmp_path / "store")
    assert second["computed"] == 0 and second["ingest"] == 0  # no canonical forward at all
    assert second["loads"] >= 3
    # the patches formed by the first process serve the second: no conditioned forward either
    assert second["forwards"] == 1  # only the prompt
    assert max(abs(a - b) for a, b in zip(first["lp"], second["lp"], strict=True)) < 1e-3


def test_a_corrupted_canonical_is_refused_counted_and_recomputed(tmp_path: Path) -> None:
    engine = tiny_engine("llama", seed=22)
    ids = random_ids(12, seed=901)
    with ContextWindow(engine, policy="blind", store=tmp_path / "s") as win:
        cid = win.add(ids)
        ref = win.next_token_logprobs(PROMPT)
    win.store.close()
    backend = DiskBackend(tmp_path / "s")
    files = [backend.path_for(k) for k in backend.keys()]
    backend.close()
    for f in files:
        data = bytearray(f.read_bytes())
        data[-50] ^= 0xFF  # flip a byte inside the tensor data
        f.write_bytes(bytes(data))
    win2 = ContextWindow(engine, policy="blind", store=tmp_path / "s")
    assert win2.add(ids) == cid
    st = win2.stats()
    assert st.canonicals_computed == 1 and st.store_load_failures >= 1
    assert torch.allclose(win2.next_token_logprobs(PROMPT), ref, atol=1e-5)


def test_another_models_entries_are_never_served(tmp_path: Path) -> None:
    ids = random_ids(12, seed=902)
    with ContextWindow(tiny_engine("llama", seed=23), policy="blind", store=tmp_path / "s") as win:
        win.add(ids)
    other = ContextWindow(tiny_engine("llama", seed=24), policy="blind", store=tmp_path / "s")
    other.add(ids)
    assert other.stats().canonicals_computed == 1  # a different fingerprint is a different key


def test_chunks_in_a_live_window_or_fork_are_pinned(tmp_path: Path) -> None:
    engine = tiny_engine("llama", seed=25)
    win = ContextWindow(engine, policy="blind", store=tmp_path / "s")
    a = win.add(random_ids(8, seed=910))
    b = win.add(random_ids(8, seed=911))
    key = win._persistence.canonical_key(win.chunk(a))
    assert win.store.memory.pins(key) == 1
    child = win.fork()
    assert win.store.memory.pins(key) == 2
    child.slide(1)
    assert win.store.memory.pins(key) == 1
    win.evict(a)
    assert win.store.memory.pins(key) == 0
    assert win.store.memory.pins(win._persistence.canonical_key(win.chunk(b))) == 2


def test_close_releases_the_pins(tmp_path: Path) -> None:
    engine = tiny_engine("llama", seed=25)
    win = ContextWindow(engine, policy="blind", store=tmp_path / "s")
    a = win.add(random_ids(8, seed=912))
    child = win.fork()
    key = win._persistence.canonical_key(win.chunk(a))
    assert win.store.memory.pins(key) == 2
    child.close()
    win.close()
    assert win.store.memory.pins(key) == 0 and win.store.memory.pinned_bytes == 0
    win.slide(1)  # a closed window still works; it holds no pins
    win.close()  # and closing twice is harmless


def test_every_patch_of_a_chunk_is_indexed(tmp_path: Path) -> None:
    from kamera_sdk import WindowConfig

    engine = tiny_engine("llama", seed=26)
    cfg = WindowConfig(reorder_patch="exact")
    with ContextWindow(engine, config=cfg, store=tmp_path / "s") as win:
        a, b, c = (win.add(random_ids(8, seed=920 + i)) for i in range(3))
        win.next_token_logprobs(PROMPT)
        win.reorder([b, a, c])  # c behind the same set in another order: an exact patch of its own
        win.next_token_logprobs(PROMPT)
        win.flush()
        formed = {p.antecedent for p in win.chunk(c).patches}
    assert formed == {(a, b), (b, a)}
    again = ContextWindow(engine, config=cfg, store=tmp_path / "s")
    for i in range(3):
        again.add(random_ids(8, seed=920 + i))
    assert {p.antecedent for p in again.chunk(c).patches} == formed  # both found by a new window


def test_patches_two_windows_form_at_once_are_all_found(tmp_path: Path) -> None:
    """Two windows on one store directory (each its own ChunkStore, as two processes have) form different
    patches of one chunk after both had read its earlier one: a new window finds all three. A per-chunk
    index rewritten by each lost the first writer's patch (the second rewrote the index it had read)."""
    from kamera_sdk import WindowConfig

    engine = tiny_engine("llama", seed=27)
    cfg = WindowConfig(reorder_patch="exact")
    path = tmp_path / "s"
    texts = [random_ids(8, seed=930 + i) for i in range(3)]
    with ContextWindow(engine, config=cfg, store=path) as first:
        a, b, c = (first.add(t) for t in texts)
        first.next_token_logprobs(PROMPT)  # c on (a, b)
        first.flush()
    one, two = ContextWindow(engine, config=cfg, store=path), ContextWindow(engine, config=cfg, store=path)
    for win in (one, two):
        for t in texts:
            win.add(t)  # each has read c's stored patches now
    one.reorder([b, a, c])  # c on (b, a)
    two.reorder([a, c, b])  # c on (a)
    for win in (one, two):
        win.next_token_logprobs(PROMPT)
        win.flush()
        win.close()
    again = ContextWindow(engine, config=cfg, store=path)
    for t in texts:
        again.add(t)
    assert {p.antecedent for p in again.chunk(c).patches} == {(a, b), (b, a), (a,)}


def test_an_entry_that_does_not_cover_the_chunk_is_refused(tmp_path: Path) -> None:
    from kamera_sdk.chunks import Chunk

    engine = tiny_engine("llama", seed=27)
    ids = random_ids(12, seed=930)
    probe = ContextWindow(engine, policy="blind")
    cid = probe.add(ids)
    with ContextWindow(engine, policy="blind", store=tmp_path / "s") as win:
        # a canonical of other tokens stored under this chunk's key (another tokenizer's split of the text)
        win._persistence.save_canonical(Chunk(cid, "tokens", ids), engine.canonical(random_ids(9, seed=931)))
        win.store.flush()
    fresh = ContextWindow(engine, policy="blind", store=tmp_path / "s")
    assert fresh.add(ids) == cid
    st = fresh.stats()
    assert st.canonicals_computed == 1 and st.store_load_failures >= 1
    assert torch.equal(fresh.next_token_logprobs(PROMPT), probe.next_token_logprobs(PROMPT))


def test_patches_formed_under_other_settings_are_not_reused(tmp_path: Path) -> None:
    from kamera_sdk import Source, WindowConfig

    engine = tiny_engine("llama", seed=28)
    deep = WindowConfig(patch_layers="deep")
    with ContextWindow(engine, config=deep, store=tmp_path / "s") as win:
        ids = [win.add(random_ids(8, seed=940 + i)) for i in range(2)]
        win.next_token_logprobs(PROMPT)
        win.evict(ids[1])
        win.recall(ids[1])
        assert win.plan().slots[1].source is Source.PATCH  # its own patch serves a recall on the same context
    full = ContextWindow(engine, store=tmp_path / "s")
    for i in range(2):
        full.add(random_ids(8, seed=940 + i))
    assert [p.patch.layers for p in full.chunk(ids[1]).patches] == [(1,)]  # loaded: formed on the deep half
    assert full.plan().slots[1].source is Source.FORWARD  # but all-layer windows form their own


def test_canonicals_are_keyed_by_how_their_keys_were_made(tmp_path: Path) -> None:
    """An un-rotated canonical (an older store, or a model without pre-RoPE capture) is never read by an
    engine that compiles pre-RoPE ones (a placement rotates those the model's way), nor the other way."""
    engine = tiny_engine("llama", seed=27)
    assert engine.canonical_source == "pre_rope"
    ids = random_ids(12, seed=930)
    engine.canonical_source = "unrotation"
    with ContextWindow(engine, policy="blind", store=tmp_path / "s") as win:
        win.add(ids)
        win.flush()
    engine.canonical_source = "pre_rope"
    win = ContextWindow(engine, policy="blind", store=tmp_path / "s")
    c = win.add(ids)
    st = win.stats()
    assert (st.canonicals_computed, st.store_loads) == (1, 0)  # the un-rotated entry is not this engine's
    got = win.chunk(c).canonical
    assert got is not None and torch.equal(got.keys, engine.canonical(ids).keys)
    win.close()
    engine.canonical_source = "unrotation"
    again = ContextWindow(engine, policy="blind", store=tmp_path / "s")
    again.add(ids)
    assert (again.stats().canonicals_computed, again.stats().store_loads) == (0, 1)  # its own entry is found
    again.close()

"""The window's seams: vision through ``admit`` (no import cycle), slot serving in the executor, a branch's
state as data, stats derived from the mappings and the engine's counters, patch kinds as an enum."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import pytest

import kamera_sdk
from kamera_sdk import POLICIES, ContextWindow, InvalidInputError, Source, WindowConfig, WindowStats
from kamera_sdk.chunks import Chunk, PatchKind, StoredPatch, antecedent_signature, content_id, sequence_digest
from kamera_sdk.policies.selective import SelectivePolicy
from kamera_sdk.stats import Work, WorkCount
from kamera_sdk.store import EntryKind
from tests.conftest import random_ids, tiny_engine

PROMPT = [9, 10, 11]
SDK = Path(kamera_sdk.__file__).parent


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", seed=5)


def _imports(module: Path) -> set[str]:
    """Every module ``module`` imports, anywhere in it (inside functions and ``TYPE_CHECKING`` too),
    relative imports resolved against ``kamera_sdk``."""
    found = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "kamera_sdk" if node.level == 1 else ""
            name = ".".join(p for p in (base, node.module or "") if p)
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
    return found


def test_vision_never_imports_the_window() -> None:
    """One direction only: the window imports vision; vision reaches the window through ``WindowSeam``."""
    assert "kamera_sdk.vision" in _imports(SDK / "window.py")
    for module in ("vision.py", "window_state.py", "executor.py", "metering.py"):
        assert not {m for m in _imports(SDK / module) if m.startswith("kamera_sdk.window")} - {
            "kamera_sdk.window_state"
        }, module


def test_vision_uses_no_private_name_of_the_window() -> None:
    source = (SDK / "vision.py").read_text()
    for name in ("_table", "_stats", "_refs", "_append_known", "_add", "_check_fits", "_state"):
        assert f"win.{name}" not in source


def test_the_window_never_checks_a_policy_name() -> None:
    tree = ast.parse((SDK / "window.py").read_text())
    compared = [n for n in ast.walk(tree) if isinstance(n, ast.Compare) and "policy.name" in ast.unparse(n)]
    assert compared == []


def test_policies_declare_what_they_serve() -> None:
    serving = sorted(name for name, cls in POLICIES.items() if cls.serves_images)
    assert serving == ["blind", "kamera", "prefix", "prefix_idle", "recompute"]
    assert [name for name, cls in POLICIES.items() if cls.forms_orbit_patches] == ["kamera"]


def test_admit_checks_every_chunk_before_adding_any(engine) -> None:
    win = ContextWindow(engine, budget_tokens=20)
    first = win.add(random_ids(8, seed=700))
    ok = Chunk(content_id("tokens", b"ok"), "tokens", random_ids(10, seed=701))
    big = Chunk(content_id("tokens", b"big"), "tokens", random_ids(21, seed=702))
    forwards = win.stats().forwards
    with pytest.raises(InvalidInputError, match="does not fit"):
        win.admit(ok, big)
    assert win.chunks == [first] and win.known(ok.id) is None and win.stats().forwards == forwards
    with pytest.raises(InvalidInputError, match="Chunk objects"):
        win.admit("not a chunk")  # type: ignore[arg-type]
    assert win.admit(ok) == [ok.id] and win.chunks == [first, ok.id]
    again = Chunk(ok.id, "tokens", list(ok.token_ids))
    assert win.admit(again) == [ok.id] and win.known(ok.id) is ok  # known content: the table's entry stays


def test_a_fork_copies_the_branch_state_and_shares_the_table(engine) -> None:
    win = ContextWindow(engine)
    ids = [win.add(random_ids(8, seed=710 + i)) for i in range(3)]
    win.next_token_logprobs(PROMPT)
    child = win.fork()
    assert child.slots == win.slots and child.known(ids[0]) is win.known(ids[0])
    child.slide(1)
    child.add(random_ids(8, seed=719))
    assert win.chunks == ids and win.evicted == [] and child.evicted == [ids[0]]
    assert child.graph is not win.graph and child.stats().forwards == 1  # the fork's own work only


def test_forwards_and_tokens_are_the_engines_own_counts(engine) -> None:
    """Every forward the engine runs for a window is the window's, by what it was for."""
    c = engine.counters
    for policy in ("kamera", "recompute", "prefix", "blind", "cacheblend", "mpic"):
        engine.anchor_kv  # noqa: B018  computed once per engine, never a window's work
        before = (c.forwards, c.tokens_prefilled)
        win = ContextWindow(engine, policy=policy)
        ids = [win.add(random_ids(7, seed=720 + i)) for i in range(3)]
        win.next_token_logprobs(PROMPT)
        win.reorder(list(reversed(ids)))
        win.is_disposable(ids[1], PROMPT, max_new_tokens=2)
        st = win.stats()
        ran = (c.forwards - before[0], c.tokens_prefilled - before[1])
        # selective recompute runs the layers itself, outside engine.forward: its context work is counted apart
        outside = st.work.get(Work.CONTEXT, WorkCount()) if issubclass(POLICIES[policy], SelectivePolicy) else None
        assert outside is None or outside.tokens == st.selective_tokens > 0, policy
        assert st.forwards - (outside.forwards if outside else 0) == ran[0], policy
        assert sum(w.tokens for w in st.work.values()) - (outside.tokens if outside else 0) == ran[1], policy
        assert st.ingest_tokens == st.work.get(Work.INGEST, WorkCount()).tokens
        assert st.forwards == sum(w.forwards for w in st.work.values())


def test_served_slots_are_counted_by_source_and_survive_json(engine) -> None:
    win = ContextWindow(engine)
    ids = [win.add(random_ids(7, seed=730 + i)) for i in range(3)]
    win.next_token_logprobs(PROMPT)  # lead + two forwards
    ids.append(win.add(random_ids(7, seed=733)))
    win.next_token_logprobs(PROMPT)  # lead + two keeps + a forward
    win.slide(1)
    win.next_token_logprobs(PROMPT)  # lead + two survivors
    st = win.stats()
    assert st.served == {Source.LEAD: 3, Source.FORWARD: 3, Source.KEEP: 2, Source.SURVIVOR: 2}
    assert (st.kept, st.survivors_rotated, st.patches_reused, st.blind_served, st.prefix_hits) == (2, 2, 0, 0, 0)
    dumped = st.model_dump(mode="json")
    assert dumped["kept"] == 2 and dumped["served"]["keep"] == 2 and dumped["forwards"] == st.forwards
    back = WindowStats.model_validate_json(st.model_dump_json())
    assert back.model_dump() == st.model_dump()
    assert len(ids) == 4


def test_patch_kinds_keep_their_stored_keys(engine, tmp_path: Path) -> None:
    """``PatchKind`` is a str enum: store keys and metadata read as the plain strings they were."""
    assert [k.value for k in PatchKind] == ["exact", "orbit", "fresh", "removal"]
    assert f"{PatchKind.ORBIT}" == "orbit" and PatchKind.ORBIT == "orbit"
    # the digests are persisted in keys: pinned to the formula they were written with
    assert sequence_digest(["1", "2"]) == hashlib.blake2b(b"1|2", digest_size=12).hexdigest()
    assert antecedent_signature(("a", "b")) == sequence_digest(["a", "b"])
    win = ContextWindow(engine, store=tmp_path, config=WindowConfig(reorder_patch="orbit"))
    ids = [win.add(random_ids(6, seed=740 + i)) for i in range(3)]
    stored = win.form_orbit_patch(ids[2])
    assert stored.kind is PatchKind.ORBIT and win.stats().orbit_patches_formed == 1
    win.close()
    keys = win.store.variants(engine.fingerprint, EntryKind.PATCH, ids[2])
    assert [k.variant.split(":")[0] for k in keys] == ["orbit"]
    reloaded = ContextWindow(engine, store=tmp_path)
    reloaded.add(random_ids(6, seed=742))
    assert [p.kind for p in reloaded.chunk(ids[2]).patches] == [PatchKind.ORBIT]
    assert StoredPatch(stored.patch, (), kind="fresh").kind is PatchKind.FRESH  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StoredPatch(stored.patch, (), kind="sideways")  # type: ignore[arg-type]


def test_the_window_docstring_names_every_registered_policy() -> None:
    doc = ContextWindow.__doc__ or ""
    assert [name for name in POLICIES if f"``{name}``" not in doc] == []


# --- every counter pinned on small scripted sessions (tiny llama, 7-token chunks, 3-token prompt) ---------


def _counters(st: WindowStats) -> dict:
    out = {n: getattr(st, n) for n in (*WindowStats.model_fields, *WindowStats.model_computed_fields)}
    for name in ("timings", "decisions", "work", "kv_bytes_fraction", "canonical_bytes", "patch_bytes"):
        out.pop(name)
    return out


def test_every_counter_on_a_scripted_kamera_session(engine, tmp_path: Path) -> None:
    win = ContextWindow(engine, store=tmp_path)
    a, b, c = (win.add(random_ids(7, seed=750 + i)) for i in range(3))  # 3 canonicals computed, stored
    win.next_token_logprobs(PROMPT)  # a lead; b, c one forward with the prompt riding in it
    win.next_token_logprobs([12, 13])  # unchanged window: the same assembly, the prompt's own forward
    win.slide(1)  # a leaves
    win.next_token_logprobs(PROMPT)  # b leads (its pending patch set aside), c a survivor
    win.recall(a)  # the set-aside patch of b is formed; c absorbed a: marked stale
    win.next_token_logprobs(PROMPT)  # c's own pending patch formed first; c (cascade) and a (fresh) one forward
    assert win.flush() == 2  # the patches of that forward: c exact, a fresh
    st = win.stats()
    assert st.work == {
        Work.INGEST: WorkCount(forwards=3, tokens=21),
        Work.CONTEXT: WorkCount(forwards=2, tokens=28),
        Work.PROMPT: WorkCount(forwards=2, tokens=3 + 2 + 3 + 3),
    }
    assert _counters(st) == {
        "policy": "kamera",
        "forked": False,
        "started_at_step": 0,
        "served": {Source.LEAD: 3, Source.FORWARD: 4, Source.SURVIVOR: 1},
        "formed": {PatchKind.EXACT: 3, PatchKind.FRESH: 1},
        "prompt_tokens": 11,
        "canonicals_computed": 3,
        "canonicals_reused": 0,
        "selective_tokens": 0,
        "envelope_reuse": 0,
        "envelope_rebuild": 0,
        "cascade_marked": 1,
        "cascade_rematerialised": 1,
        "store_loads": 0,
        "store_load_failures": 0,
        "window_kv_bytes": win.assemble().nbytes,
        "window_tokens": len(engine.anchor_ids) + 21,
        "vision_tower_runs": 0,
        "background_queued": {},
        "background_done": {},
        "background_inline": {},
        "cost_plans": {},  # background off: plans are the policy's, not priced
        "forwards": 7,
        "tokens_prefilled": 28,
        "ingest_tokens": 21,
        "compression_stats_tokens": 0,
        "patches_formed": 4,
        "orbit_patches_formed": 0,
        "fresh_patches_formed": 1,
        "patches_reused": 0,
        "survivors_rotated": 1,
        "kept": 0,
        "blind_served": 0,
        "prefix_hits": 0,
        "background_tokens": 0,
        "fused_refills": 0,
    }
    child = win.fork()
    fork = child.stats()
    assert (fork.forked, fork.started_at_step, fork.forwards, fork.served) == (True, 5, 0, {})  # 5 operations
    win.close()
    # a new window on the store: a's canonical and its fresh patch loaded, nothing computed
    again = ContextWindow(engine, store=tmp_path)
    again.add(random_ids(7, seed=750))
    st = again.stats()
    assert (st.canonicals_reused, st.canonicals_computed, st.store_loads, st.forwards) == (1, 0, 2, 0)
    assert {b, c} <= set(win.chunks)


def test_recompute_prefills_the_whole_window_on_every_use(engine) -> None:
    win = ContextWindow(engine, policy="recompute")
    for i in range(2):
        win.add(random_ids(7, seed=760 + i))
    win.next_token_logprobs(PROMPT)
    win.next_token_logprobs(PROMPT)  # nothing changed: prefilled again all the same
    win.next_token_logprobs([12, 13])
    st = win.stats()
    assert (st.tokens_prefilled, st.forwards, st.prompt_tokens, st.served) == (42, 3, 8, {Source.FORWARD: 6})
    assert st.work[Work.PROMPT] == WorkCount(forwards=0, tokens=8)  # every prompt rode in the window's forward


def test_kept_patched_envelope_and_orbit_counters(engine) -> None:
    win = ContextWindow(engine, config=WindowConfig(reorder_patch="orbit"))
    a, b, c = (win.add(random_ids(7, seed=770 + i)) for i in range(3))
    win.next_token_logprobs(PROMPT)
    d = win.add(random_ids(7, seed=773))
    win.next_token_logprobs(PROMPT)  # a lead, b and c kept, d forward
    win.reorder([a, c, b, d])  # orbit patches for c, b, d over every order of their predecessor sets
    win.next_token_logprobs(PROMPT)  # a lead, c, b, d from their orbit patches
    st = win.stats()
    assert st.served == {Source.LEAD: 3, Source.FORWARD: 3, Source.KEEP: 2, Source.PATCH: 3}
    assert (st.kept, st.patches_reused, st.orbit_patches_formed) == (2, 3, 3)
    # the two uses' forward runs (b + c, then d), then one forward per ordering: c behind {a} (1), b behind
    # {a, c} (2), d behind {a, b, c} (6)
    assert st.work[Work.CONTEXT] == WorkCount(forwards=2 + 9, tokens=14 + 7 + 14 + 2 * 21 + 6 * 28)
    assert (st.envelope_reuse, st.envelope_rebuild) == (0, 0)  # each orbit patch was formed on this very order


def test_envelope_counters(engine) -> None:
    win = ContextWindow(engine)  # reorder_patch="transfer"
    a, b, c, d = (win.add(random_ids(7, seed=780 + i)) for i in range(4))
    win.next_token_logprobs(PROMPT)
    win.reorder([a, c, b, d])
    win.next_token_logprobs(PROMPT)
    st = win.stats()
    # c absorbed b, now behind it: re-prefilled (no envelope verdict); b formed behind (a,), now behind (a, c):
    # outside the envelope, rebuilt; d formed behind (a, b, c), now (a, c, b): reordered, kept (envelope)
    assert (st.envelope_reuse, st.envelope_rebuild) == (1, 1)
    assert st.served == {Source.LEAD: 2, Source.FORWARD: 3 + 2, Source.KEEP: 1}


def test_every_counter_is_defined_and_in_the_docs_table() -> None:
    table = (SDK.parent / "docs" / "window.md").read_text()
    fields = {**WindowStats.model_fields, **WindowStats.model_computed_fields}
    assert [n for n, f in fields.items() if not f.description] == []
    assert [n for n in fields if f"| `{n}` |" not in table] == []

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
    assert serving == ["blind", "kamera", "prefix", "recompute"]
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

"""The fleet on a local Ray cluster and a real redis-server: affinity, failover from the journal, scaling.

One cluster (2 CPUs) and one Redis serve the whole module; the tiny chat engine keeps it fast (its answers'
content does not matter, only that a rebuilt window answers exactly as the same window built fresh).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from kamera_fleet import FleetConfig, SessionJournal, build_app  # noqa: E402
from kamera_sdk import ContextWindow, RemoteWindow  # noqa: E402
from kamera_sdk.server import SessionNotFoundError  # noqa: E402
from kamera_sdk.store import EntryAuth, EntryKey, RedisBackend, StoreEntry, open_store  # noqa: E402
from tests.conftest import tiny_chat_engine  # noqa: E402
from tests.store.conftest import _free_port, _start_redis, _stop  # noqa: E402

APP = "kamera"
DOCS = [f"Document {i}: " + " ".join(f"fact{i}-{j} is about topic {j % 7}." for j in range(12)) for i in range(40)]
PROMPT = "Summarise."
SECRET = "s" * 32


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    started = _start_redis(tmp_path_factory.mktemp("fleet-redis"))
    if isinstance(started, str):
        pytest.skip(f"FLEET TESTS SKIPPED: {started}")
    server, port = started
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _deploy(redis_url: str, replicas: int) -> None:
    cfg = FleetConfig(tiny_chat_engine, redis_url, replicas=replicas, replica_cpus=0.5, secret=SECRET)
    serve.run(build_app(cfg), route_prefix="/", name=APP)


def _replica_actors() -> dict[str, Any]:
    """Replica actor name (which ends in the replica's id) -> its actor."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "KameraReplica" in a["name"]]
    return {a["name"]: ray.get_actor(a["name"], namespace=a["namespace"]) for a in names}


def _wait_replicas(n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications[APP].deployments["KameraReplica"]
        running = status.replica_states.get("RUNNING", 0)
        if running == n and len(_replica_actors()) == n and str(status.status).endswith("HEALTHY"):
            return
        time.sleep(0.5)
    raise AssertionError(f"the fleet did not reach {n} running replicas")


def _header(blob: bytes) -> dict[str, Any]:
    """The Kamera header of a stored entry (safetensors: a length, then JSON metadata)."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(json.loads(blob[8 : 8 + n])["__metadata__"]["kamera"])


def _fresh_answer(engine: Any, docs: list[str]) -> str:
    with ContextWindow(engine) as win:
        for d in docs:
            win.add_text(d)
        return win.generate(PROMPT, max_new_tokens=6)


def _answer(url: str, sid: str) -> str:
    with RemoteWindow(url, session_id=sid, timeout=300) as w:
        return w.generate(PROMPT, max_new_tokens=6)


def _open_session(url: str, docs: list[str]) -> tuple[str, str]:
    """A session holding ``docs``; (its id, the replica that holds it)."""
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/sessions", json={})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        replicas = {r.headers["x-kamera-replica"]}
        for d in docs:
            r = c.post(f"/v1/sessions/{sid}/chunks", json={"text": d})
            assert r.status_code == 201, r.text
            replicas.add(r.headers["x-kamera-replica"])
        r = c.post(f"/v1/sessions/{sid}/generate", json={"prompt": PROMPT, "max_new_tokens": 6})
        assert r.status_code == 200, r.text
        replicas.add(r.headers["x-kamera-replica"])
    assert len(replicas) == 1, f"one session's requests reached {replicas}"
    return sid, replicas.pop()


def test_fleet_affinity_failover_and_scaling(cluster: str, redis_url: str) -> None:
    _deploy(redis_url, 2)
    _wait_replicas(2)
    engine = tiny_chat_engine()
    n = 16
    plans = [[DOCS[(3 * i + k) % len(DOCS)] for k in range(3)] for i in range(n)]

    # two replicas: every request of a session lands on one replica; sessions spread across both
    with cf.ThreadPoolExecutor(4) as pool:
        opened = list(pool.map(lambda p: _open_session(cluster, p), plans))
    holders = {rep for _, rep in opened}
    assert len(holders) == 2, f"sessions did not spread: {holders}"

    # the journal holds each session's window: chunk ids in order and their text
    journal = SessionJournal(redis_url)
    rec = journal.read(opened[0][0])
    assert rec is not None and len(rec.order) == 3 and all(rec.chunks[c]["text"] for c in rec.order)
    assert [op["op"] for op in journal.ops(opened[0][0])] == ["create", "chunks", "chunks", "chunks"]

    # every session reorders (a journaled change), then a replica is killed in the middle of a load
    victim_name = opened[0][1]
    lost = [sid for sid, rep in opened if rep == victim_name]
    expected = {}
    for (sid, _), docs in zip(opened, plans, strict=True):
        expected[sid] = _fresh_answer(engine, [docs[2], docs[0], docs[1]])

    def reorder_and_answer(sid: str) -> tuple[str, str]:
        with RemoteWindow(cluster, session_id=sid, timeout=300) as w:
            order = list(w.chunks)
            w.reorder([order[2], order[0], order[1]])
            return sid, w.generate(PROMPT, max_new_tokens=6)

    victim = next(a for name, a in _replica_actors().items() if name.endswith(victim_name))
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(reorder_and_answer, sid) for sid, _ in opened]
        time.sleep(0.3)
        ray.kill(victim, no_restart=True)
        answers = dict(f.result() for f in futures)  # no request fails: a failure raises here
    wall = time.perf_counter() - t0
    assert set(answers) == {sid for sid, _ in opened}  # zero sessions lost
    for sid, text in answers.items():
        assert text == expected[sid], f"session {sid} answered differently after failover"

    rebuilt_a = [r for r in journal.rebuilds() if r["session"] in lost]
    assert rebuilt_a, "no session of the killed replica was rebuilt"
    print("FLEET FAILOVER MID-LOAD", json.dumps({"sessions": n, "lost": 0, "rebuilt": len(rebuilt_a),
                                                 "load_wall_s": round(wall, 2)}))  # fmt: skip

    # every window has now answered in its current order: kill the replica owning most sessions, then each
    # session's next request rebuilds where needed; count what the rebuild recomputed against a full re-prefill
    _wait_replicas(2)
    owners = {sid: journal.client.hget(f"kamera:fleet:s:{sid}", "owner").decode() for sid, _ in opened}
    victim_name = max(set(owners.values()), key=list(owners.values()).count)
    moved = [sid for sid, o in owners.items() if o == victim_name]
    before = len(journal.rebuilds())
    ray.kill(next(a for name, a in _replica_actors().items() if name.endswith(victim_name)), no_restart=True)
    with cf.ThreadPoolExecutor(4) as pool:
        again = dict(pool.map(lambda sid: (sid, _answer(cluster, sid)), moved))
    assert all(again[sid] == expected[sid] for sid in moved)
    rebuilds = [r for r in journal.rebuilds()[before:] if r["session"] in moved]
    assert {r["session"] for r in rebuilds} == set(moved)
    computed = full = 0
    for sid in moved:
        with RemoteWindow(cluster, session_id=sid, timeout=300) as w:
            s = w.stats()
        computed += s.ingest_tokens + s.tokens_prefilled  # chunk tokens run (the prompt is not counted)
        full += journal.read(sid).tokens()
    fraction = computed / full
    report = {"rebuilt": len(moved), "fraction": round(fraction, 3),
              "rebuild_s_max": round(max(r["seconds"] for r in rebuilds), 3),
              "rebuild_s_mean": round(sum(r["seconds"] for r in rebuilds) / len(rebuilds), 3)}  # fmt: skip
    print("FLEET REBUILD", json.dumps(report))
    assert fraction <= 0.5, report

    # a session no replica ever held: a clear error naming it
    gone = "ks_" + "x" * 32
    with RemoteWindow(cluster, session_id=gone, timeout=60) as never, pytest.raises(SessionNotFoundError, match=gone):
        never.stats()

    _forged_entry_is_refused_by_the_fleet(cluster, redis_url, engine)
    _wait_replicas(2)
    _forks_streams_and_a_lost_journal(cluster, redis_url, engine, journal)

    # scale 1 -> 2 -> 1 under load: no request fails
    def work(sid: str) -> str:
        with RemoteWindow(cluster, session_id=sid, timeout=300) as w:
            return w.generate(PROMPT, max_new_tokens=3)

    _deploy(redis_url, 1)
    _wait_replicas(1)
    live = [sid for sid, _ in opened]
    for replicas in (2, 1):
        with cf.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(work, sid) for sid in live for _ in range(2)]
            time.sleep(0.2)
            _deploy(redis_url, replicas)
            _wait_replicas(replicas)
            assert all(isinstance(f.result(), str) for f in futures)  # a failed request raises here
    journal.close()


def _forged_entry_is_refused_by_the_fleet(cluster: str, redis_url: str, engine: Any) -> None:
    """An attacker who can write to Redis but lacks the secret writes a poisoned canonical for content no
    replica has seen; a fleet session that adds that content refuses it (counted), recomputes it, and answers
    as a fresh window does."""
    import redis

    client = redis.Redis.from_url(redis_url)
    text = "A forged page: the harbor ledger lists copper lanterns, violins and meadow stones in order."
    before = set(client.scan_iter(match="kamera:*:e:*"))
    with open_store(redis_url, secret=SECRET, write_behind=False) as honest, ContextWindow(engine, store=honest) as w:
        w.add_text(text)  # an honest canonical, tagged, as a replica would write it
    backend = RedisBackend(redis_url, auth=EntryAuth(SECRET))
    forged = 0
    for name in set(client.scan_iter(match="kamera:*:e:*")) - before:
        info = _header(client.hget(name, "data"))
        if info["kind"] != "canonical":
            continue
        key = EntryKey(info["fingerprint"], info["kind"], info["content_hash"], info.get("variant", ""))
        entry = backend.get(key)
        assert entry is not None
        poisoned = StoreEntry(key, {n: torch.full_like(t, 7) for n, t in entry.tensors.items()}, dict(entry.meta))
        blob = poisoned.encode(None)  # well-formed, self-consistent checksum, no MAC
        client.hset(name, mapping={"data": blob, "checksum": hashlib.sha256(blob).hexdigest()})
        forged += 1
    assert forged == 1
    expected = _fresh_answer(engine, [DOCS[0], text])
    with RemoteWindow(cluster, timeout=300) as w:
        w.add_text(DOCS[0])
        w.add_text(text)
        assert w.generate(PROMPT, max_new_tokens=6) == expected
        assert w.stats().store_load_failures >= 1
        with httpx.Client(base_url=cluster, timeout=60) as c:
            stats = c.get("/v1/fleet/stats", params={"session": w.id}).json()
    assert stats["replica"]["store"]["refused_auth"] == 1, stats
    client.close()


def _forks_streams_and_a_lost_journal(cluster: str, redis_url: str, engine: Any, journal: SessionJournal) -> None:
    """Forks and streamed answers through the fleet; a fork child rebuilt on another replica answers as
    the same window built fresh; a journal lost while its window lives is written again whole; a session
    whose journal is lost and whose replica died gets an error naming it."""
    d0, d1, d2 = DOCS[30], DOCS[31], DOCS[32]
    parent = RemoteWindow(cluster, timeout=300)
    parent.add_text(d0)
    parent.add_text(d1)
    child = parent.fork()
    child.add_text(d2)
    doomed = parent.fork()  # on the parent's replica too
    assert "".join(child.generate(PROMPT, max_new_tokens=6, stream=True)) == _fresh_answer(engine, [d0, d1, d2])
    assert parent.generate(PROMPT, max_new_tokens=6) == _fresh_answer(engine, [d0, d1])

    # the OpenAI chat stream: the same answer as the chat answered whole
    msgs = [{"role": "user", "content": "Name a colour."}]
    with httpx.Client(base_url=cluster, timeout=300) as c:
        whole = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "user": "whole"}).json()
        pieces = []
        with c.stream("POST", "/v1/chat/completions",
                      json={"messages": msgs, "max_tokens": 6, "user": "streamed", "stream": True}) as r:  # fmt: skip
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:]).get("choices", []):
                        pieces.append(choice["delta"].get("content") or "")
    assert "".join(pieces) == whole["choices"][0]["message"]["content"]

    # the parent's journal is lost while its replica holds it: its next change journals the whole window again
    owner = journal.client.hget(f"kamera:fleet:s:{parent.id}", "owner").decode()
    assert journal.client.hget(f"kamera:fleet:s:{child.id}", "owner").decode() == owner
    journal.delete(parent.id)
    d3 = DOCS[33]
    parent.add_text(d3)
    rec = journal.read(parent.id)
    assert rec is not None and len(rec.order) == 3 and set(rec.chunks) == set(rec.order)

    # the doomed fork's journal is lost, a broken fork's journal lacks a chunk, then their replica dies
    journal.delete(doomed.id)
    broken = parent.fork()
    cut = journal.read(broken.id).order[1]
    journal.client.hdel(f"kamera:fleet:s:{broken.id}:c", cut)
    ray.kill(next(a for name, a in _replica_actors().items() if name.endswith(owner)), no_restart=True)
    assert "".join(child.generate(PROMPT, max_new_tokens=6, stream=True)) == _fresh_answer(engine, [d0, d1, d2])
    assert parent.generate(PROMPT, max_new_tokens=6) == _fresh_answer(engine, [d0, d1, d3])
    assert {r["session"] for r in journal.rebuilds()} >= {parent.id, child.id}  # both rebuilt elsewhere
    with pytest.raises(SessionNotFoundError, match=doomed.id):
        doomed.stats()
    with pytest.raises(SessionNotFoundError, match=doomed.id):
        doomed.close()  # its delete is refused the same way; the client is closed all the same
    with pytest.raises(SessionNotFoundError, match=f"{broken.id} cannot be rebuilt: its journal lacks chunk {cut}"):
        broken.generate(PROMPT, max_new_tokens=2)
    broken.delete()  # the journal is still there: the delete succeeds
    broken.close()
    for w in (parent, child):
        w.close()


def test_a_replica_that_refuses_its_options_fails_the_deployment_with_its_error(cluster: str, redis_url: str) -> None:
    """``app_options`` reach each replica's ``create_app``; one it refuses fails the deployment, and
    ``failed_deployment_error`` (what ``kamera fleet up`` reports before it shuts Ray down) finds its error."""
    from kamera_fleet.cli import failed_deployment_error

    options = {"batch": False, "step_tokens": 8}  # a step size without a scheduler: refused, never ignored
    cfg = FleetConfig(tiny_chat_engine, redis_url, replica_cpus=0.5, secret=SECRET, app_options=options)
    try:
        with pytest.raises(RuntimeError, match="Deploying application kamera-refused failed"):
            serve.run(build_app(cfg), route_prefix="/refused", name="kamera-refused")
        why = failed_deployment_error("kamera-refused")
        assert why is not None and "InvalidInputError" in why
        assert "step_tokens configures the batching scheduler, which this server does not run (batch=False)" in why
    finally:
        serve.delete("kamera-refused")

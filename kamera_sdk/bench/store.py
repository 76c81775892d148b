"""``kamera bench store``: loading a stored 1024-token canonical (disk, Redis) vs recomputing it, and
what each storage dtype costs: bytes per token on disk and the KL of next-token log-probs of a window
served from that store against the same window served from a store of the engine's own dtype.

Redis is measured against a real ``redis-server`` started on loopback for the run (skipped, and said so
in the result, when the binary is not installed).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kamera_engine import Engine

from ..chunks import Chunk, content_id
from ..console import err
from ..persistence import Persistence
from ..stats import WindowStats
from ..store import STORAGE_DTYPES, ChunkStore, DiskBackend, RedisBackend, open_store
from ..window import ContextWindow
from .corpus import load_corpus
from .metrics import kl, timed
from .operator import _text_tokens


@contextlib.contextmanager
def redis_server() -> Iterator[str | None]:
    """A throwaway redis-server on 127.0.0.1 (its URL), or None when redis-server is not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(100):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.1):
                    break
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _load_time(engine: Engine, chunk: Chunk, make_store) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Write the canonical through one store, then time cold loads through fresh stores (no memory hit)."""
    writer = make_store()
    Persistence(writer, engine, WindowStats(policy="bench")).save_canonical(chunk, chunk.canonical)
    writer.flush()
    size = writer.stats().bytes_written
    writer.close()

    def load() -> None:
        reader = make_store()
        kv = Persistence(reader, engine, WindowStats(policy="bench")).load_canonical(chunk)
        assert kv is not None and kv.keys.shape == chunk.canonical.keys.shape  # type: ignore[union-attr]
        reader.close()

    return timed(load, repeat=5), size


def run(engine: Engine, *, quick: bool = False) -> dict[str, Any]:
    n = 1024
    ids = _text_tokens(engine, n)
    err.print(f"[bold]store[/] on {engine.name}: a {n}-token canonical")
    chunk = Chunk(content_id("tokens", str(ids).encode()), "tokens", ids)
    recompute = timed(lambda: engine.canonical(ids), repeat=2 if quick else 3)
    chunk.canonical = engine.canonical(ids)
    result: dict[str, Any] = {
        "chunk_tokens": n,
        "recompute_s": recompute,
        "dtype": str(engine.dtype).removeprefix("torch."),
    }
    with tempfile.TemporaryDirectory() as tmp:
        disk_s, size = _load_time(engine, chunk, lambda: ChunkStore(backend=DiskBackend(Path(tmp) / "s")))
    result["disk"] = {"load_s": disk_s, "speedup_vs_recompute": recompute / disk_s}
    result["canonical_bytes_per_token"] = size / n
    with redis_server() as url:
        if url is None:
            result["redis"] = {"skipped": "redis-server is not installed (apt-get install redis-server)"}
        else:
            redis_s, _ = _load_time(engine, chunk, lambda: ChunkStore(backend=RedisBackend(url)))
            result["redis"] = {"load_s": redis_s, "speedup_vs_recompute": recompute / redis_s}
    # patch bytes per token at the default rank, for the same chunk conditioned on a 512-token context
    ctx = _text_tokens(engine, n + 512)[n:]
    past = engine.forward(engine.anchor_ids + ctx, None, 0, logits="none").kv
    cond = engine.forward(ids, past, len(past), logits="none").kv
    patch = engine.form_patch(cond, chunk.canonical, 32)
    result["patch_rank32_bytes_per_token"] = patch.nbytes / n
    result["storage_dtypes"] = storage_dtypes(engine, quick=quick)
    return result


def _served(engine: Engine, root: Path, pages: list[str], questions: list[str]) -> tuple[list[Any], dict[str, Any]]:
    """Next-token log-probs of each question over ``pages``, from a fresh window on the store at ``root``
    (its canonicals and patches loaded from disk), and that store's ``info``."""
    with open_store(root) as store:
        win = ContextWindow(engine, store=store)
        for text in pages:
            win.add_text(text)
        lps = [win.next_token_logprobs(q) for q in questions]
        hits = store.stats().backend_hits
        win.close()
    backend = DiskBackend(root)
    info = backend.info()
    backend.close()
    info["backend_hits"] = hits
    return lps, info


def storage_dtypes(engine: Engine, *, quick: bool = False) -> dict[str, Any]:
    """For the engine's dtype and each compact ``storage_dtype``: a window's pages are added and asked
    about through a store written in that dtype, then served again by a fresh window from that store;
    KL of its next-token log-probs against the same window served from the engine-dtype store (mean and
    max over the questions), and disk bytes per token (canonicals alone, and all entries)."""
    corpus = load_corpus()
    demo = corpus.demo
    pages = [corpus.page(pid).text for pid in demo.pages[: 3 if quick else 6]]
    questions = [q.question for q in demo.questions[: 2 if quick else 6]]
    own = str(engine.dtype).removeprefix("torch.")
    out: dict[str, Any] = {"pages": len(pages), "questions": len(questions), "engine_dtype": own}
    ref: list[Any] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in [own, *(d for d in STORAGE_DTYPES if d != own)]:
            root = Path(tmp) / name
            with open_store(root, storage_dtype=None if name == own else name) as store:  # the writer
                win = ContextWindow(engine, store=store)
                for text in pages:
                    win.add_text(text)
                for q in questions:
                    win.next_token_logprobs(q)
                win.close()
            lps, info = _served(engine, root, pages, questions)
            tokens = info["canonical_tokens"]
            kls = [0.0] * len(lps) if ref is None else [kl(r, lp) for r, lp in zip(ref, lps, strict=True)]
            ref = lps if ref is None else ref
            out[name] = {
                "kl_vs_engine_dtype_mean": sum(kls) / len(kls),
                "kl_vs_engine_dtype_max": max(kls),
                "canonical_bytes_per_token": info["canonical_bytes_per_token"],
                "all_bytes_per_token": info["bytes"] / tokens if tokens else None,
                "entries": info["entries"],
                "backend_hits": info["backend_hits"],
            }
            err.print(f"  storage {name}: {out[name]['all_bytes_per_token']:.0f} B/token, KL {max(kls):.2e}")
    return out

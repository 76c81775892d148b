"""Deterministic entries for store tests, and the worker processes the crash / concurrency tests spawn.

python _store_proc.py writer <dir> <start> <count> <elems>   put entries start.., print each index
python _store_proc.py crash  <dir> <point> <elems>           put entry 0, SIGKILL itself inside put(1)
python _store_proc.py mixer  <dir> <name> <ids> <others> <go-file> <elems>
                                                             put own ids, read the other's, print JSON
python _store_proc.py rebuild <dir> <point>                  open a store whose index is broken; the
                                                             rebuild prints each file it verifies and
                                                             dwells ("scan") or SIGKILLs itself before
                                                             installing the new index ("install")
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import types
from pathlib import Path

import torch

if __name__ == "__main__":
    # A worker needs only the store: register the two packages without running their __init__ (which
    # loads the model stack, seconds of imports), so workers start fast and the test stays short.
    _repo = Path(__file__).resolve().parents[2]
    for _name, _dir in (("kamera_engine", _repo / "engine"), ("kamera_sdk", _repo / "kamera_sdk")):
        if _name not in sys.modules:
            _pkg = types.ModuleType(_name)
            _pkg.__path__ = [str(_dir)]
            sys.modules[_name] = _pkg

from kamera_sdk.store import DiskBackend, EntryKey, EntryKind, StoreEntry

FP = "f0" * 16
OTHER_FP = "0f" * 16


def content_hash(i: int) -> str:
    return hashlib.blake2b(f"chunk-{i}".encode(), digest_size=16).hexdigest()


def make_entry(
    i: int,
    elems: int = 1024,
    kind: EntryKind = EntryKind.CANONICAL,
    fingerprint: str = FP,
    variant: str = "",
) -> StoreEntry:
    """Entry ``i``: K/V-like bfloat16 and float32 tensors plus int64 positions, all seeded by ``i``."""
    g = torch.Generator().manual_seed(i)
    tensors = {
        "k": torch.randn(2, elems, generator=g).to(torch.bfloat16),  # (kv_heads, elems)
        "v": torch.randn(2, elems, generator=g),
        "pos": torch.arange(i, i + 8, dtype=torch.int64),
    }
    key = EntryKey(fingerprint, kind, content_hash(i), variant)
    return StoreEntry(key, tensors, {"index": str(i)})


def same(a: StoreEntry, b: StoreEntry) -> bool:
    """Bit-exact equality of key, meta, tensor names, dtypes, shapes and values."""
    return (
        a.key == b.key
        and a.meta == b.meta
        and a.tensors.keys() == b.tensors.keys()
        and all(a.tensors[n].dtype == b.tensors[n].dtype and torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    )


def _writer(root: str, start: int, count: int, elems: int) -> None:
    backend = DiskBackend(root)
    for i in range(start, start + count):
        backend.put(make_entry(i, elems))
        print(i, flush=True)  # acknowledged: put returned, so the entry must survive a kill


def _crash(root: str, point: str, elems: int) -> None:
    """Put entry 0, then die by SIGKILL at ``point`` while putting entry 1."""
    import os
    import signal

    from kamera_sdk.store import _disk

    backend = DiskBackend(root)
    backend.put(make_entry(0, elems))
    print(0, flush=True)

    def die(*_args: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "before-fsync":  # temp file written, not yet durable nor renamed
        _disk.os.fsync = die  # type: ignore[assignment]
    elif point == "after-rename":  # final file in place, index row not yet written
        _disk._fsync_dir = die  # type: ignore[assignment]
    else:
        raise SystemExit(f"unknown crash point {point}")
    backend.put(make_entry(1, elems))
    print("survived", flush=True)


def _mixer(root: str, name: str, ids: list[int], others: list[int], go: str, elems: int) -> None:
    backend = DiskBackend(root)
    Path(f"{go}.{name}.ready").touch()  # imported and open: the parent starts both at once
    deadline = time.monotonic() + 60
    while not Path(go).exists():
        if time.monotonic() > deadline:
            raise SystemExit("no go signal")
        time.sleep(0.01)
    seen: set[int] = set()
    reads = 0
    for n, i in enumerate(ids):
        backend.put(make_entry(i, elems))
        got = backend.get(make_entry(i, elems).key)
        if got is None or not same(got, make_entry(i, elems)):
            raise SystemExit(f"{name}: own entry {i} did not read back")
        for j in {others[n], others[n // 2]}:
            other = backend.get(make_entry(j, elems).key)
            if other is not None:
                if not same(other, make_entry(j, elems)):
                    raise SystemExit(f"{name}: entry {j} read back wrong")
                seen.add(j)
                reads += 1
    print(json.dumps({"name": name, "seen": sorted(seen), "reads": reads}), flush=True)


def _rebuild(root: str, point: str) -> None:
    import os
    import signal

    from kamera_sdk.store import _rebuild

    verify = _rebuild.verify_file

    def slow_verify(path: Path):  # type: ignore[no-untyped-def]
        print(path.name[:12], flush=True)  # the parent kills us once a few files are through
        time.sleep(0.2)
        return verify(path)

    def die(*_args: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "scan":
        _rebuild.verify_file = slow_verify  # type: ignore[assignment]
    elif point == "install":
        _rebuild.install_index = die  # type: ignore[assignment]
    else:
        raise SystemExit(f"unknown rebuild point {point}")
    DiskBackend(root)
    print("survived", flush=True)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "writer":
        _writer(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
    elif mode == "crash":
        _crash(rest[0], rest[1], int(rest[2]))
    elif mode == "rebuild":
        _rebuild(rest[0], rest[1])
    elif mode == "mixer":
        _mixer(rest[0], rest[1], json.loads(rest[2]), json.loads(rest[3]), rest[4], int(rest[5]))
    else:
        raise SystemExit(f"unknown mode {mode}")

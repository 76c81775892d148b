"""``kamera store``: info, check, rebuild-index, prune and clear on a disk store, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from kamera_sdk.cli import main
from kamera_sdk.cli_args import byte_count
from kamera_sdk.store import DiskBackend


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    rc = main(["store", *args, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip() else {}


def test_store_command(tmp_path: Path, proc: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "store"
    backend = DiskBackend(root)
    for i in range(6):
        backend.put(proc.make_entry(i, 512, fingerprint=proc.FP if i % 2 else proc.OTHER_FP))
    total = backend.total_bytes()
    backend.close()
    rc, info = _run(capsys, "info", "--path", str(root))
    assert rc == 0 and info["entries"] == 6 and info["bytes"] == total
    assert {fp: v["entries"] for fp, v in info["by_fingerprint"].items()} == {proc.FP: 3, proc.OTHER_FP: 3}
    assert info["by_kind"] == {"canonical": {"entries": 6, "bytes": total}}

    (root / "index.sqlite").write_bytes(b"garbage" * 1000)  # opening rebuilds it
    rc, check = _run(capsys, "check", "--path", str(root))
    assert rc == 0 and check["ok"] == 6 and check["bad"] == []
    f = next(root.glob("objects/*/*.safetensors"))
    f.write_bytes(f.read_bytes()[:-1] + b"\x00")
    rc, check = _run(capsys, "check", "--path", str(root))
    assert rc == 1 and len(check["bad"]) == 1  # a bad checksum fails the command
    rc, check = _run(capsys, "check", "--path", str(root), "--fix")
    assert rc == 0 and len(check["bad"]) == 1 and check["repair"]["rows_dropped"] == 0

    rc, report = _run(capsys, "rebuild-index", "--path", str(root))
    assert rc == 0 and report["entries"] == 5 and report["reason"] == "requested"
    rc, pruned = _run(capsys, "prune", "--path", str(root), "--max-bytes", str(total // 3))
    assert rc == 0 and pruned["bytes"] <= total // 3 and pruned["evicted"] >= 2

    assert main(["store", "clear", "--path", str(root)]) == 2  # refused without --yes
    assert len(DiskBackend(root)) == pruned["entries"]
    rc, cleared = _run(capsys, "clear", "--path", str(root), "--yes")
    assert rc == 0 and cleared["deleted"] == pruned["entries"] and len(DiskBackend(root)) == 0

    assert main(["store", "info", "--path", str(tmp_path / "typo")]) == 2  # no store there: none created
    assert not (tmp_path / "typo").exists()


def test_default_path_and_byte_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KAMERA_HOME", str(tmp_path))
    DiskBackend(tmp_path / "store").close()
    rc, info = _run(capsys, "info")
    assert rc == 0 and info["path"] == str(tmp_path / "store") and info["entries"] == 0
    assert [byte_count(s) for s in ("1000", "2k", "1.5M", "2G", "1GiB", "3mb")] == [
        1000, 2000, 1_500_000, 2 * 10**9, 1 << 30, 3_000_000,
    ]  # fmt: skip
    with pytest.raises(Exception, match="expected a size in bytes"):
        byte_count("lots")

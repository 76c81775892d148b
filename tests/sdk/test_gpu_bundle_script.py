"""``scripts/gpu_bundle.py`` packs wheels and the default model for a GPU machine with no network: the model cut
into parts, and an installer that joins them, checks the sha256 and installs everything offline. The downloads
themselves need an index and are left out; the parts and the installer run for real on two small wheels."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import script

bundle = script("gpu_bundle")


def _wheel(directory: Path, name: str, payload: bytes) -> Path:
    """A minimal valid wheel holding module ``name`` with ``payload`` as a data file beside it."""
    path = directory / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{name}/blob.bin", payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_parts_join_check_and_install_offline(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    model = _wheel(src, "probe_model", bytes(range(256)) * 40)
    out = tmp_path / "bundle"
    (out / "wheels").mkdir(parents=True)
    _wheel(out / "wheels", "probe_dep", b"dep")
    parts = bundle.split(model, out / "model", 1000)
    assert len(parts) == -(-model.stat().st_size // 1000) and all(p.stat().st_size <= 1000 for p in parts)
    assert [p.name for p in parts] == sorted(p.name for p in parts) and parts[0].name == "part.000"
    assert b"".join(p.read_bytes() for p in parts) == model.read_bytes()
    assert (out / "model" / "SHA256").read_text().endswith(f"  {model.name}\n")
    (out / "install.sh").write_text(bundle.INSTALL)
    site = tmp_path / "site"
    env = {**os.environ, "PYTHON": sys.executable}  # the interpreter that runs the tests, with its pip
    done = subprocess.run(["bash", str(out / "install.sh"), str(site)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"export PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} PATH={site}/bin:$PATH"
    assert (site / "probe_model" / "blob.bin").read_bytes() == bytes(range(256)) * 40
    assert (site / "probe_dep" / "blob.bin").read_bytes() == b"dep"

    # a part missing (or damaged) in transit: refused before anything is installed
    parts[1].unlink()
    shutil.rmtree(site)
    done = subprocess.run(["bash", str(out / "install.sh"), str(site)], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "do not add up" in done.stderr and not site.exists()
    for part in parts[2:]:  # none at all: said so, before anything is joined
        part.unlink()
    parts[0].unlink()
    done = subprocess.run(["bash", str(out / "install.sh"), str(site)], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "no model parts" in done.stderr and not site.exists()


def test_parts_are_at_least_a_byte_and_at_most_a_thousand(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, "probe", bytes(5000))  # stored, not compressed: over 5000 bytes
    with pytest.raises(ValueError, match="at least one byte"):
        bundle.split(wheel, tmp_path / "m", 0)
    with pytest.raises(ValueError, match="more than 1000 parts"):  # three digits keep the shell's order
        bundle.split(wheel, tmp_path / "m", wheel.stat().st_size // 1001)
    assert not (tmp_path / "m").exists()


def test_the_bundle_carries_what_a_cuda_image_lacks() -> None:
    # what the H200 image lacked when Kamera ran there: transformers in range, pydantic, gguf, the server's
    # FastAPI and its opentelemetry-api, the tests' jsonschema, openai's httpx2 and the hub client's truststore
    need = {"transformers", "pydantic", "pydantic-core", "gguf", "fastapi", "opentelemetry-api", "jsonschema"}
    need |= {"httpx2", "truststore"}
    assert need <= set(bundle.PACKAGES) and "torch" not in bundle.PACKAGES

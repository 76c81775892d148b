"""Entries: what the store keeps, how a key names it, and the one serialized form (safetensors bytes).

An entry is a set of named CPU tensors (a chunk's canonical K/V, a patch's factors, a vision embedding)
plus string metadata. Its serialized form is a safetensors file whose header metadata holds a single
``"kamera"`` key (sorted JSON: format, fingerprint, kind, content hash, variant, meta, the sha256 of the
tensor data, and the original dtype of any tensor stored in a compact dtype). One key keeps the bytes
deterministic (safetensors writes a multi-key metadata map in hash order), so two processes writing the
same entry produce the same bytes and the same checksum. The header carries everything an index row
needs, so an index can be rebuilt from the files alone (``inspect``). Nothing here ever unpickles.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kamera_engine.errors import ChecksumError, FingerprintMismatchError, InvalidInputError, StoreError

from ._auth import EntryAuth

#: Version of the serialized form; a reader refuses any other.
FORMAT_VERSION = "1"
#: The one safetensors metadata key Kamera writes.
META_KEY = "kamera"
#: Longest fingerprint / content hash accepted (hex characters).
MAX_HEX_LEN = 128
#: Longest variant string accepted (characters).
MAX_VARIANT_LEN = 1024
#: Largest safetensors header a reader accepts (bytes); the format's own limit is 100 MB.
MAX_HEADER_BYTES = 16 << 20

_HEX = re.compile(r"[0-9a-f]+")

#: Compact storage dtypes a store may write floating tensors in (``storage_dtype``), by name.
STORAGE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}
#: Floating dtypes an entry may be cast back to on load (the ``"cast"`` header field).
_RESTORABLE: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64, **STORAGE_DTYPES}


def storage_dtype(value: object) -> torch.dtype | None:
    """Validate a ``storage_dtype`` option: None (keep every tensor's dtype), a name or a torch dtype."""
    if value is None:
        return None
    for name, dtype in STORAGE_DTYPES.items():
        if value in (name, dtype):
            return dtype
    raise InvalidInputError(f"storage_dtype must be None or one of {sorted(STORAGE_DTYPES)}, got {value!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class EntryKind(str, Enum):
    """What an entry holds."""

    CANONICAL = "canonical"  # KV(B|0) of one chunk at the reference position
    PATCH = "patch"  # low-rank conditioning factors of one chunk given an antecedent
    VISION = "vision"  # a vision encoder's output for one image / video segment


def _check_hex(name: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_HEX_LEN or not _HEX.fullmatch(value):
        raise InvalidInputError(
            f"{name} must be a non-empty lowercase hex string of at most {MAX_HEX_LEN} characters, got {value!r}"
        )
    return value


@dataclass(frozen=True, slots=True)
class EntryKey:
    """Names one entry: model fingerprint, kind, content hash and a free-form variant.

    ``variant`` tells apart entries of the same content (a patch's antecedent signature and rank, say).
    It may be any string, so storage names are derived from ``digest`` (sha256 of the whole key), never
    from the fields themselves.
    """

    fingerprint: str
    kind: EntryKind
    content_hash: str
    variant: str = ""

    def __post_init__(self) -> None:
        _check_hex("fingerprint", self.fingerprint)
        _check_hex("content_hash", self.content_hash)
        try:
            kind = EntryKind(self.kind)
        except ValueError as exc:
            allowed = ", ".join(k.value for k in EntryKind)
            raise InvalidInputError(f"kind must be one of {allowed}, got {self.kind!r}") from exc
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.variant, str) or len(self.variant) > MAX_VARIANT_LEN:
            raise InvalidInputError(f"variant must be a string of at most {MAX_VARIANT_LEN} characters")

    @property
    def digest(self) -> str:
        """sha256 hex of the whole key: the only name storage ever uses for this entry."""
        blob = json.dumps([self.fingerprint, self.kind.value, self.content_hash, self.variant])
        return hashlib.sha256(blob.encode()).hexdigest()

    def to_meta(self) -> dict[str, str]:
        return {
            "fingerprint": self.fingerprint,
            "kind": self.kind.value,
            "content_hash": self.content_hash,
            "variant": self.variant,
        }


def _check_tensors(tensors: object) -> dict[str, torch.Tensor]:
    if not isinstance(tensors, dict) or not tensors:
        raise InvalidInputError("tensors must be a non-empty dict of name -> torch.Tensor")
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise InvalidInputError(f"tensor names must be non-empty strings (not '__metadata__'), got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.device.type != "cpu":
            raise InvalidInputError(f"tensor {name!r} is on {t.device}; the store keeps CPU tensors (call .cpu())")
        if t.is_sparse or t.layout != torch.strided:
            raise InvalidInputError(f"tensor {name!r} is not dense (layout {t.layout})")
    return tensors


def _check_meta(meta: object) -> dict[str, str]:
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InvalidInputError("meta must be a dict of str -> str")
    return meta


@dataclass(eq=False)
class StoreEntry:
    """One stored entry: named CPU tensors and string metadata under a key.

    ``nbytes`` is the tensors' data size (what the entry costs in RAM); ``checksum`` is the sha256 of the
    serialized safetensors bytes (computed on first use and cached; treat tensors as immutable).
    ``stored_nbytes`` is the size of those bytes once the entry went to or came from a backend.
    ``storage_dtype`` (bfloat16 / float16, or None) writes wider floating tensors in that dtype; loading
    casts them back to their own dtype (lossy by design: a store option, see ``ChunkStore``).
    """

    key: EntryKey
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    last_used: float = 0.0
    uses: int = 0
    nbytes: int = field(init=False)
    stored_nbytes: int = field(default=0, compare=False)
    storage_dtype: torch.dtype | None = field(default=None, compare=False)
    _checksum: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.key, EntryKey):
            raise InvalidInputError(f"key must be an EntryKey, got {type(self.key).__name__}")
        _check_tensors(self.tensors)
        _check_meta(self.meta)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.storage_dtype = storage_dtype(self.storage_dtype)
        if not self.last_used:
            self.last_used = self.created_at

    @property
    def checksum(self) -> str:
        """sha256 hex of ``encode()``."""
        if self._checksum is None:
            self.encode()
        assert self._checksum is not None
        return self._checksum

    def encode(self, auth: EntryAuth | None = None) -> bytes:
        """The serialized form: safetensors bytes with the key and meta in the header (deterministic);
        ``auth``: tagged with that secret's MAC (see ``_auth``)."""
        blob = encode(self.key, self.tensors, self.meta, self.storage_dtype, auth)
        self._checksum = hashlib.sha256(blob).hexdigest()
        self.stored_nbytes = len(blob)
        return blob

    def summary(self) -> dict[str, list[Any]]:
        """name -> [dtype, shape] of every tensor (for indexes and listings)."""
        return {name: [str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in self.tensors.items()}


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with no two sharing storage (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out[name] = t
    return out


def _compact(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Floating tensors wider than ``dtype`` cast to it, and name -> original dtype of those cast. A tensor
    whose cast would overflow (a finite value becoming inf in float16) keeps its dtype."""
    if dtype is None:
        return tensors, {}
    out: dict[str, torch.Tensor] = {}
    cast: dict[str, str] = {}
    size = torch.empty((), dtype=dtype).element_size()
    for name, t in tensors.items():
        if t.is_floating_point() and t.element_size() > size and _dtype_name(t.dtype) in _RESTORABLE:
            small = t.to(dtype)
            if bool(torch.isfinite(small).all()) or not bool(torch.isfinite(t).all()):
                out[name], cast[name] = small, _dtype_name(t.dtype)
                continue
        out[name] = t
    return out, cast


def encode(
    key: EntryKey,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, str],
    storage: torch.dtype | None = None,
    auth: EntryAuth | None = None,
) -> bytes:
    """Serialize tensors under ``key`` (see module docstring for the header layout).

    The header records ``data_sha256``, the sha256 of the tensor data section, so a file can be verified
    on its own (an index rebuilt from files trusts no byte it cannot check), and ``cast`` when some
    tensors were written in the compact ``storage`` dtype. ``auth``: the header also carries its MAC.
    """
    tensors, cast = _compact(tensors, storage)
    header: dict[str, Any] = {"format": FORMAT_VERSION, **key.to_meta(), "meta": meta}
    if cast:
        header["cast"] = cast
    try:
        draft = st_save(_unshare(tensors), {META_KEY: json.dumps(header, sort_keys=True)})
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise StoreError(f"cannot serialize entry {key.digest[:12]}: {exc}") from exc
    # the data section does not depend on the header: hash it, then write the header again with the hash
    (n,) = struct.unpack("<Q", draft[:8])
    data = memoryview(draft)[8 + n :]
    header["data_sha256"] = hashlib.sha256(data).hexdigest()
    if auth is not None:
        header = auth.sign(header)
    st_header = json.loads(draft[8 : 8 + n])
    st_header["__metadata__"][META_KEY] = json.dumps(header, sort_keys=True)
    raw = json.dumps(st_header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    return b"".join((struct.pack("<Q", len(raw)), raw, data))


def read_header(blob: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """Parse a safetensors header with bounds checks: (header dict, total data bytes it describes)."""
    if len(blob) < 8:
        raise ChecksumError("entry is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", bytes(blob[:8]))
    if n > MAX_HEADER_BYTES or 8 + n > len(blob):
        raise ChecksumError(f"entry header length {n} is out of bounds")
    try:
        header = json.loads(bytes(blob[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChecksumError("entry header is not valid JSON") from exc
    if not isinstance(header, dict):
        raise ChecksumError("entry header is not a JSON object")
    data = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            data = max(data, int(info["data_offsets"][1]))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ChecksumError(f"tensor {name!r} has no valid data_offsets") from exc
    return header, data


#: safetensors dtype codes -> torch dtype names (the names ``StoreEntry.summary`` and the index use)
_ST_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip


def header_summary(header: dict[str, Any]) -> tuple[dict[str, list[Any]], int]:
    """(name -> [dtype, shape], tensor data bytes) from a parsed safetensors header (torch dtype names)."""
    summary: dict[str, list[Any]] = {}
    nbytes = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        summary[name] = [_ST_DTYPE_NAMES.get(str(info["dtype"]), str(info["dtype"])), list(info["shape"])]
        nbytes += int(end) - int(begin)
    return summary, nbytes


def _kamera_info(header: dict[str, Any], label: str) -> dict[str, Any]:
    """The ``"kamera"`` header field, parsed and checked for format and meta."""
    raw = header.get("__metadata__", {}).get(META_KEY) if isinstance(header.get("__metadata__"), dict) else None
    try:
        info = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        info = None
    if not isinstance(info, dict):
        raise StoreError(f"entry {label} carries no Kamera metadata")
    if info.get("format") != FORMAT_VERSION:
        raise StoreError(f"entry {label} has format {info.get('format')!r}, expected {FORMAT_VERSION}")
    meta = info.get("meta", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise StoreError(f"entry {label} has malformed meta")
    cast = info.get("cast", {})
    if not isinstance(cast, dict) or not all(isinstance(v, str) and v in _RESTORABLE for v in cast.values()):
        raise StoreError(f"entry {label} has a malformed cast record")
    return info


def _check_data(blob: bytes | bytearray | memoryview, header_len: int, info: dict[str, Any], label: str) -> bool:
    """Check the data section against the header's ``data_sha256``; False when the entry has none
    (written before the field existed)."""
    want = info.get("data_sha256")
    if want is None:
        return False
    if hashlib.sha256(memoryview(blob)[8 + header_len :]).hexdigest() != want:
        raise ChecksumError(f"entry {label}: tensor data do not match the sha256 in its header")
    return True


@dataclass(frozen=True)
class Inspected:
    """What a serialized entry says about itself: everything an index row needs."""

    key: EntryKey
    meta: dict[str, str]
    summary: dict[str, list[Any]]  # name -> [stored dtype, shape]
    nbytes: int  # stored tensor bytes
    checksum: str  # sha256 of the whole serialized form
    self_checked: bool  # the data matched the header's own sha256 (False: an entry without one)


def inspect(blob: bytes | bytearray | memoryview, label: str = "") -> Inspected:
    """Verify a serialized entry on its own, with no index: header bounds, Kamera metadata, the key it
    names, and its data against ``data_sha256`` (entries written before that field existed are instead
    parsed whole by safetensors, which catches truncation but not flipped bits). Raises ChecksumError /
    StoreError / InvalidInputError (a malformed key) for a file that is not a usable entry."""
    header, data_end = read_header(blob)
    (n,) = struct.unpack("<Q", bytes(blob[:8]))
    if 8 + n + data_end != len(blob):
        raise ChecksumError(f"entry {label}: {len(blob)} bytes, its header describes {8 + n + data_end}")
    info = _kamera_info(header, label)
    key = EntryKey(info.get("fingerprint"), info.get("kind"), info.get("content_hash"), info.get("variant", ""))
    if not _check_data(blob, n, info, label):
        try:
            st_load(bytes(blob))
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise ChecksumError(f"entry {label} does not deserialize: {exc}") from exc
    try:
        summary, nbytes = header_summary(header)
    except (KeyError, TypeError, ValueError) as exc:
        raise ChecksumError(f"entry {label} has a malformed tensor table") from exc
    self_checked = info.get("data_sha256") is not None
    return Inspected(key, info["meta"] if "meta" in info else {}, summary, nbytes,
                     hashlib.sha256(blob).hexdigest(), self_checked)  # fmt: skip


def decode(blob: bytes, key: EntryKey, checksum: str | None, auth: EntryAuth | None = None) -> StoreEntry:
    """Verify and deserialize ``blob`` as the entry for ``key``; tensors stored in a compact dtype come
    back in their own dtype. ``auth``: the entry must carry that secret's MAC and match the data sha256
    it covers (``UnauthenticatedEntryError`` otherwise), whatever checksum was recorded beside it.

    Raises ChecksumError when the bytes differ from ``checksum`` (or, with no checksum, from the header's
    data sha256, or do not parse), FingerprintMismatchError when the header names another model,
    StoreError when it names another key or format. Only safetensors parses the tensors; nothing is
    unpickled.
    """
    label = key.digest[:12]
    if checksum is not None and hashlib.sha256(blob).hexdigest() != checksum:
        raise ChecksumError(f"entry {label}: bytes do not match the recorded checksum")
    header, _ = read_header(blob)
    info = _kamera_info(header, label)
    if info.get("fingerprint") != key.fingerprint:
        raise FingerprintMismatchError(
            f"entry {label} was written by model {str(info.get('fingerprint'))[:16]}, not {key.fingerprint[:16]}"
        )
    for name, want in key.to_meta().items():
        if info.get(name) != want:
            raise StoreError(f"entry {label} holds another key ({name} differs)")
    if auth is not None:  # a recorded checksum is written by whoever wrote the entry: only the MAC vouches
        auth.verify(info, label)
    if checksum is None or auth is not None:  # nothing else vouches for these bytes but the file itself
        _check_data(blob, struct.unpack("<Q", bytes(blob[:8]))[0], info, label)
    try:
        tensors = st_load(bytes(blob))
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise ChecksumError(f"entry {label} does not deserialize: {exc}") from exc
    for name, dtype in info.get("cast", {}).items():
        if name not in tensors:
            raise StoreError(f"entry {label} records a cast of a tensor it does not hold ({name!r})")
        tensors[name] = tensors[name].to(_RESTORABLE[dtype])
    entry = StoreEntry(key=key, tensors=tensors, meta=info.get("meta", {}))
    entry._checksum = checksum or hashlib.sha256(blob).hexdigest()
    entry.stored_nbytes = len(blob)
    return entry

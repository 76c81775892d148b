"""Keys, entries and the serialized form: validation, determinism, verification on decode."""

from __future__ import annotations

import hashlib
import json
import struct
from types import ModuleType

import pytest
import torch
from safetensors.torch import save as st_save

from kamera_engine.errors import ChecksumError, FingerprintMismatchError, InvalidInputError, StoreError
from kamera_sdk.store import EntryKey, EntryKind, StoreEntry
from kamera_sdk.store._entry import decode, encode, read_header

FP = "ab" * 16
HASH = "cd" * 16


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"fingerprint": ""}, "fingerprint"),
        ({"fingerprint": "AB12"}, "fingerprint"),  # uppercase is refused, not silently folded
        ({"fingerprint": "../etc"}, "fingerprint"),
        ({"content_hash": "xyz"}, "content_hash"),
        ({"content_hash": "a" * 129}, "content_hash"),
        ({"kind": "weights"}, "kind must be one of canonical, patch, vision"),
        ({"variant": "x" * 1025}, "variant"),
        ({"variant": 3}, "variant"),
    ],
)
def test_key_validation_names_the_argument(kwargs: dict[str, object], needle: str) -> None:
    args: dict[str, object] = {"fingerprint": FP, "kind": "canonical", "content_hash": HASH, **kwargs}
    with pytest.raises(InvalidInputError, match=needle):
        EntryKey(**args)  # type: ignore[arg-type]


def test_key_kind_coerced_and_digest_covers_every_field() -> None:
    key = EntryKey(FP, "patch", HASH, "ante=1f|rank=32")  # type: ignore[arg-type]
    assert key.kind is EntryKind.PATCH
    expected = hashlib.sha256(json.dumps([FP, "patch", HASH, "ante=1f|rank=32"]).encode()).hexdigest()
    assert key.digest == expected
    variants = {
        EntryKey(FP, EntryKind.PATCH, HASH, "ante=1f|rank=32").digest,
        EntryKey(FP, EntryKind.PATCH, HASH, "ante=1f|rank=16").digest,
        EntryKey(FP, EntryKind.CANONICAL, HASH, "ante=1f|rank=32").digest,
        EntryKey("ab" * 15, EntryKind.PATCH, HASH, "ante=1f|rank=32").digest,
    }
    assert len(variants) == 4
    assert EntryKey(FP, EntryKind.PATCH, HASH, "../../x").digest.isalnum()  # any variant -> a hex name


def test_entry_nbytes_and_validation() -> None:
    key = EntryKey(FP, EntryKind.CANONICAL, HASH)
    e = StoreEntry(key, {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5, dtype=torch.int64)})
    assert e.nbytes == 3 * 4 * 2 + 5 * 8
    assert e.last_used == e.created_at and e.uses == 0
    with pytest.raises(InvalidInputError, match="non-empty dict"):
        StoreEntry(key, {})
    with pytest.raises(InvalidInputError, match=r"not a torch\.Tensor"):
        StoreEntry(key, {"a": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(InvalidInputError, match="__metadata__"):
        StoreEntry(key, {"__metadata__": torch.zeros(1)})
    with pytest.raises(InvalidInputError, match="meta"):
        StoreEntry(key, {"a": torch.zeros(1)}, {"n": 1})  # type: ignore[dict-item]
    with pytest.raises(InvalidInputError, match="EntryKey"):
        StoreEntry("key", {"a": torch.zeros(1)})  # type: ignore[arg-type]


def test_encoding_is_deterministic_and_decodes_bit_exact(proc: ModuleType) -> None:
    a, b = proc.make_entry(7), proc.make_entry(7)
    blob = a.encode()
    assert blob == b.encode()  # same entry -> same bytes, so concurrent writers agree on the checksum
    assert a.checksum == b.checksum == hashlib.sha256(blob).hexdigest()
    assert a.stored_nbytes == len(blob)
    header, data = read_header(blob)
    info = json.loads(header["__metadata__"]["kamera"])
    assert info == {
        "format": "1",
        "fingerprint": proc.FP,
        "kind": "canonical",
        "content_hash": proc.content_hash(7),
        "variant": "",
        "meta": {"index": "7"},
        "data_sha256": hashlib.sha256(blob[len(blob) - data :]).hexdigest(),  # the file vouches for itself
    }
    assert data == a.nbytes
    back = decode(blob, a.key, a.checksum)
    assert proc.same(back, a)
    assert back.tensors["k"].dtype == torch.bfloat16


def test_views_sharing_storage_and_odd_shapes_encode() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "k": base[:, :3],  # non-contiguous view
        "v": base[:, 3:],  # shares base's storage
        "t": base.t(),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 3, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    key = EntryKey(FP, EntryKind.VISION, HASH)
    back = decode(encode(key, tensors, {}), key, None)
    for name, t in tensors.items():
        assert back.tensors[name].dtype == t.dtype and back.tensors[name].shape == t.shape
        assert torch.equal(back.tensors[name], t), name


def test_decode_refuses_wrong_bytes_model_key_and_format(proc: ModuleType) -> None:
    e = proc.make_entry(1)
    blob = e.encode()
    flipped = bytearray(blob)
    flipped[-5] ^= 0xFF
    with pytest.raises(ChecksumError, match="checksum"):
        decode(bytes(flipped), e.key, e.checksum)
    other_model = EntryKey(proc.OTHER_FP, e.key.kind, e.key.content_hash)
    with pytest.raises(FingerprintMismatchError, match="written by model"):
        decode(blob, other_model, e.checksum)
    other_content = EntryKey(proc.FP, e.key.kind, proc.content_hash(2))
    with pytest.raises(StoreError, match="another key"):
        decode(blob, other_content, e.checksum)
    future = st_save({"a": torch.zeros(2)}, {"kamera": json.dumps({"format": "9", **e.key.to_meta()})})
    with pytest.raises(StoreError, match="format"):
        decode(future, e.key, None)
    foreign = st_save({"a": torch.zeros(2)})
    with pytest.raises(StoreError, match="no Kamera metadata"):
        decode(foreign, e.key, None)


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\x01\x00",
        struct.pack("<Q", 1 << 40) + b"{}",
        struct.pack("<Q", 4) + b"[1] ",
        struct.pack("<Q", 3) + b"{x}",
    ],
)
def test_malformed_headers_are_checksum_errors(blob: bytes) -> None:
    with pytest.raises(ChecksumError):
        read_header(blob)

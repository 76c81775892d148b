"""Authenticated entries: a keyed MAC that only holders of a fleet secret can write.

A shared store is an attack surface: a position-independent cache entry is loaded by every session whose
content hashes to it, so a poisoned canonical or patch steers all of them. The checksum does not help (a
writer computes it too). With a secret configured, every entry a backend writes carries an HMAC-SHA256
in its header, over the rest of the header (format, fingerprint, kind, content hash, variant, meta, cast
record) and the sha256 of its tensor data, hence over every byte of the entry but the tag itself. A
backend with a secret refuses an entry whose tag is missing or wrong (``UnauthenticatedEntryError``, a
``ChecksumError``): the store counts it, deletes it where it can, and the caller recomputes the entry.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from kamera_engine.errors import ChecksumError, InvalidInputError

#: The header field holding the tag.
MAC_FIELD = "mac"
#: Shortest secret accepted (bytes): a MAC is only as strong as its key.
MIN_SECRET_BYTES = 16


class UnauthenticatedEntryError(ChecksumError):
    """An entry read under a fleet secret carries no tag, or a tag that the secret did not make."""


class EntryAuth:
    """Makes and checks entry tags with one secret (str or bytes, at least 16 bytes)."""

    def __init__(self, secret: str | bytes) -> None:
        key = secret.encode() if isinstance(secret, str) else secret
        if not isinstance(key, bytes) or len(key) < MIN_SECRET_BYTES:
            raise InvalidInputError(f"a store secret must be str or bytes of at least {MIN_SECRET_BYTES} bytes")
        self._key = key

    def __repr__(self) -> str:
        return "EntryAuth(***)"

    def tag(self, header: dict[str, Any]) -> str:
        """The hex tag of an entry's Kamera header (its ``data_sha256`` included; any tag in it ignored)."""
        if not isinstance(header.get("data_sha256"), str):
            raise InvalidInputError("an entry is tagged over its data's sha256: the header has none")
        body = {k: v for k, v in header.items() if k != MAC_FIELD}
        message = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def sign(self, header: dict[str, Any]) -> dict[str, Any]:
        """``header`` with its tag added."""
        return {**header, MAC_FIELD: self.tag(header)}

    def verify(self, header: dict[str, Any], label: str) -> None:
        """Raise ``UnauthenticatedEntryError`` unless ``header`` carries the tag this secret makes."""
        given = header.get(MAC_FIELD)
        if not isinstance(given, str):
            raise UnauthenticatedEntryError(f"entry {label} carries no MAC: refused under this store's secret")
        try:
            want = self.tag(header)
        except InvalidInputError as exc:
            raise UnauthenticatedEntryError(f"entry {label}: {exc}") from None
        if not hmac.compare_digest(given, want):
            raise UnauthenticatedEntryError(f"entry {label}: its MAC was not made with this store's secret")

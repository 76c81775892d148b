"""Kamera's exceptions, in one place.

The tree (every class of this module; a test checks it against the classes)::

    KameraError
    ├── UnsupportedModelError          a model family, RoPE variant or feature the operator cannot serve exactly
    ├── ModelLoadError                 weights, config or tokenizer could not be found or loaded
    ├── InvalidInputError              malformed user input (bad ids, shapes, ranks, positions, arguments)
    │   ├── MediaError                 an image / video that cannot be used
    │   │   ├── ImageDecodeError           bytes that do not decode as an image (or a video)
    │   │   ├── MediaTooLargeError         a download, file or image over the size limit
    │   │   ├── MediaTypeError             a URL that answered with a content type that is not an image
    │   │   ├── RedirectError              a URL that redirected in a loop or too often
    │   │   ├── UnsupportedSchemeError     a URL whose scheme is not http or https
    │   │   └── MediaFetchError            a URL that could not be fetched (connection, timeout, HTTP status)
    │   └── ContextLengthError         a window, prompt and answer longer than the model's context
    ├── ChunkNotFoundError             a chunk id the window or store does not know (also a KeyError)
    ├── WindowOperationError           an operation that is invalid for the window's current state
    ├── KernelBuildError               the fused CPU kernel could not be built (KAMERA_KERNEL=c) or failed to run
    ├── CapacityError                  the scheduler's KV memory budget or queue is full (``retry_after_s``: a hint)
    ├── ConstraintError                constrained decoding left its grammar (a parser limit was hit)
    └── StoreError                     a stored entry that cannot be used
        ├── FingerprintMismatchError   an entry written by another model
        └── ChecksumError              an entry whose bytes do not match their checksum

``InvalidInputError`` is also a ``ValueError``. Lower-level errors (torch, transformers, sqlite, redis,
httpx) are converted at the boundary with ``raise ... from exc`` so callers only need to catch
``KameraError``. The SDK re-exports all of them.
"""

from __future__ import annotations


class KameraError(Exception):
    """Base class of every error Kamera raises on purpose."""


class UnsupportedModelError(KameraError):
    """The model (family, RoPE scaling, attention layout) is not supported exactly."""


class ModelLoadError(KameraError):
    """Weights, config or tokenizer could not be loaded."""


class InvalidInputError(KameraError, ValueError):
    """User input is malformed: it names the argument and what was wrong."""


class MediaError(InvalidInputError):
    """An image or video input could not be fetched or decoded."""


class ContextLengthError(InvalidInputError):
    """The positions asked for (window, prompt, answer) exceed the model's context length."""


class ChunkNotFoundError(KameraError, KeyError):
    """A chunk id is unknown to the window or the store."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "chunk not found"


class WindowOperationError(KameraError):
    """The operation is not valid for the window's current state (nothing was changed)."""


class ConstraintError(KameraError):
    """Constrained decoding could not go on: the grammar's matcher reached an error state."""


class StoreError(KameraError):
    """A stored entry could not be read or written."""


class FingerprintMismatchError(StoreError):
    """The entry was written by a different model (fingerprint differs)."""


class ChecksumError(StoreError):
    """The entry's bytes do not match the checksum recorded when it was written."""


__all__ = [
    "ChecksumError",
    "ChunkNotFoundError",
    "ConstraintError",
    "ContextLengthError",
    "FingerprintMismatchError",
    "InvalidInputError",
    "KameraError",
    "MediaError",
    "ModelLoadError",
    "StoreError",
    "UnsupportedModelError",
    "WindowOperationError",
]


# --- media inputs (images, video, URLs) -----------------------------------------------------------
class ImageDecodeError(MediaError):
    """The bytes are not an image PIL can decode (or a video PyAV can decode)."""


class MediaTooLargeError(MediaError):
    """A download, file or image exceeds the configured size limit."""


class MediaTypeError(MediaError):
    """A URL answered with a content type that is not an image."""


class RedirectError(MediaError):
    """A URL redirected in a loop or more often than allowed."""


class UnsupportedSchemeError(MediaError):
    """A URL whose scheme is not http or https."""


class MediaFetchError(MediaError):
    """A URL could not be fetched (connection error, timeout, HTTP error status)."""


__all__ += [
    "ImageDecodeError",
    "MediaFetchError",
    "MediaTooLargeError",
    "MediaTypeError",
    "RedirectError",
    "UnsupportedSchemeError",
]


class KernelBuildError(KameraError):
    """The fused CPU kernel was asked for (``KAMERA_KERNEL=c``) but could not be built or loaded, or it
    failed at run time (out of memory, bad arguments)."""


__all__ += ["KernelBuildError"]


class CapacityError(KameraError):
    """The engine's scheduler cannot take the work now: its KV memory budget or its queue is full.

    ``retry_after_s`` is a hint (seconds) for when to try again, or None when the request can never fit
    (it alone needs more than the whole budget). Nothing was started."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


__all__ += ["CapacityError"]

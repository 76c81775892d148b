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

``positive_int`` checks the argument every layer takes in some form (a count, a size, a bound: an int >= 1,
optionally None), so that each refuses it with the same words.
"""

from __future__ import annotations

import operator
from typing import Literal, overload


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


@overload
def positive_int(name: str, value: object, *, optional: Literal[False] = False) -> int: ...
@overload
def positive_int(name: str, value: object, *, optional: bool) -> int | None: ...
def positive_int(name: str, value: object, *, optional: bool = False) -> int | None:
    """``value`` as an int when it is a whole number of at least 1 (an int or anything ``operator.index`` takes;
    never a bool), or None when it is None and ``optional``; else InvalidInputError naming ``name``."""
    if value is None and optional:
        return None
    try:
        n = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        n = None
    if n is None or n < 1:
        raise InvalidInputError(f"{name} must be an int >= 1{' or None' if optional else ''}, got {value!r}")
    return n

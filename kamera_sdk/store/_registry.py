"""Persistent backends by URL scheme: ``open_store`` resolves a spec string through this table.

A backend module registers a factory for its schemes (``register_backend``); a new backend is then one
module plus its registration (and an import in ``__init__.py`` so the registration runs). A spec with no
``scheme://`` is a path and resolves through the ``file`` scheme.
"""

from __future__ import annotations

from typing import Protocol

from kamera_engine.errors import InvalidInputError

from ._backend import Backend

#: the scheme a plain path resolves through
PATH_SCHEME = "file"


class BackendFactory(Protocol):
    """Builds a backend from the whole spec string (a URL, or a path for ``file``) and the options
    ``open_store`` passes on; a factory refuses options its backend does not have (InvalidInputError)."""

    def __call__(self, spec: str, *, max_bytes: int | None, ttl_s: float | None) -> Backend: ...


#: scheme -> factory
BACKENDS: dict[str, BackendFactory] = {}


def register_backend(*schemes: str):  # type: ignore[no-untyped-def]
    """Decorator: make a factory the backend of ``scheme://...`` specs (and of paths, for ``file``)."""

    for scheme in schemes:
        if not scheme or not scheme.isascii() or "://" in scheme or scheme != scheme.lower():
            raise ValueError(f"a backend scheme is a lowercase name like 'redis', got {scheme!r}")

    def wrap(factory: BackendFactory) -> BackendFactory:
        for scheme in schemes:
            BACKENDS[scheme] = factory
        return factory

    return wrap


def scheme_of(spec: str) -> str:
    """The scheme of ``spec`` (``file`` for a plain path)."""
    head, sep, _ = spec.partition("://")
    return head.lower() if sep else PATH_SCHEME


def backend_for(spec: str, *, max_bytes: int | None, ttl_s: float | None) -> Backend:
    """The registered backend for ``spec``'s scheme."""
    scheme = scheme_of(spec)
    factory = BACKENDS.get(scheme)
    if factory is None:
        known = ", ".join(f"{s}://" for s in sorted(BACKENDS) if s != PATH_SCHEME)
        raise InvalidInputError(f"store URL scheme not supported: {spec!r} (use a path or {known})")
    return factory(spec, max_bytes=max_bytes, ttl_s=ttl_s)

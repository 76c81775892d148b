"""Compression policies (one file each, registered by name in ``COMPRESSORS``)."""

from . import david, elastic  # noqa: F401  (registration)
from .base import COMPRESSORS, CompressionInput, CompressionPolicy, make_compressor, register_compressor

__all__ = ["COMPRESSORS", "CompressionInput", "CompressionPolicy", "make_compressor", "register_compressor"]

"""Reuse policies, one file each, registered by name in ``POLICIES``."""

from . import blind, cacheblend, kamera, mpic, prefix, prefix_idle, recompute  # noqa: F401  (registration)
from .base import POLICIES, ReusePolicy, WindowView, make_policy, register_policy

__all__ = ["POLICIES", "ReusePolicy", "WindowView", "make_policy", "register_policy"]

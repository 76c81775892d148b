"""Model-family adapters, one file each, registered by ``config.model_type``.

Adding a family: write ``<family>.py`` with a ``ModelAdapter`` subclass decorated by ``@register``
and import it below.
"""

from . import gpt_neox, llama, mistral, phi, phi3, qwen2, qwen3  # noqa: F401  (registration)
from .base import ADAPTERS, ModelAdapter, adapter_for, register

__all__ = ["ADAPTERS", "ModelAdapter", "adapter_for", "register"]

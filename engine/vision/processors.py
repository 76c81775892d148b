"""Loading a VLM's processor by id or path.

``AutoProcessor`` is used when it loads. Some processors bundle a video processor that needs
torchvision; where that is missing, the tokenizer and the image processor are loaded on their own
(``AutoTokenizer``, ``AutoImageProcessor`` with the PIL backend) into an :class:`ImageTextProcessor`,
and the family expands the placeholders with the same rule as transformers' processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ModelLoadError


@dataclass(slots=True)
class ImageTextProcessor:
    """A tokenizer and an image processor, loaded separately (no video processor)."""

    tokenizer: Any
    image_processor: Any | None
    chat_template: str | None = None


def load_processor(path: str, **pretrained: Any) -> Any:
    """The processor of a VLM checkpoint (``AutoProcessor``, or tokenizer + image processor); ``pretrained``:
    keywords every ``from_pretrained`` takes (e.g. ``local_files_only``)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(path, **pretrained)
    except (ImportError, AttributeError, TypeError, ValueError, OSError):
        pass  # e.g. a bundled video processor that needs torchvision
    try:
        tok = AutoTokenizer.from_pretrained(path, **pretrained)
    except Exception as exc:
        raise ModelLoadError(f"could not load the tokenizer of {path}: {exc}") from exc
    try:
        image = AutoImageProcessor.from_pretrained(path, backend="pil", **pretrained)
    except Exception:
        image = None  # no PIL image processor for this family: the family preprocesses itself
    return ImageTextProcessor(tok, image, getattr(tok, "chat_template", None))

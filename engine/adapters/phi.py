"""Phi-1/1.5/2: MHA with partial rotary (``partial_rotary_factor``)."""

from .base import ModelAdapter, register


@register
class PhiAdapter(ModelAdapter):
    name = "phi"
    model_types = ("phi",)

    def max_context(self) -> int | None:
        return None

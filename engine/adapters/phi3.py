"""Phi-3: fused qkv projection, optional partial rotary; length-dependent ``longrope`` is refused."""

from .base import ModelAdapter, register


@register
class Phi3Adapter(ModelAdapter):
    name = "phi3"
    model_types = ("phi3",)

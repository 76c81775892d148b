"""Llama family (Llama 2/3, SmolLM2, TinyLlama): GQA, full rotary, rotate-half pairing."""

from .base import ModelAdapter, register


@register
class LlamaAdapter(ModelAdapter):
    name = "llama"
    model_types = ("llama",)

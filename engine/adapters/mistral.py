"""Mistral: Llama-style GQA; an optional sliding window bounds the window length we accept."""

from .base import ModelAdapter, register


@register
class MistralAdapter(ModelAdapter):
    name = "mistral"
    model_types = ("mistral",)

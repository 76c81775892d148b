"""Qwen2 / Qwen2.5 text models: GQA with biased q/k/v projections; rotate-half RoPE."""

from .base import ModelAdapter, register


@register
class Qwen2Adapter(ModelAdapter):
    name = "qwen2"
    model_types = ("qwen2",)

    def max_context(self) -> int | None:
        if not getattr(self.config, "use_sliding_window", False):
            return None
        return super().max_context()

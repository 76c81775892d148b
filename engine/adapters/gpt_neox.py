"""GPT-NeoX / Pythia: partial rotary (``rotary_pct``); the unrotated features pass through untouched."""

from torch import nn

from .base import ModelAdapter, register


@register
class GPTNeoXAdapter(ModelAdapter):
    name = "gpt_neox"
    model_types = ("gpt_neox",)

    def decoder(self, model: nn.Module) -> nn.Module:
        return model.gpt_neox

    def max_context(self) -> int | None:
        return None

"""Tiny random-weight VLM checkpoints, built in code, for tests, examples and mechanics checks.

Each builder writes a real checkpoint directory (``save_pretrained`` of the model, a word-level
tokenizer with the family's special tokens, and the family's image processor) so that loading goes
through the same ``from_pretrained`` path as a downloaded model. Nothing is fetched from a hub.

The weights are random (scaled up so attention is far from uniform and cross-chunk conditioning is
visible); the numbers they give are mechanics checks, not fidelity on trained weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

WORDS = [f"w{i}" for i in range(60)] + ["user", "assistant", "system", "image", "video", "frame", "Question:"]
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
] + [f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)]
VOCAB = 128  # text vocabulary of every tiny model (>= tokenizer size)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=32768,  # room for the mechanics check's farthest placement (30,000)
)


def tiny_tokenizer() -> Any:
    """A word-level fast tokenizer holding every family's special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*SPECIALS, "[UNK]", *WORDS])}
    assert len(vocab) <= VOCAB
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="[UNK]",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


#: 3-axis M-RoPE of the tiny Qwen-VL text models (t, h, w sections over 8 frequency pairs)
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}


def _qwen_vision_tokens(tok: Any) -> dict[str, int]:
    """The special-token ids every Qwen-VL config names."""
    return {
        "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>"),
    }


def _qwen_image_processor(patch: int) -> Any:
    """A Qwen-VL image processor sized for tiny images: 2 to 16 merged 2x2 patch groups."""
    import transformers as T

    side = 2 * patch
    return T.Qwen2VLImageProcessorPil(
        min_pixels=side * side * 2, max_pixels=side * side * 16, patch_size=patch, merge_size=2
    )


def _text(tok: Any, **extra: Any) -> dict[str, Any]:
    ids = dict(bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return {**_TEXT, **ids, **extra}


def _scale(model: torch.nn.Module, factor: float = 4.0) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(factor)


def _qwen2_vl(tok: Any) -> tuple[Any, Any]:
    import transformers as T

    cfg = T.Qwen2VLConfig(
        text_config=_text(tok, rope_parameters=dict(_MROPE)),
        vision_config=dict(
            depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2
        ),
        **_qwen_vision_tokens(tok),
    )
    ip = _qwen_image_processor(patch=14)
    return T.Qwen2VLForConditionalGeneration(cfg), ip


def _qwen2_5_vl(tok: Any) -> tuple[Any, Any]:
    import transformers as T

    cfg = T.Qwen2_5_VLConfig(
        text_config=_text(tok, rope_parameters=dict(_MROPE)),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
        ),
        **_qwen_vision_tokens(tok),
    )
    ip = _qwen_image_processor(patch=14)
    return T.Qwen2_5_VLForConditionalGeneration(cfg), ip


def _qwen3_vl(tok: Any) -> tuple[Any, Any]:
    import transformers as T

    cfg = T.Qwen3VLConfig(
        text_config=_text(
            tok,
            num_hidden_layers=3,
            head_dim=16,
            rope_parameters=dict(_MROPE),
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=16,
            spatial_merge_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        ),
        **_qwen_vision_tokens(tok),
    )
    ip = _qwen_image_processor(patch=16)
    return T.Qwen3VLForConditionalGeneration(cfg), ip


def _idefics3(tok: Any) -> tuple[Any, Any]:
    import transformers as T

    cfg = T.Idefics3Config(
        text_config=T.LlamaConfig(**_text(tok)),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=56,
            patch_size=14,
        ),
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    ip = T.Idefics3ImageProcessorPil(
        size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, do_image_splitting=True
    )
    return T.Idefics3ForConditionalGeneration(cfg), ip


def _kimi_k25(tok: Any) -> tuple[Any, Any]:
    import transformers as T

    text = _text(
        tok,
        model_type="deepseek_v3",
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,
        rope_interleave=True,
    )
    cfg = T.Kimi_K25Config(
        text_config=text,
        vision_config=dict(
            patch_size=14,
            pos_emb_height=8,
            pos_emb_width=8,
            num_attention_heads=2,
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
            merge_kernel_size=[2, 2],
        ),
        projection_hidden_size=32,
        image_token_id=tok.convert_tokens_to_ids("<|media_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|media_begin|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|media_end|>"),
        tie_word_embeddings=False,
    )
    return T.Kimi_K25ForConditionalGeneration(cfg), None  # its image processor needs torchvision


def _llava(tok: Any) -> tuple[Any, Any]:
    import transformers as T

    cfg = T.LlavaConfig(
        text_config=T.LlamaConfig(**_text(tok)),
        vision_config=T.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=42,
            patch_size=14,
        ),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=9,
    )
    ip = T.CLIPImageProcessorPil(size={"shortest_edge": 42}, crop_size={"height": 42, "width": 42})
    return T.LlavaForConditionalGeneration(cfg), ip


BUILDERS: dict[str, Callable[[Any], tuple[Any, Any]]] = {
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_5_vl,
    "llava": _llava,
    "qwen3_vl": _qwen3_vl,
    "idefics3": _idefics3,
    "kimi_k25": _kimi_k25,
}


def build_tiny_vlm(family: str, directory: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random checkpoint of ``family`` to ``directory``; returns the path."""
    if family not in BUILDERS:
        raise KeyError(f"no tiny builder for {family!r}; have {sorted(BUILDERS)}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    model, image_processor = BUILDERS[family](tok)
    _scale(model)
    model.eval()
    if family in _RAW_SAVE:
        _save_raw(model, path)
    else:
        model.save_pretrained(path)
    tok.save_pretrained(path)
    if image_processor is not None:
        image_processor.save_pretrained(path)
    processor = _processor(family, tok, image_processor)
    if processor is not None:
        processor.save_pretrained(path)
    return path


#: families whose ``save_pretrained`` rewrites keys it cannot read back (transformers 5.23 applies the
#: Kimi-K2.5 checkpoint-conversion renames in reverse to the language model too: ``layers`` -> ``blocks``,
#: ``self_attn.q_proj`` -> ``self_wqkv``); their weights are written as the plain state dict, which the
#: forward conversion leaves untouched, and loaded through ``from_pretrained`` as usual.
_RAW_SAVE = frozenset({"kimi_k25"})


def _save_raw(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def _processor(family: str, tok: Any, image_processor: Any) -> Any | None:
    """The family's transformers processor when it can be built here (some need torchvision)."""
    import transformers as T

    if family == "llava":
        return T.LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tok,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,  # CLIP's class token
            chat_template=CHAT_TEMPLATE,
        )
    if family == "idefics3":
        return T.Idefics3Processor(
            image_processor=image_processor, tokenizer=tok, image_seq_len=4, chat_template=CHAT_TEMPLATE
        )
    return None

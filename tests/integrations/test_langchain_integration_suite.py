"""LangChain's standard integration suite (``ChatModelIntegrationTests``) on ChatKamera, default model.

Capabilities are declared as they are: tool calling, tool choice, structured output and JSON mode through
constrained decoding; no image inputs (ChatKamera refuses image parts on every engine), no PDF or audio, no
per-call model override. ``max_tokens=100`` (the value of LangChain's standard parameters) leaves structured
answers room to close.

The tool-choice, JSON-mode and structured-output tests pass: the grammar writes properties in the schema's
order with the usual separators, the loop guard closes a string that repeats itself, and JSON mode says its
rule in a system turn. ``test_agent_loop`` needs a call under ``tool_choice='auto'``, a judgement the grammar
does not make: ChatKamera's default ``auto_tool_policy="relevance"`` makes it from the model's likelihoods
(``kamera_sdk.auto_tools``; its accuracy on a prompt set of our own is in ``docs/langchain.md``).
"""

from __future__ import annotations

from typing import Any

import pytest
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

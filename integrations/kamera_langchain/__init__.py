"""LangChain integration for Kamera: ``ChatKamera``, a chat model whose conversation is a ``ContextWindow``.

    from kamera_langchain import ChatKamera
    llm = ChatKamera(max_tokens=32)          # embedded default model, loaded on first use
    llm.invoke("Hello!")

Needs ``langchain-core`` (``pip install 'kamera[langchain]'``). See docs/langchain.md.
"""

try:
    import langchain_core  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kamera_langchain needs langchain-core: pip install 'kamera[langchain]'") from exc

from kamera_sdk import ChatFormat

from ._messages import ImageInputError
from .chat_models import ChatKamera, load_engine

__all__ = ["ChatFormat", "ChatKamera", "ImageInputError", "load_engine"]

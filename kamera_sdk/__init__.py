"""Kamera: a position-free KV cache for multimodal agents.

Store each chunk's KV once, position-free; place it anywhere with an exact RoPE rotation and a small
rank-m conditioning patch. ``ContextWindow`` treats an agent's context as a set of such chunks.

    from kamera_sdk import Engine, ContextWindow
    engine = Engine.load()
    win = ContextWindow(engine)
"""

from kamera_engine import (
    KV,
    AsyncTextStream,
    CapacityError,
    ChecksumError,
    ChunkNotFoundError,
    ConstraintError,
    ContextLengthError,
    Engine,
    EngineInfo,
    FingerprintMismatchError,
    Grammar,
    InvalidInputError,
    KameraError,
    KernelBuildError,
    MediaError,
    ModelLoadError,
    Patch,
    SamplingParams,
    StoreError,
    TextStream,
    UnsupportedModelError,
    WindowOperationError,
)

from .aio import to_thread
from .auto_tools import AUTO_TOOL_POLICIES, auto_grammar, relevant_tools, text_grammar, tool_relevance
from .chat_format import ChatFormat
from .chunks import ChunkId
from .config import WindowConfig
from .envelope import EnvelopeConfig, EnvelopeDecision
from .plan import Plan, Source
from .policies import POLICIES, ReusePolicy, register_policy
from .stats import WindowStats
from .store import ChunkStore, open_store
from .tools import (
    JSON_MODE_PROMPT,
    ToolCall,
    ToolSpec,
    answer_prompt,
    closed_schema,
    json_grammar,
    parse_tool_call,
    tool_grammar,
    tools_prompt,
)
from .version import __version__
from .window import ContextWindow, DisposabilityResult


def __getattr__(name: str) -> object:
    """``RemoteWindow`` / ``AsyncRemoteWindow`` load lazily, so importing the SDK does not need httpx; the
    server's ``create_app`` and its ``SessionCreate`` options (for hosts such as the fleet) need FastAPI."""
    if name in ("RemoteWindow", "AsyncRemoteWindow"):
        from .server import client

        return getattr(client, name)
    if name == "create_app":
        from .server.app import create_app

        return create_app
    if name == "SessionCreate":
        from .server.schemas import SessionCreate

        return SessionCreate
    raise AttributeError(f"module 'kamera_sdk' has no attribute {name!r}")


__all__ = [
    "AUTO_TOOL_POLICIES",
    "JSON_MODE_PROMPT",
    "KV",
    "POLICIES",
    "AsyncRemoteWindow",
    "AsyncTextStream",
    "CapacityError",
    "ChatFormat",
    "ChecksumError",
    "ChunkId",
    "ChunkNotFoundError",
    "ChunkStore",
    "ConstraintError",
    "ContextLengthError",
    "ContextWindow",
    "DisposabilityResult",
    "Engine",
    "EngineInfo",
    "EnvelopeConfig",
    "EnvelopeDecision",
    "FingerprintMismatchError",
    "Grammar",
    "InvalidInputError",
    "KameraError",
    "KernelBuildError",
    "MediaError",
    "ModelLoadError",
    "Patch",
    "Plan",
    "RemoteWindow",
    "ReusePolicy",
    "SamplingParams",
    "SessionCreate",
    "Source",
    "StoreError",
    "TextStream",
    "ToolCall",
    "ToolSpec",
    "UnsupportedModelError",
    "WindowConfig",
    "WindowOperationError",
    "WindowStats",
    "__version__",
    "answer_prompt",
    "auto_grammar",
    "closed_schema",
    "create_app",
    "json_grammar",
    "open_store",
    "parse_tool_call",
    "register_policy",
    "relevant_tools",
    "text_grammar",
    "to_thread",
    "tool_grammar",
    "tool_relevance",
    "tools_prompt",
]

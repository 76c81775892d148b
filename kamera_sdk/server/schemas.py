"""Request and response models of the engine server (pydantic), shared by the app and the client.

Kamera's own endpoints forbid unknown fields (a typo is an error, not a silent default) and values of
another JSON type (no coercion of "1" or true to an int); the OpenAI-compatible endpoint ignores
fields it does not use, so drop-in clients keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kamera_engine.vision import VisionCacheStats

#: A chunk id as the SDK makes them (a content hash); the length bound only keeps junk out early.
ChunkIdStr = Annotated[str, Field(min_length=1, max_length=128)]
Prompt = str | list[int]


class _Strict(BaseModel):
    # strict: a JSON value of another type is refused, never coerced ("1" or true for an int); an int
    # is still a valid float
    model_config = ConfigDict(extra="forbid", strict=True)


# --- Kamera's own API ------------------------------------------------------------------------------
class SessionCreate(_Strict):
    """Options of a new session's ``ContextWindow``."""

    policy: str = Field("kamera", max_length=64, description="reuse policy: kamera, recompute, prefix, blind, ...")
    rank: int = Field(32, ge=1, le=4096, description="patch rank m")
    budget_tokens: int | None = Field(None, ge=1, description="slide the oldest chunks out above this many tokens")
    compress: str | None = Field(None, max_length=64, description="compression policy: elastic or david")
    kv_budget: float | None = Field(None, gt=0, le=1, description="KV fraction kept by the compression policy")


class WindowState(BaseModel):
    """A session's window: chunk ids in order, and the evicted (recallable) ones."""

    session: str
    policy: str
    chunks: list[str]
    evicted: list[str]
    tokens: int = Field(description="tokens in the window's chunks")


class ChunkAdd(_Strict):
    """One chunk: exactly one of ``text``, ``token_ids`` or ``image_base64``."""

    text: str | None = None
    token_ids: list[int] | None = None
    kind: str = Field("tokens", max_length=32, description="chunk kind for token ids")
    image_base64: str | None = Field(None, description="an image's bytes, base64 (VLM engines only)")

    @model_validator(mode="after")
    def _exactly_one(self) -> ChunkAdd:
        given = [n for n in ("text", "token_ids", "image_base64") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of text, token_ids, image_base64 (got {given or 'none'})")
        return self


class ChunkAdded(BaseModel):
    """The id of the added chunk and the window after the add."""

    chunk: str
    window: WindowState


class ChunkRef(_Strict):
    """A chunk of this session (``evict``)."""

    chunk: ChunkIdStr


class RecallRequest(_Strict):
    """Re-admit an evicted chunk at slot ``at`` (default: the end)."""

    chunk: ChunkIdStr
    at: int | None = Field(None, ge=0)


class ReorderRequest(_Strict):
    """A permutation of the window's chunk ids, or ``"auto"``."""

    order: list[ChunkIdStr] | Literal["auto"]


class SlideRequest(_Strict):
    """Drop the oldest ``n`` chunks."""

    n: int = Field(1, ge=0)


class ForkRequest(_Strict):
    """A fork takes no options (an empty body, or none)."""


class SlideResult(BaseModel):
    """The chunks that left, and the window after."""

    removed: list[str]
    window: WindowState


class SessionCreated(BaseModel):
    """A new session's id (an unguessable token: treat it as a secret) and its window."""

    id: str
    window: WindowState


class GenerateRequest(_Strict):
    """Decode an answer to ``prompt`` over the window (greedy by default)."""

    prompt: Prompt
    max_new_tokens: int = Field(64, ge=0)
    stream: bool = False
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: list[str] | None = Field(None, max_length=16)
    seed: int | None = None


class GenerateResult(BaseModel):
    """A whole (non-streamed) answer: its text, the tokens decoded (an ending EOS included) and why it
    ended (``stop``: EOS or a stop string; ``length``: ``max_new_tokens``)."""

    text: str
    tokens: int
    finish_reason: Literal["stop", "length"]


class LogprobsRequest(_Strict):
    """Next-token log-probabilities after ``prompt``: the full vector, or the ``top_k`` best tokens."""

    prompt: Prompt
    top_k: int | None = Field(None, ge=1, le=1000)


class TopToken(BaseModel):
    """One candidate next token."""

    token_id: int
    token: str
    logprob: float


class LogprobsResult(BaseModel):
    """``logprobs`` (vocab,) when no ``top_k`` was asked, else ``top`` (best first)."""

    vocab_size: int
    logprobs: list[float] | None = None
    top: list[TopToken] | None = None


class ServerStats(BaseModel):
    """What the server's sessions hold, against its limits."""

    sessions: int = Field(description="open sessions, chat windows included")
    max_sessions: int
    held_tokens: int = Field(description="tokens all sessions hold (or claimed) together: placed, and content seen")
    max_held_tokens: int | None = Field(description="the bound of held_tokens (null: no limit)")
    vision_cache: VisionCacheStats | None = Field(
        None, description="on a vision-language model: the tower's rows in memory against their bound, on disk, runs"
    )


class Health(BaseModel):
    """Liveness: the server is up and which model it serves."""

    status: Literal["ok"] = "ok"
    model: str


# --- OpenAI-compatible chat completions ------------------------------------------------------------
class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Lenient):
    url: str
    detail: str | None = None


class ContentPart(_Lenient):
    """A part of a message: ``text`` or ``image_url`` (``data:`` URLs only)."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class JSONSchemaFormat(_Lenient):
    name: str = "answer"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """``text`` (free), ``json_object`` (any JSON object) or ``json_schema`` (valid under its schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(_Lenient):
    """The subset of OpenAI's request Kamera serves; other fields are accepted and ignored.

    ``session``: a session id from ``POST /v1/sessions`` whose window holds the conversation;
    otherwise ``user`` keys a window of its own; with neither, the window lives for this request only.
    ``temperature`` defaults to 0 (greedy), unlike OpenAI's 1. ``auto_tool_policy`` (Kamera's): who decides
    between a call and text under ``tool_choice="auto"``: ``"model"`` (its first token, OpenAI's semantics,
    the default) or ``"relevance"`` (the model's likelihoods before decoding, ``kamera_sdk.auto_tools``).
    """

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    session: str | None = Field(None, max_length=128)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    auto_tool_policy: Literal["model", "relevance"] = "model"


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatCompletionMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="context tokens served from stored KV instead of prefilled")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(ToolCallOut):
    index: int = 0


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kamera"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- OpenAI-compatible (legacy) completions --------------------------------------------------------
class CompletionRequest(_Lenient):
    """The subset of OpenAI's legacy completions request Kamera serves; other fields are ignored.

    ``prompt``: one text or one list of token ids (a list holding one of them is accepted too).
    ``session``: continue after that session's window; without it the prompt is read with no context
    at all, a plain language-model continuation. ``logprobs``: the top-k alternatives per token (0-5).
    ``echo``: return (and score) the prompt too. ``temperature`` defaults to 0 (greedy), unlike OpenAI's 1.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    session: str | None = Field(None, max_length=128)


class CompletionLogprobs(BaseModel):
    """Per returned token: its text, log-probability (None for a first token with no context before it),
    the ``logprobs`` best alternatives, and its character offset in the returned text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None

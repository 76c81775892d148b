"""``ChatKamera``: a LangChain chat model whose conversation lives in a Kamera ``ContextWindow``.

Each message is one position-free chunk. A call diffs its message list against the session's window:
messages already there are reused, dropped ones (``trim_messages``) slide out or are evicted, a new order
is a ``reorder``, new messages are appended. Only what the reuse policy cannot serve from stored KV is
prefilled; ``response_metadata["kamera"]`` says how much that was.

With ``base_url`` the windows live on a ``kamera serve`` server instead (one server session per
``session_id``, reached through ``kamera_sdk.RemoteWindow``): the server's chat endpoint makes the window
hold the message list with the same reuse, so several agents and apps share one engine.

``bind_tools`` and ``with_structured_output`` hold the answer to a grammar (``kamera_sdk.tool_grammar``,
``json_grammar``): a tool call or a JSON document that parses, whatever the model's size.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolCall
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import Field, PrivateAttr, field_validator, model_validator

from kamera_sdk import (
    AUTO_TOOL_POLICIES,
    POLICIES,
    ChatFormat,
    ChunkStore,
    ContextWindow,
    Engine,
    EnvelopeConfig,
    InvalidInputError,
    RemoteWindow,
    SamplingParams,
    TextStream,
    WindowConfig,
    answer_prompt,
    auto_grammar,
    open_store,
    to_thread,
)

from ._conversation import Conversation, SyncReport, stats_delta
from ._messages import message_payload, message_role, message_text
from ._structured import structured
from ._tools import (
    AnswerShape,
    answer_shape,
    choice_name,
    remote_tool_choice,
    tool_chunk,
    tool_message,
    tool_specs,
)

#: Name reported before the default engine is loaded (``Engine.load()`` names it the same).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_CALL_KWARGS = frozenset(
    {"session_id", "max_tokens", "temperature", "top_p", "seed", "tools", "tool_choice", "response_format"}
)

_load_lock = threading.Lock()
_loaded: dict[tuple[str | None, str | None], Engine] = {}
#: base engine -> (chat-anchored engine, or None when the base anchor already fits; format)
_chat_engines: weakref.WeakKeyDictionary[Engine, tuple[Engine | None, ChatFormat]] = weakref.WeakKeyDictionary()


def load_engine(model: str | None = None, device: str | None = None) -> Engine:
    """``Engine.load(model, device=device)``, once per process: every ChatKamera on it shares the weights."""
    with _load_lock:
        if (model, device) not in _loaded:
            _loaded[(model, device)] = Engine.load(model, device=device)
        return _loaded[(model, device)]


def chat_engine(base: Engine) -> tuple[Engine, ChatFormat]:
    """The engine whose anchor is the chat template's preamble (BOS and default system turn), and the format.

    The default engine anchor also opens a user turn (``generate("question")`` closes it); a chat window
    holds whole turns, so its anchor stops before that header. Same weights, so no copy is made.
    """
    if base.tokenizer is None:
        raise InvalidInputError("ChatKamera needs an engine with a tokenizer (and ideally a chat template)")
    with _load_lock:
        hit = _chat_engines.get(base)
        if hit is None:
            fmt = ChatFormat.from_tokenizer(base.tokenizer)
            anchor = base.tokenize(fmt.anchor) if fmt.anchor else []
            derived = None
            if anchor != list(base.anchor_ids):
                tok, attn = base.tokenizer, base.attention
                derived = Engine(
                    base.model,
                    tok,
                    name=base.name,
                    anchor_ids=anchor,
                    attention=attn,
                    linear_backend=base.linear_backend,  # the model it shares is packed, or not, already
                )
            hit = _chat_engines[base] = (derived, fmt)
        if hit[0] is not None:
            hit[0].context_length = base.context_length  # a limit set on the base engine holds here too
        return (base if hit[0] is None else hit[0]), hit[1]


@dataclass(slots=True)
class _Call:
    """One model call: what to send and, once decoded, what it cost."""

    conversation: Conversation
    texts: list[str]
    prompt: list[int]
    sampling: dict[str, Any]
    session: str
    report: SyncReport = field(default_factory=SyncReport)
    input_tokens: int = 0
    delta: dict[str, int] = field(default_factory=dict)
    computed: int = 0  # window tokens a forward computed this call (WindowStats.computed_since)
    chunks: int = 0
    stream: TextStream | None = None  # the answer's decode: its tokens and finish_reason
    shape: AnswerShape = field(default_factory=AnswerShape)  # tools it may call, grammar it is held to


class ChatKamera(BaseChatModel):
    """Chat model over a Kamera ``ContextWindow`` (one window per ``session_id``).

    ``engine``: a loaded ``kamera_sdk.Engine`` to share; otherwise ``model`` (Hugging Face id or local path,
    None: the embedded default SmolLM2-135M-Instruct) is loaded on first use. ``policy``/``rank``/
    ``budget_tokens`` configure each window; ``store`` (a path, a ``redis://`` URL, ``"default"`` or a
    ``ChunkStore``) keeps canonicals and patches across windows and processes. ``base_url`` (with ``api_key``)
    runs every window on a ``kamera serve`` server instead of loading a model here. ``auto_tool_policy``: who
    decides between a call and text under ``tool_choice="auto"`` (``"relevance"``: the tools' relevance to the
    request in the model's likelihoods, ``kamera_sdk.auto_tools``; ``"model"``: its first token).
    Pass ``session_id="..."`` per call (or in the run metadata, ``session_id`` or ``thread_id``) to keep
    conversations apart.

    Example:
        .. code-block:: python

            from kamera_langchain import ChatKamera
            llm = ChatKamera(max_tokens=32)
            llm.invoke("What is the capital of France?").content

            remote = ChatKamera(base_url="http://127.0.0.1:8765", api_key="...")  # a running `kamera serve`
    """

    engine: Engine | None = Field(default=None, exclude=True, description="a loaded engine to use (shared)")
    model: str | None = Field(default=None, description="HF id or path loaded when no engine is given")
    device: str | None = Field(default=None, description="device for a model loaded here (default: cuda if any)")
    policy: str = Field(default="kamera", description="reuse policy of each window (kamera, recompute, ...)")
    rank: int = Field(default=32, ge=1, description="patch rank m")
    budget_tokens: int | None = Field(default=None, ge=1, description="window slides oldest chunks above this")
    max_dropped: int = Field(
        default=16,
        ge=0,
        description="messages that may leave from in front of a message (trimming behind the system message) "
        "while it keeps its conditioned KV, as a slide survivor does; more is rebuilt",
    )
    max_tokens: int = Field(default=256, ge=1, description="maximum new tokens per reply")
    temperature: float = Field(default=0.0, ge=0.0, description="0: greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    streaming: bool = False
    auto_tool_policy: str = Field(
        default="relevance",
        description="who decides between a call and text under tool_choice='auto': 'relevance' (the tools' "
        "relevance to the request in the model's own likelihoods, decided before decoding) or 'model' (the "
        "model's first token under a call-or-text grammar)",
    )
    session_id: str = Field(default="default", description="session used when a call names none")
    store: str | ChunkStore | None = Field(
        default=None, exclude=True, description="in-process windows share this store (path, URL or ChunkStore)"
    )
    base_url: str | None = Field(default=None, description="a kamera serve URL: windows live on that server")
    api_key: str | None = Field(default=None, exclude=True, repr=False, description="the server's API key")

    _engine: Engine | None = PrivateAttr(default=None)
    _sessions: dict[str, Conversation] = PrivateAttr(default_factory=dict)
    _remote: dict[str, RemoteWindow] = PrivateAttr(default_factory=dict)
    _store: ChunkStore | None = PrivateAttr(default=None)
    _remote_model: str = PrivateAttr(default="kamera-server")  # the server's model name, once it answered
    _sessions_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; registered: {sorted(POLICIES)}")
        return v

    @field_validator("auto_tool_policy")
    @classmethod
    def _known_auto_policy(cls, v: str) -> str:
        if v not in AUTO_TOOL_POLICIES:
            raise ValueError(f"auto_tool_policy must be one of {AUTO_TOOL_POLICIES}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _one_place(self) -> ChatKamera:
        if self.base_url is not None and (self.engine is not None or self.model is not None or self.store is not None):
            raise ValueError("base_url runs the model on the server: leave engine, model and store to the server")
        return self

    # --- LangChain identity --------------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "kamera-chat"

    @property
    def model_name(self) -> str:
        """The model's name (without loading it)."""
        eng = self.engine or self._engine
        if eng is not None:
            return eng.name
        return self.model or (self._remote_model if self.base_url is not None else DEFAULT_MODEL_NAME)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "policy": self.policy,
            "rank": self.rank,
            "budget_tokens": self.budget_tokens,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="kamera",
            ls_model_name=kwargs["model"] if isinstance(kwargs.get("model"), str) else self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    # --- engine, windows, token counting -------------------------------------------------------
    def _chat(self) -> tuple[Engine, ChatFormat]:
        if self.base_url is not None:
            raise InvalidInputError("this ChatKamera runs on a server (base_url): there is no engine or tokenizer here")
        if self._engine is None:
            self._engine = self.engine or load_engine(self.model, self.device)
        return chat_engine(self._engine)

    def window(self, session_id: str | None = None) -> ContextWindow | RemoteWindow:
        """The window of a session (created empty if new): inspect ``stats()``, ``chunks``... A
        ``RemoteWindow`` on the server's session when ``base_url`` is set."""
        session = session_id or self.session_id
        if self.base_url is not None:
            return self._remote_window(session)
        return self._conversation(session).window

    @property
    def sessions(self) -> list[str]:
        """Session ids with a window."""
        with self._sessions_lock:
            return [*self._sessions, *self._remote]

    def reset(self, session_id: str | None = None) -> None:
        """Forget one session's window (all of them when ``session_id`` is None); a server session is deleted."""
        with self._sessions_lock:
            names = list({*self._sessions, *self._remote}) if session_id is None else [session_id]
            self._sessions = {k: v for k, v in self._sessions.items() if k not in names}
            closing = [self._remote.pop(k) for k in names if k in self._remote]
        for remote in closing:
            remote.close()

    def _remote_window(self, session: str) -> RemoteWindow:
        """The server session of ``session``, created with this model's window options on first use."""
        with self._sessions_lock:
            win = self._remote.get(session)
            if win is None:
                assert self.base_url is not None
                win = RemoteWindow(
                    self.base_url,
                    api_key=self.api_key,
                    policy=self.policy,
                    rank=self.rank,
                    budget_tokens=self.budget_tokens,
                )
                self._remote[session] = win
            return win

    def _shared_store(self) -> ChunkStore | None:
        """The store every in-process window of this model shares (a path or URL is opened once)."""
        if self.store is None or isinstance(self.store, ChunkStore):
            return self.store
        if self._store is None:
            self._store = open_store(self.store)
        return self._store

    def _conversation(self, session: str) -> Conversation:
        engine, _ = self._chat()
        with self._sessions_lock:
            conv = self._sessions.get(session)
            if conv is None:
                config = WindowConfig(
                    rank=self.rank,
                    budget_tokens=self.budget_tokens,
                    envelope=EnvelopeConfig(max_dropped=self.max_dropped),
                )
                window = ContextWindow(engine, policy=self.policy, config=config, store=self._shared_store())
                conv = Conversation(window)
                self._sessions[session] = conv
            return conv

    def render(self, messages: Sequence[BaseMessage]) -> list[str]:
        """Each message as the chunk text it becomes (template turn markers included)."""
        _, fmt = self._chat()
        return [fmt.render(message_role(m), message_text(m)) for m in messages]

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` under the engine's tokenizer."""
        engine, _ = self._chat()
        return engine.tokenize(text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Tokens the messages occupy in the window (exact: the rendered chunks), with ``tools`` the turn that
        describes them. For ``trim_messages``."""
        engine, fmt = self._chat()
        shape = answer_shape([convert_to_openai_tool(t) for t in tools], "auto", None) if tools else AnswerShape()
        return sum(len(engine.tokenize(t)) for t in self._texts(messages, shape, fmt))

    def _texts(self, messages: Sequence[BaseMessage], shape: AnswerShape, fmt: ChatFormat) -> list[str]:
        """The call's chunk texts: the tools' description turn (when it may call tools) or JSON mode's rule,
        then each message."""
        about = answer_prompt(shape.tools, shape.choice, json_mode=shape.json_mode)  # as the server's chat endpoint
        head = [fmt.render("system", about)] if about is not None else []
        return head + [fmt.render(message_role(m), message_text(m)) for m in messages]

    # --- tools and structured output -----------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` it may call (LangChain tools, pydantic models, functions or OpenAI tool
        dicts). ``tool_choice``: ``None``/``"auto"`` (a call or a text answer, the model decides), ``"any"``
        or ``"required"`` (a call of one of them), a tool's name (a call of that one), ``"none"``. Every call
        is decoded under the tools' grammar, so it parses and its arguments follow the tool's schema (objects
        that list their properties admit no others). Tool names must be unique when the model is called."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        choice = choice_name(tool_choice)
        names = [t.name for t in tool_specs(formatted)]  # a bad tool is refused now
        if choice not in ("auto", "required", "none") and choice not in names:
            raise InvalidInputError(f"tool_choice names {choice!r}, which is not among the tools {names}")
        return self.bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: str = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """This model answering with ``schema`` (a pydantic model: instances; a TypedDict or JSON schema:
        dicts). ``method``: ``"json_schema"`` (decoded under the schema), ``"function_calling"`` (a forced
        call of a tool whose arguments are the schema) or ``"json_mode"`` (any JSON object, parsed with the
        schema). ``include_raw``: ``{"raw", "parsed", "parsing_error"}``. Decoding is always strict, so
        ``strict`` changes nothing."""
        if kwargs:
            raise InvalidInputError(f"with_structured_output got unsupported arguments {sorted(kwargs)}")
        return structured(self, schema, method, include_raw)

    # --- calls ---------------------------------------------------------------------------------
    def _session_and_sampling(
        self, stop: list[str] | None, run_manager: CallbackManagerForLLMRun | None, kwargs: dict[str, Any]
    ) -> tuple[str, dict[str, Any], AnswerShape]:
        """The call's session, sampling options and answer shape, checked before any window is touched."""
        unknown = set(kwargs) - _CALL_KWARGS
        if unknown:
            raise InvalidInputError(f"ChatKamera got unsupported call arguments {sorted(unknown)}")
        metadata = run_manager.metadata if run_manager is not None else {}
        session = str(
            kwargs.get("session_id") or metadata.get("session_id") or metadata.get("thread_id") or self.session_id
        )
        stop_seqs = stop if stop is not None else self.stop

        def given(name: str, default: Any) -> Any:
            value = kwargs.get(name)
            return default if value is None else value

        sampling = {
            "max_new_tokens": given("max_tokens", self.max_tokens),
            "temperature": given("temperature", self.temperature),
            "top_p": given("top_p", self.top_p),
            "seed": kwargs.get("seed", self.seed),
            "stop": list(stop_seqs) if stop_seqs else None,
        }
        SamplingParams(**{**sampling, "stop": tuple(sampling["stop"] or ())}).validate()
        shape = answer_shape(kwargs.get("tools"), kwargs.get("tool_choice"), kwargs.get("response_format"))
        return session, sampling, shape

    def _prepare(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
    ) -> _Call:
        session, sampling, shape = self._session_and_sampling(stop, run_manager, kwargs)
        engine, fmt = self._chat()
        texts = self._texts(messages, shape, fmt)  # raises on image parts before anything changes
        if shape.calls_tools and shape.choice == "auto" and self.auto_tool_policy == "relevance":
            shape = self._auto_decided(messages, shape, engine, fmt)
        conv, prompt = self._conversation(session), engine.tokenize(fmt.generation)
        win = conv.window
        if win.config.budget_tokens is None:  # the window will hold exactly these messages: fit them now
            held = len(win.engine.anchor_ids) + sum(len(win.engine.tokenize(t)) for t in texts)
            win.engine.check_length(held + len(prompt), new_tokens=sampling["max_new_tokens"])
        return _Call(conv, texts, prompt, {**sampling, "grammar": shape.grammar}, session, shape=shape)

    def _auto_decided(
        self, messages: Sequence[BaseMessage], shape: AnswerShape, engine: Engine, fmt: ChatFormat
    ) -> AnswerShape:
        """``tool_choice="auto"`` under the ``relevance`` policy (``kamera_sdk.auto_tools``): a call of one of
        the tools relevant to the last user message and not called since it, or text when none is left. The
        tools turn stays as it is (the same chunk); only the grammar changes."""
        last = max((i for i, m in enumerate(messages) if isinstance(m, HumanMessage)), default=None)
        if last is None:  # no request to measure relevance against: the model decides
            return shape
        called = [c["name"] for m in messages[last + 1 :] if isinstance(m, AIMessage) for c in m.tool_calls]
        grammar = auto_grammar(engine, fmt.render, message_text(messages[last]), shape.tools, called)
        return dataclasses.replace(shape, grammar=grammar)

    def _decode(self, call: _Call) -> Iterator[str]:
        """Bring the window to the message list, then stream the reply (the session is locked meanwhile)."""
        conv = call.conversation
        with conv.lock:
            win = conv.window
            before = win.stats()
            call.report = conv.sync(call.texts)
            call.chunks = len(win)
            call.input_tokens = len(win.engine.anchor_ids) + win.tokens + len(call.prompt)
            call.stream = win.generate(call.prompt, stream=True, **call.sampling)
            yield from call.stream
            after = win.stats()
            call.delta, call.computed = stats_delta(before, after), after.computed_since(before)

    def _finish(self, call: _Call) -> tuple[UsageMetadata, dict[str, Any]]:
        """Usage metadata and ``response_metadata`` of a finished call."""
        stream = call.stream
        output_tokens = stream.tokens if stream is not None else 0  # decoded, not the text re-tokenised
        cached = max(0, call.input_tokens - len(call.prompt) - call.computed)  # served without a forward
        usage = UsageMetadata(
            input_tokens=call.input_tokens,
            output_tokens=output_tokens,
            total_tokens=call.input_tokens + output_tokens,
            input_token_details=InputTokenDetails(cache_read=cached),
        )
        finish = (stream.finish_reason if stream is not None else None) or "stop"
        kamera = {
            "session_id": call.session,
            "policy": self.policy,
            "chunks": call.chunks,
            **call.delta,
            "window_ops": call.report.as_dict(),
        }
        return usage, {"model_name": self.model_name, "finish_reason": finish, "kamera": kamera}

    def _remote_chat(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
        stream: bool,
    ) -> tuple[Any, str, AnswerShape]:
        """Send the message list to the server's chat endpoint on the session's window."""
        session, sampling, shape = self._session_and_sampling(stop, run_manager, kwargs)
        if not messages:
            raise InvalidInputError("a chat call needs at least one message")
        payload = [message_payload(m) for m in messages]
        options: dict[str, Any] = {
            "max_tokens": sampling["max_new_tokens"],
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "seed": sampling["seed"],
            "stop": sampling["stop"],
        }
        if shape.calls_tools:  # the server describes the tools to the model and holds it to them
            options["tools"] = [{"type": "function", "function": t.model_dump()} for t in shape.tools]
            options["tool_choice"] = remote_tool_choice(shape.choice)
            if shape.choice == "auto":  # the server decides "auto" the way this model is set to
                options["auto_tool_policy"] = self.auto_tool_policy
        elif shape.response_format is not None:
            options["response_format"] = shape.response_format
        return self._remote_window(session).chat(payload, stream=stream, **options), session, shape

    def _remote_finish(
        self, session: str, model: str, usage: Any, finish: str | None
    ) -> tuple[UsageMetadata | None, dict[str, Any]]:
        """Usage metadata and ``response_metadata`` of a server's answer (``usage``: its OpenAI usage)."""
        self._remote_model = model
        meta = {
            "model_name": model,
            "finish_reason": finish or "stop",
            "kamera": {"session_id": session, "policy": self.policy, "server_session": self._remote[session].id},
        }
        if usage is None:
            return None, meta
        cached = usage.prompt_tokens_details.cached_tokens
        metadata = UsageMetadata(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            input_token_details=InputTokenDetails(cache_read=cached),
        )
        return metadata, meta

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.base_url is not None:
            message = self._remote_reply(messages, stop, run_manager, kwargs)
        else:
            call = self._prepare(messages, stop, run_manager, kwargs)
            text = "".join(self._decode(call))
            message = self._reply(call, text)
        meta = message.response_metadata
        info = {"finish_reason": meta["finish_reason"], "kamera": meta["kamera"]}
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """``_generate`` on a Kamera window thread (``kamera_sdk.to_thread``; LangChain's default executor has 6
        threads on 2 cores): many conversations' ``ainvoke`` run at once, and under ``engine.batching()`` their
        forwards and answers share the engine's steps."""
        sync = run_manager.get_sync() if run_manager is not None else None
        return await to_thread(self._generate, messages, stop, sync, **kwargs)

    def _reply(self, call: _Call, text: str) -> AIMessage:
        """The reply of a finished in-process call: a tool call when the model made one, else the text."""
        usage, meta = self._finish(call)
        if not call.shape.calls_tools:
            return AIMessage(content=text, usage_metadata=usage, response_metadata=meta)
        message, meta["finish_reason"] = tool_message(text, call.shape, meta["finish_reason"])
        return message.model_copy(update={"usage_metadata": usage, "response_metadata": meta})

    def _remote_reply(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
    ) -> AIMessage:
        """The server's whole answer as a reply (its tool calls as LangChain's)."""
        answer, session, _ = self._remote_chat(messages, stop, run_manager, kwargs, stream=False)
        choice = answer.choices[0]
        usage, meta = self._remote_finish(session, answer.model, answer.usage, choice.finish_reason)
        calls = [
            ToolCall(name=c.function.name, args=json.loads(c.function.arguments), id=c.id, type="tool_call")
            for c in choice.message.tool_calls or []
        ]
        content = choice.message.content or ""
        return AIMessage(content=content, tool_calls=calls, usage_metadata=usage, response_metadata=meta)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """Text pieces as they are decoded. With tools, an answer that opens with ``{`` is a call: it is held
        back and sent as one chunk with the parsed call (a text answer still streams)."""
        if self.base_url is not None and kwargs.get("tools") and kwargs.get("tool_choice") != "none":
            whole = self._remote_reply(messages, stop, run_manager, kwargs)  # the server holds a call back too
            yield ChatGenerationChunk(message=tool_chunk(whole))
            meta = whole.response_metadata
            info = {"finish_reason": meta["finish_reason"], "kamera": meta["kamera"]}
            last = AIMessageChunk(
                content="", usage_metadata=whole.usage_metadata, response_metadata=meta, chunk_position="last"
            )
            yield ChatGenerationChunk(message=last, generation_info=info)
            return
        if self.base_url is not None:
            pieces, session, shape = self._remote_chat(messages, stop, run_manager, kwargs, stream=True)
        else:
            call = self._prepare(messages, stop, run_manager, kwargs)
            pieces, shape = self._decode(call), call.shape
        held: list[str] | None = [] if shape.calls_tools else None  # text until it is known not to be a call
        for piece in pieces:
            if held is not None:
                held.append(piece)
                start = "".join(held).lstrip()
                if not start or start.startswith("{"):
                    continue
                piece, held = "".join(held), None
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager is not None:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        if self.base_url is not None:
            model = pieces.model or self._remote_model
            usage, meta = self._remote_finish(session, model, pieces.usage, pieces.finish_reason)
        else:
            usage, meta = self._finish(call)
        if held:
            message, meta["finish_reason"] = tool_message("".join(held), shape, meta["finish_reason"])
            yield ChatGenerationChunk(message=tool_chunk(message))
        info = {"finish_reason": meta["finish_reason"], "kamera": meta["kamera"]}
        last = AIMessageChunk(content="", usage_metadata=usage, response_metadata=meta, chunk_position="last")
        yield ChatGenerationChunk(message=last, generation_info=info)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """``_stream`` read chunk by chunk on Kamera's window threads (as ``_agenerate``); a consumer that
        stops early closes it (the answer is withdrawn). A read and the close take one lock: a consumer cancelled
        while a read runs closes the stream once that read has ended."""
        chunks = self._stream(messages, stop, run_manager.get_sync() if run_manager is not None else None, **kwargs)
        lock, done = threading.Lock(), object()

        def pull() -> object:
            with lock:
                return next(chunks, done)

        def close() -> None:
            with lock:
                chunks.close()

        try:
            while (chunk := await to_thread(pull)) is not done:
                yield chunk  # type: ignore[misc]
        finally:
            await to_thread(close)

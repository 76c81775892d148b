"""``ChatKamera``: a LangChain chat model whose conversation lives in a Kamera ``ContextWindow``.

Each message is one position-free chunk. A call diffs its message list against the session's window:
messages already there are reused, dropped ones (``trim_messages``) slide out or are evicted, a new order
is a ``reorder``, new messages are appended. Only what the reuse policy cannot serve from stored KV is
prefilled; ``response_metadata["kamera"]`` says how much that was.

With ``base_url`` the windows live on a ``kamera serve`` server instead (one server session per
``session_id``, reached through ``kamera_sdk.RemoteWindow``): the server's chat endpoint makes the window
hold the message list with the same reuse, so several agents and apps share one engine.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import Field, PrivateAttr, field_validator, model_validator

from kamera_sdk import (
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
    open_store,
)

from ._conversation import Conversation, SyncReport, stats_delta
from ._messages import message_role, message_text

#: Name reported before the default engine is loaded (``Engine.load()`` names it the same).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_CALL_KWARGS = frozenset({"session_id", "max_tokens", "temperature", "top_p", "seed"})

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
                derived = Engine(base.model, tok, name=base.name, anchor_ids=anchor, attention=attn)
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


class ChatKamera(BaseChatModel):
    """Chat model over a Kamera ``ContextWindow`` (one window per ``session_id``).

    ``engine``: a loaded ``kamera_sdk.Engine`` to share; otherwise ``model`` (Hugging Face id or local path,
    None: the embedded default SmolLM2-135M-Instruct) is loaded on first use. ``policy``/``rank``/
    ``budget_tokens`` configure each window; ``store`` (a path, a ``redis://`` URL, ``"default"`` or a
    ``ChunkStore``) keeps canonicals and patches across windows and processes. ``base_url`` (with ``api_key``)
    runs every window on a ``kamera serve`` server instead of loading a model here. Pass ``session_id="..."``
    per call (or in the run metadata, ``session_id`` or ``thread_id``) to keep conversations apart.

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
        """Tokens the messages occupy in the window (exact: the rendered chunks). For ``trim_messages``."""
        if tools:
            raise InvalidInputError("ChatKamera does not bind tools; count messages only")
        engine, _ = self._chat()
        return sum(len(engine.tokenize(t)) for t in self.render(messages))

    # --- calls ---------------------------------------------------------------------------------
    def _session_and_sampling(
        self, stop: list[str] | None, run_manager: CallbackManagerForLLMRun | None, kwargs: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """The call's session and sampling options, checked before any window is touched."""
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
        return session, sampling

    def _prepare(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
    ) -> _Call:
        session, sampling = self._session_and_sampling(stop, run_manager, kwargs)
        texts = self.render(messages)  # raises on image parts before anything changes
        engine, fmt = self._chat()
        conv, prompt = self._conversation(session), engine.tokenize(fmt.generation)
        win = conv.window
        if win.config.budget_tokens is None:  # the window will hold exactly these messages: fit them now
            held = len(win.engine.anchor_ids) + sum(len(win.engine.tokenize(t)) for t in texts)
            win.engine.check_length(held + len(prompt), new_tokens=sampling["max_new_tokens"])
        return _Call(conv, texts, prompt, sampling, session)

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
    ) -> tuple[Any, str]:
        """Send the message list to the server's chat endpoint on the session's window."""
        session, sampling = self._session_and_sampling(stop, run_manager, kwargs)
        if not messages:
            raise InvalidInputError("a chat call needs at least one message")
        payload = [{"role": message_role(m), "content": message_text(m)} for m in messages]
        options = {
            "max_tokens": sampling["max_new_tokens"],
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "seed": sampling["seed"],
            "stop": sampling["stop"],
        }
        return self._remote_window(session).chat(payload, stream=stream, **options), session

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
            answer, session = self._remote_chat(messages, stop, run_manager, kwargs, stream=False)
            choice = answer.choices[0]
            usage, meta = self._remote_finish(session, answer.model, answer.usage, choice.finish_reason)
            message = AIMessage(content=choice.message.content or "", usage_metadata=usage, response_metadata=meta)
            info = {"finish_reason": meta["finish_reason"], "kamera": meta["kamera"]}
            return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])
        call = self._prepare(messages, stop, run_manager, kwargs)
        text = "".join(self._decode(call))
        usage, meta = self._finish(call)
        message = AIMessage(content=text, usage_metadata=usage, response_metadata=meta)
        info = {"finish_reason": meta["finish_reason"], "kamera": meta["kamera"]}
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        if self.base_url is not None:
            pieces, session = self._remote_chat(messages, stop, run_manager, kwargs, stream=True)
        else:
            call = self._prepare(messages, stop, run_manager, kwargs)
            pieces = self._decode(call)
        for piece in pieces:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager is not None:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        if self.base_url is not None:
            model = pieces.model or self._remote_model
            usage, meta = self._remote_finish(session, model, pieces.usage, pieces.finish_reason)
        else:
            usage, meta = self._finish(call)
        info = {"finish_reason": meta["finish_reason"], "kamera": meta["kamera"]}
        last = AIMessageChunk(content="", usage_metadata=usage, response_metadata=meta, chunk_position="last")
        yield ChatGenerationChunk(message=last, generation_info=info)

"""``RemoteWindow`` / ``AsyncRemoteWindow``: a ``ContextWindow`` served by ``kamera serve``, over httpx.

    from kamera_sdk.server import RemoteWindow
    with RemoteWindow("http://127.0.0.1:8765", api_key="...") as win:   # creates a session
        a = win.add_text("...")
        print(win.generate("Question: ...", max_new_tokens=16))

The methods are ContextWindow's (``add_text``, ``add``, ``evict``, ``recall``, ``reorder``, ``slide``,
``fork``, ``generate`` with ``stream``, ``next_token_logprobs``, ``stats``, ``chunks``, ``evicted``),
with these differences: ``next_token_logprobs`` returns a list of floats (vocab,) rather than a tensor
(``top_logprobs`` asks for the best k only, a much smaller answer); ``fork`` returns a remote window on a
new session. Errors come back as the same Kamera exceptions (``InvalidInputError``,
``ChunkNotFoundError``, ``WindowOperationError``...), plus the ``RemoteError`` family of ``errors.py``.

Both classes are thin: each method is one request description from ``_Requests`` (no I/O there) sent
by the class's own transport, so the sync and async twins cannot drift apart.

A busy server answers 429 with ``Retry-After`` when its engine's KV budget or queue is full. With
``retries=N`` the window waits as told (at most ``max_retry_wait_s`` per wait) and sends the request again,
up to N times; a 429 without ``Retry-After`` (too many sessions, a request larger than the whole budget)
is not transient and raises at once, as does the last refusal.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar, overload

import httpx

from kamera_engine import InvalidInputError

from ..stats import WindowStats
from ..window import as_index, order_arg
from .errors import RemoteError, error_from_response
from .schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChunkAdded,
    LogprobsResult,
    SessionCreated,
    SlideResult,
    TopToken,
    Usage,
    WindowState,
)
from .sse import SSEDecoder

T = TypeVar("T")
DEFAULT_URL = "http://127.0.0.1:8765"
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)


def _index(value: object, what: str) -> int:
    """An int argument as the local window takes it (numpy and torch ints too), sent as a JSON int."""
    index = as_index(value)
    if index is None:
        raise InvalidInputError(f"{what} must be an int, got {value!r}")
    return index


@dataclass(frozen=True, slots=True)
class _Request(Generic[T]):
    """One HTTP request and how to read its JSON answer."""

    method: str
    path: str
    json: Any
    parse: Callable[[Any], T]


def _none(_: Any) -> None:
    return None


def _state(body: Any) -> WindowState:
    return WindowState.model_validate(body)


def _image_b64(image: bytes | str | Path) -> str:
    data = image if isinstance(image, bytes) else Path(image).read_bytes()
    return base64.b64encode(data).decode("ascii")


class _Requests:
    """The request behind each window method, for one session (pure: builds, never sends)."""

    def __init__(self, session_id: str) -> None:
        self.session = session_id
        self.base = f"/v1/sessions/{session_id}"

    @staticmethod
    def create(options: dict[str, Any]) -> _Request[SessionCreated]:
        return _Request("POST", "/v1/sessions", options, SessionCreated.model_validate)

    def state(self) -> _Request[WindowState]:
        return _Request("GET", self.base, None, _state)

    def delete(self) -> _Request[None]:
        return _Request("DELETE", self.base, None, _none)

    def add_text(self, text: str) -> _Request[str]:
        return _Request("POST", f"{self.base}/chunks", {"text": text}, lambda b: ChunkAdded.model_validate(b).chunk)

    def add(self, token_ids: Sequence[int], kind: str) -> _Request[str]:
        body = {"token_ids": [int(t) for t in token_ids], "kind": kind}
        return _Request("POST", f"{self.base}/chunks", body, lambda b: ChunkAdded.model_validate(b).chunk)

    def add_image(self, image: bytes | str | Path) -> _Request[str]:
        body = {"image_base64": _image_b64(image)}
        return _Request("POST", f"{self.base}/chunks", body, lambda b: ChunkAdded.model_validate(b).chunk)

    def evict(self, chunk_id: str) -> _Request[None]:
        return _Request("POST", f"{self.base}/evict", {"chunk": chunk_id}, _none)

    def forget(self, chunk_id: str) -> _Request[None]:
        return _Request("POST", f"{self.base}/forget", {"chunk": chunk_id}, _none)

    def recall(self, chunk_id: str, at: int | None) -> _Request[None]:
        pos = None if at is None else _index(at, "recall position")
        return _Request("POST", f"{self.base}/recall", {"chunk": chunk_id, "at": pos}, _none)

    def reorder(self, order: Sequence[str] | Literal["auto"]) -> _Request[list[str]]:
        body = {"order": order if isinstance(order, str) else order_arg(order)}
        return _Request("POST", f"{self.base}/reorder", body, lambda b: _state(b).chunks)

    def slide(self, n: int) -> _Request[list[str]]:
        body = {"n": _index(n, "slide count")}
        return _Request("POST", f"{self.base}/slide", body, lambda b: SlideResult.model_validate(b).removed)

    def fork(self) -> _Request[str]:
        return _Request("POST", f"{self.base}/fork", None, lambda b: SessionCreated.model_validate(b).id)

    def stats(self) -> _Request[WindowStats]:
        return _Request("GET", f"{self.base}/stats", None, WindowStats.model_validate)

    def logprobs(self, prompt: str | Sequence[int], top_k: int | None) -> _Request[LogprobsResult]:
        body = {"prompt": prompt if isinstance(prompt, str) else list(prompt), "top_k": top_k}
        return _Request("POST", f"{self.base}/logprobs", body, LogprobsResult.model_validate)

    def generate(self, prompt: str | Sequence[int], **options: Any) -> _Request[str]:
        body = {"prompt": prompt if isinstance(prompt, str) else list(prompt), **options}
        stop = body.get("stop")
        if stop is not None:
            body["stop"] = [stop] if isinstance(stop, str) else list(stop)  # one string is one stop string
        return _Request("POST", f"{self.base}/generate", body, lambda b: str(b["text"]))

    def chat(
        self, messages: Sequence[dict[str, Any]], stream: bool, options: dict[str, Any]
    ) -> _Request[ChatCompletion]:
        body: dict[str, Any] = {"messages": list(messages), "session": self.session, **options}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return _Request("POST", "/v1/chat/completions", body, ChatCompletion.model_validate)


def _json(response: httpx.Response) -> Any:
    try:
        return response.json() if response.content else None
    except ValueError:
        return response.text


def _checked(response: httpx.Response) -> Any:
    """The JSON body of a success, or the Kamera exception an error response names."""
    if response.is_success:
        return _json(response)
    raise error_from_response(response.status_code, _json(response))


FinishReason = Literal["stop", "length"]  # as kamera_engine.decode's (the client does not import torch)


class _Answer:
    """What both remote streams read off the server's events: text pieces, then the ``done`` totals."""

    def __init__(self) -> None:
        self.tokens: int | None = None
        self.finish_reason: FinishReason | None = None
        self._decoder = SSEDecoder()
        self._ended = False

    def _take(self, line: str) -> str | None:
        """The text piece on ``line`` if any; the ``done`` event sets the totals and ends the stream, an
        ``error`` event raises the error the server reported in-band."""
        event = self._decoder.feed(line)
        if event is None:
            return None
        if event.event == "token":
            return str(event.json()["text"])
        if event.event == "done":
            body = event.json()
            self.tokens, self.finish_reason, self._ended = body.get("tokens"), body.get("finish_reason"), True
        elif event.event == "error":
            raise error_from_response(500, event.json())
        return None


class RemoteTextStream(_Answer, Iterator[str]):
    """The text pieces of a remote answer, as ``ContextWindow.generate(stream=True)``'s ``TextStream``:
    ``tokens`` and ``finish_reason`` are set when the server's stream ends (None before)."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__()
        self._response = response
        self._pieces = self._run(response)

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop reading (the connection is closed; the server stops decoding)."""
        self._pieces.close()
        self._response.close()  # a stream never read has not entered the generator's own cleanup

    def _run(self, response: httpx.Response) -> Iterator[str]:
        try:
            for line in response.iter_lines():
                piece = self._take(line)
                if self._ended:
                    return
                if piece is not None:
                    yield piece
        except httpx.TransportError as exc:
            raise _cut(exc) from exc
        finally:
            response.close()
        raise _cut(None)  # the stream ended without its "done" event: the answer is incomplete


class RemoteChatStream(Iterator[str]):
    """The text pieces of a chat answer streamed by ``/v1/chat/completions`` (OpenAI's chunks, on this
    window's session); ``finish_reason`` and ``usage`` (prompt, completion and cached tokens) are set when the
    server's stream ends (None before)."""

    def __init__(self, response: httpx.Response) -> None:
        self.finish_reason: FinishReason | None = None
        self.usage: Usage | None = None
        self.model: str | None = None  # the server's model name, from the first chunk
        self._response = response
        self._decoder = SSEDecoder()
        self._pieces = self._run(response)

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop reading (the connection is closed; the server stops decoding)."""
        self._pieces.close()
        self._response.close()

    def _run(self, response: httpx.Response) -> Iterator[str]:
        try:
            for line in response.iter_lines():
                event = self._decoder.feed(line)
                if event is None:
                    continue
                if event.data == "[DONE]":
                    return
                body = event.json()
                if isinstance(body, dict) and "error" in body:
                    raise error_from_response(500, body)
                chunk = ChatCompletionChunk.model_validate(body)
                self.model = chunk.model
                if chunk.usage is not None:
                    self.usage = chunk.usage
                for choice in chunk.choices:
                    if choice.finish_reason is not None:
                        self.finish_reason = choice.finish_reason
                    if choice.delta.content:
                        yield choice.delta.content
        except httpx.TransportError as exc:
            raise _cut(exc) from exc
        finally:
            response.close()
        raise _cut(None)


class AsyncRemoteTextStream(_Answer, AsyncIterator[str]):
    """``RemoteTextStream`` for ``AsyncRemoteWindow``: ``async for`` the pieces, then ``tokens`` and
    ``finish_reason``."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__()
        self._response = response
        self._pieces = self._run(response)

    async def __anext__(self) -> str:
        return await self._pieces.__anext__()

    async def aclose(self) -> None:
        """Stop reading (the connection is closed; the server stops decoding)."""
        await self._pieces.aclose()
        await self._response.aclose()  # a stream never read has not entered the generator's own cleanup

    async def _run(self, response: httpx.Response) -> AsyncIterator[str]:
        try:
            async for line in response.aiter_lines():
                piece = self._take(line)
                if self._ended:
                    return
                if piece is not None:
                    yield piece
        except httpx.TransportError as exc:
            raise _cut(exc) from exc
        finally:
            await response.aclose()
        raise _cut(None)  # the stream ended without its "done" event: the answer is incomplete


def _options(
    policy: str, rank: int, budget_tokens: int | None, compress: str | None, kv_budget: float | None
) -> dict[str, Any]:
    return dict(policy=policy, rank=rank, budget_tokens=budget_tokens, compress=compress, kv_budget=kv_budget)


def _retry_wait(response: httpx.Response, attempt: int, retries: int, cap: float) -> float | None:
    """Seconds to wait before sending a refused request again, or None to give up: only a 429 that names
    ``Retry-After`` (seconds) is retried, at most ``retries`` times, each wait capped at ``cap``."""
    if response.status_code != 429 or attempt >= retries:
        return None
    header = response.headers.get("Retry-After")
    try:
        wait = float(header) if header is not None else None
    except ValueError:  # an HTTP date: the server never sends one; treat it as no hint
        wait = None
    return None if wait is None else min(max(wait, 0.0), cap)


def _check_retries(retries: int, max_retry_wait_s: float) -> None:
    if retries < 0 or max_retry_wait_s < 0:
        raise InvalidInputError(f"retries and max_retry_wait_s must be >= 0, got {retries}, {max_retry_wait_s}")


def _branch_options(window: RemoteWindow | AsyncRemoteWindow) -> dict[str, Any]:
    """What a fork inherits from its parent window: key, timeout, retry policy and a shared client (one the
    parent was given; a client the parent opened itself stays the parent's)."""
    return dict(
        api_key=window._api_key,
        timeout=window._timeout,
        client=None if window._owns_client else window._client,
        retries=window.retries,
        max_retry_wait_s=window.max_retry_wait_s,
    )


def _unreachable(url: str, exc: httpx.TransportError) -> RemoteError:
    return RemoteError(f"cannot reach the Kamera server at {url}: {exc}", status=0, type_name="TransportError")


def _cut(exc: httpx.TransportError | None) -> RemoteError:
    why = f": {exc}" if exc is not None else " before its end"
    return RemoteError(f"the answer's stream was cut{why}", status=0, type_name="TransportError")


class RemoteWindow:
    """A window on a Kamera server (sync). Creates a session unless ``session_id`` attaches to one.

    ``client``: an ``httpx.Client`` to share (its ``base_url`` and auth are used as they are); by
    default the window opens its own. ``close()`` (or leaving ``with``) deletes a session this object
    created and closes a client it opened. ``retries`` / ``max_retry_wait_s``: how a 429 with
    ``Retry-After`` is retried (see the module docstring; 0: never).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        session_id: str | None = None,
        policy: str = "kamera",
        rank: int = 32,
        budget_tokens: int | None = None,
        compress: str | None = None,
        kv_budget: float | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        client: httpx.Client | None = None,
        retries: int = 0,
        max_retry_wait_s: float = 30.0,
    ) -> None:
        _check_retries(retries, max_retry_wait_s)
        self.base_url = base_url
        self.retries, self.max_retry_wait_s = retries, max_retry_wait_s
        self._api_key = api_key
        self._timeout = timeout
        self._owns_client = client is None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.Client(base_url=base_url, headers=headers, timeout=timeout)
        self._owns_session = session_id is None
        if session_id is None:
            options = _options(policy, rank, budget_tokens, compress, kv_budget)
            try:
                session_id = self._send(_Requests.create(options)).id
            except BaseException:
                if self._owns_client:
                    self._client.close()
                raise
        self.id: str = session_id
        self._r = _Requests(session_id)

    # --- transport ------------------------------------------------------------------------------
    def _send(self, req: _Request[T]) -> T:
        attempt = 0
        while True:
            try:
                response = self._client.request(req.method, req.path, json=req.json)
            except httpx.TransportError as exc:
                raise _unreachable(self.base_url, exc) from exc
            wait = _retry_wait(response, attempt, self.retries, self.max_retry_wait_s)
            if wait is None:
                return req.parse(_checked(response))
            attempt += 1
            time.sleep(wait)

    def _stream(self, req: _Request[Any]) -> RemoteTextStream:
        return RemoteTextStream(self._open(req))

    def _open(self, req: _Request[Any]) -> httpx.Response:
        """Send ``req`` and return its response unread (for a stream), or raise the error it answered."""
        attempt = 0
        while True:
            try:
                request = self._client.build_request(req.method, req.path, json=req.json)
                response = self._client.send(request, stream=True)
            except httpx.TransportError as exc:
                raise _unreachable(self.base_url, exc) from exc
            if response.is_success:
                return response
            response.read()
            response.close()
            wait = _retry_wait(response, attempt, self.retries, self.max_retry_wait_s)
            if wait is None:
                _checked(response)
            attempt += 1
            time.sleep(wait or 0.0)

    # --- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> RemoteWindow:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Delete the session if this object created it; close the client if this object opened it."""
        try:
            if self._owns_session:
                self.delete()
        finally:
            if self._owns_client:
                self._client.close()

    def delete(self) -> None:
        """Delete the session on the server (its window and chunks are gone)."""
        self._send(self._r.delete())
        self._owns_session = False

    # --- inspection -----------------------------------------------------------------------------
    def state(self) -> WindowState:
        """Chunks, evicted chunks and tokens, in one request."""
        return self._send(self._r.state())

    @property
    def chunks(self) -> list[str]:
        """Chunk ids in window order."""
        return self.state().chunks

    @property
    def evicted(self) -> list[str]:
        """Evicted (recallable) chunk ids, oldest first."""
        return self.state().evicted

    @property
    def tokens(self) -> int:
        return self.state().tokens

    def __len__(self) -> int:
        return len(self.chunks)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self.chunks

    def stats(self) -> WindowStats:
        return self._send(self._r.stats())

    # --- content and window operations ----------------------------------------------------------
    def add_text(self, text: str) -> str:
        return self._send(self._r.add_text(text))

    def add(self, token_ids: Sequence[int], *, kind: str = "tokens") -> str:
        return self._send(self._r.add(token_ids, kind))

    def add_image(self, image: bytes | str | Path) -> str:
        """An image chunk (bytes or a local file; the server needs a VLM engine)."""
        return self._send(self._r.add_image(image))

    def evict(self, chunk_id: str) -> None:
        self._send(self._r.evict(chunk_id))

    def recall(self, chunk_id: str, at: int | None = None) -> None:
        self._send(self._r.recall(chunk_id, at))

    def forget(self, chunk_id: str) -> None:
        """Forget an evicted chunk for good (``ContextWindow.forget``): no longer recallable, and no longer
        held by the server once no fork of the session holds it."""
        self._send(self._r.forget(chunk_id))

    def reorder(self, order: Sequence[str] | Literal["auto"]) -> list[str]:
        return self._send(self._r.reorder(order))

    def slide(self, n: int = 1) -> list[str]:
        return self._send(self._r.slide(n))

    def fork(self) -> RemoteWindow:
        """A copy-on-write branch on a new session (owned, so ``close()`` deletes it)."""
        child_id = self._send(self._r.fork())
        child = RemoteWindow(self.base_url, session_id=child_id, **_branch_options(self))
        child._owns_session = True
        return child

    # --- using the window -----------------------------------------------------------------------
    @overload
    def chat(
        self, messages: Sequence[dict[str, Any]], *, stream: Literal[False] = ..., **options: Any
    ) -> ChatCompletion: ...

    @overload
    def chat(
        self, messages: Sequence[dict[str, Any]], *, stream: Literal[True], **options: Any
    ) -> RemoteChatStream: ...

    def chat(
        self, messages: Sequence[dict[str, Any]], *, stream: bool = False, **options: Any
    ) -> ChatCompletion | RemoteChatStream:
        """An OpenAI chat completion over this session's window: the server makes the window hold the messages
        (earlier ones reused, dropped ones evicted, the last one the prompt) and answers. ``messages``:
        ``{"role", "content"}`` dicts; ``options``: ``max_tokens``, ``temperature``, ``top_p``, ``stop``,
        ``seed``. ``stream=True`` returns the text pieces, with ``usage`` and ``finish_reason`` at the end."""
        req = self._r.chat(messages, stream, options)
        return RemoteChatStream(self._open(req)) if stream else self._send(req)

    def next_token_logprobs(self, prompt: str | Sequence[int]) -> list[float]:
        """Log-probabilities (vocab,) of the next token, as floats (about 1 MB of JSON for 49k tokens)."""
        result = self._send(self._r.logprobs(prompt, None))
        return result.logprobs or []

    def top_logprobs(self, prompt: str | Sequence[int], k: int = 10) -> list[TopToken]:
        """The ``k`` most likely next tokens, best first."""
        return self._send(self._r.logprobs(prompt, k)).top or []

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        *,
        stream: Literal[False] = ...,
        temperature: float = ...,
        top_p: float = ...,
        stop: Sequence[str] | None = ...,
        seed: int | None = ...,
    ) -> str: ...

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        *,
        stream: Literal[True],
        temperature: float = ...,
        top_p: float = ...,
        stop: Sequence[str] | None = ...,
        seed: int | None = ...,
    ) -> RemoteTextStream: ...

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 64,
        *,
        stream: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
    ) -> str | RemoteTextStream:
        """The answer (str), or with ``stream=True`` a ``RemoteTextStream`` of text pieces (server-sent
        events) whose ``tokens`` and ``finish_reason`` are set when it ends."""
        req = self._r.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            stream=stream,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
        )
        return self._stream(req) if stream else self._send(req)


class AsyncRemoteWindow:
    """A window on a Kamera server (asyncio). The session is created on first use (or ``await open()``);
    ``async with AsyncRemoteWindow(url) as win`` opens it and deletes it on exit.

    ``chunks()``, ``evicted()`` and ``state()`` are coroutines here (properties cannot await).
    ``retries`` / ``max_retry_wait_s`` as ``RemoteWindow``'s.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        session_id: str | None = None,
        policy: str = "kamera",
        rank: int = 32,
        budget_tokens: int | None = None,
        compress: str | None = None,
        kv_budget: float | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        client: httpx.AsyncClient | None = None,
        retries: int = 0,
        max_retry_wait_s: float = 30.0,
    ) -> None:
        _check_retries(retries, max_retry_wait_s)
        self.base_url = base_url
        self.retries, self.max_retry_wait_s = retries, max_retry_wait_s
        self._api_key = api_key
        self._timeout = timeout
        self._owns_client = client is None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout)
        self._options = _options(policy, rank, budget_tokens, compress, kv_budget)
        self._owns_session = session_id is None
        self.id: str | None = session_id
        self._r: _Requests | None = None if session_id is None else _Requests(session_id)

    # --- transport ------------------------------------------------------------------------------
    async def _send(self, req: _Request[T]) -> T:
        attempt = 0
        while True:
            try:
                response = await self._client.request(req.method, req.path, json=req.json)
            except httpx.TransportError as exc:
                raise _unreachable(self.base_url, exc) from exc
            wait = _retry_wait(response, attempt, self.retries, self.max_retry_wait_s)
            if wait is None:
                return req.parse(_checked(response))
            attempt += 1
            await asyncio.sleep(wait)

    async def _requests(self) -> _Requests:
        if self._r is None:
            await self.open()
        assert self._r is not None
        return self._r

    async def _stream(self, req: _Request[Any]) -> AsyncRemoteTextStream:
        attempt = 0
        while True:
            try:
                request = self._client.build_request(req.method, req.path, json=req.json)
                response = await self._client.send(request, stream=True)
            except httpx.TransportError as exc:
                raise _unreachable(self.base_url, exc) from exc
            if response.is_success:
                return AsyncRemoteTextStream(response)
            await response.aread()
            await response.aclose()
            wait = _retry_wait(response, attempt, self.retries, self.max_retry_wait_s)
            if wait is None:
                _checked(response)
            attempt += 1
            await asyncio.sleep(wait or 0.0)

    # --- lifecycle ------------------------------------------------------------------------------
    async def open(self) -> AsyncRemoteWindow:
        """Create the session (once)."""
        if self.id is None:
            self.id = (await self._send(_Requests.create(self._options))).id
            self._r = _Requests(self.id)
        return self

    async def __aenter__(self) -> AsyncRemoteWindow:
        return await self.open()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Delete the session if this object created it; close the client if this object opened it."""
        try:
            if self._owns_session and self.id is not None:
                await self.delete()
        finally:
            if self._owns_client:
                await self._client.aclose()

    async def delete(self) -> None:
        await self._send((await self._requests()).delete())
        self._owns_session = False

    # --- inspection -----------------------------------------------------------------------------
    async def state(self) -> WindowState:
        return await self._send((await self._requests()).state())

    async def chunks(self) -> list[str]:
        return (await self.state()).chunks

    async def evicted(self) -> list[str]:
        return (await self.state()).evicted

    async def stats(self) -> WindowStats:
        return await self._send((await self._requests()).stats())

    # --- content and window operations ----------------------------------------------------------
    async def add_text(self, text: str) -> str:
        return await self._send((await self._requests()).add_text(text))

    async def add(self, token_ids: Sequence[int], *, kind: str = "tokens") -> str:
        return await self._send((await self._requests()).add(token_ids, kind))

    async def add_image(self, image: bytes | str | Path) -> str:
        return await self._send((await self._requests()).add_image(image))

    async def evict(self, chunk_id: str) -> None:
        await self._send((await self._requests()).evict(chunk_id))

    async def recall(self, chunk_id: str, at: int | None = None) -> None:
        await self._send((await self._requests()).recall(chunk_id, at))

    async def forget(self, chunk_id: str) -> None:
        await self._send((await self._requests()).forget(chunk_id))

    async def reorder(self, order: Sequence[str] | Literal["auto"]) -> list[str]:
        return await self._send((await self._requests()).reorder(order))

    async def slide(self, n: int = 1) -> list[str]:
        return await self._send((await self._requests()).slide(n))

    async def fork(self) -> AsyncRemoteWindow:
        """A copy-on-write branch on a new session (owned, so ``aclose()`` deletes it)."""
        child_id = await self._send((await self._requests()).fork())
        child = AsyncRemoteWindow(self.base_url, session_id=child_id, **_branch_options(self))
        child._owns_session = True
        return child

    # --- using the window -----------------------------------------------------------------------
    async def next_token_logprobs(self, prompt: str | Sequence[int]) -> list[float]:
        result = await self._send((await self._requests()).logprobs(prompt, None))
        return result.logprobs or []

    async def top_logprobs(self, prompt: str | Sequence[int], k: int = 10) -> list[TopToken]:
        return (await self._send((await self._requests()).logprobs(prompt, k))).top or []

    @overload
    async def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        *,
        stream: Literal[False] = ...,
        temperature: float = ...,
        top_p: float = ...,
        stop: Sequence[str] | None = ...,
        seed: int | None = ...,
    ) -> str: ...

    @overload
    async def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        *,
        stream: Literal[True],
        temperature: float = ...,
        top_p: float = ...,
        stop: Sequence[str] | None = ...,
        seed: int | None = ...,
    ) -> AsyncRemoteTextStream: ...

    async def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 64,
        *,
        stream: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
    ) -> str | AsyncRemoteTextStream:
        """The answer (str), or with ``stream=True`` an ``AsyncRemoteTextStream`` of text pieces whose
        ``tokens`` and ``finish_reason`` are set when it ends."""
        req = (await self._requests()).generate(
            prompt,
            max_new_tokens=max_new_tokens,
            stream=stream,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
        )
        return await self._stream(req) if stream else await self._send(req)

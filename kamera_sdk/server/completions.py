"""``POST /v1/completions``: OpenAI's legacy (text-in, text-out) completions, for evaluation harnesses and
older integrations.

The prompt (a text, or token ids) is read raw, with no chat framing. With ``session`` it continues after
that session's window, exactly as the window is read for ``/generate`` (after the chat anchor and the
window's chunks, at the positions they hold); without one it is a plain language-model continuation with
nothing before it. (``user`` keys no window here: a completion has no message history to reuse.)

``logprobs``: the answer's tokens are decoded once, then scored in one forward over the same context
(the prompt's tokens too with ``echo``), so each reported log-probability is the model's for the token
actually returned. Errors, limits and the worker discipline are the chat endpoint's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from kamera_engine import KV, Engine, InvalidInputError, SamplingParams, TextStream

from ..window import ContextWindow
from .errors import exception_body
from .ops import Limits, sampling_params
from .schemas import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)
from .sse import encode_event

#: Answer length when a request names none: OpenAI's default for this endpoint.
DEFAULT_MAX_TOKENS = 16
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

router = APIRouter()


def prompt_token_ids(engine: Engine, prompt: str | Sequence[Any]) -> list[int]:
    """The request's one prompt as token ids (text is tokenized raw: no chat frame, no special tokens)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidInputError(f"send one prompt per request (got a batch of {len(prompt)})")
        prompt = prompt[0]
    ids = engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise InvalidInputError("prompt must not be empty")
    engine.check_ids(ids)
    return ids


def sampling(req: CompletionRequest, limits: Limits) -> SamplingParams:
    """The request's decoding settings, checked before anything runs."""
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = sampling_params(limits, max_tokens, req.temperature, req.top_p, req.stop, req.seed)
    if req.stream and req.logprobs is not None:
        raise InvalidInputError("logprobs are not streamed: ask with stream=false")
    return params


@dataclass(slots=True)
class CompletionStart:
    """A started completion: the text stream, its first piece, the ids decoded so far, and the context it
    was decoded after (kept for scoring)."""

    pieces: TextStream
    first: str | None
    prompt_ids: list[int]
    past: KV | None
    start: int
    cached_tokens: int
    decoded: list[int] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return self.start + len(self.prompt_ids)


def _recording(ids: Iterator[int], into: list[int]) -> Iterator[int]:
    try:
        for token in ids:
            into.append(token)
            yield token
    finally:
        close = getattr(ids, "close", None)
        if close is not None:
            close()


def start_completion(
    engine: Engine, win: ContextWindow | None, req: CompletionRequest, params: SamplingParams
) -> CompletionStart:
    """One worker job: place the context, prefill the prompt, decode the first piece."""
    ids = prompt_token_ids(engine, req.prompt)
    if win is None:
        past, start, cached = None, 0, 0
    elif win.compressor is not None:
        raise InvalidInputError("this session compresses its KV: use /v1/sessions/{id}/generate")
    elif len(win) == 0:  # an empty session: the anchor its chunks would follow
        past, start = engine.anchor_kv, len(engine.anchor_ids)
        cached = start
    else:
        before = win.stats()
        past = win.assemble()
        start = int(past.positions.max()) + 1 if past.positions is not None and len(past) else len(past)
        cached = max(0, start - win.stats().computed_since(before))
    limit = engine.context_length
    if limit is not None and req.max_tokens is None:  # an open length is cut to the room left
        params.max_new_tokens = max(0, min(params.max_new_tokens, limit - start - len(ids)))
    decoded: list[int] = []
    pieces = engine.stream(_recording(engine.generate_ids(past, ids, start, params), decoded), params)
    first = next(pieces, None)
    return CompletionStart(pieces, first, ids, past, start, cached, decoded)


def score(engine: Engine, started: CompletionStart, text: str, top: int, echo: bool) -> CompletionLogprobs:
    """Log-probabilities of the returned tokens (the prompt's too with ``echo``), from one forward over
    the context the answer was decoded after. ``text``: the answer as returned (a stop string cut off)."""
    eos = set(engine.eos_token_ids)
    answer = [t for t in started.decoded if t not in eos]
    seq = started.prompt_ids + answer
    logits = engine.forward(seq, started.past, started.start, logits="all").logits
    first = 0 if echo else len(started.prompt_ids)
    tokens, token_lps, tops, offsets = [], [], [], []
    tok = engine.tokenizer
    shown = tok.decode(seq[:first], skip_special_tokens=True)  # text before the first reported token
    base = 0 if echo else len(shown)  # offsets count from the start of the returned text
    end = len(tok.decode(started.prompt_ids, skip_special_tokens=True)) - base + len(text)
    for i in range(first, len(seq)):
        cur = tok.decode(seq[: i + 1], skip_special_tokens=True)
        offset = len(shown) - base
        if offset >= end and i >= len(started.prompt_ids):
            break  # past the returned text: the tokens of a cut-off stop string
        tokens.append(cur[len(shown) :])
        offsets.append(offset)
        shown = cur
        if i == 0:  # nothing before it was scored here
            token_lps.append(None)
            tops.append(None)
            continue
        row = torch.log_softmax(logits[i - 1].float(), dim=-1)
        token_lps.append(float(row[seq[i]]))
        if top > 0:
            best = torch.topk(row, top)
            tops.append({tok.decode([int(j)]): float(v) for v, j in zip(best.values, best.indices, strict=True)})
        else:
            tops.append(None)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)


def _usage(started: CompletionStart) -> Usage:
    completion = started.pieces.tokens
    return Usage(
        prompt_tokens=started.prompt_tokens,
        completion_tokens=completion,
        total_tokens=started.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=started.cached_tokens),
    )


def _prompt_text(engine: Engine, req: CompletionRequest, started: CompletionStart) -> str:
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return engine.tokenizer.decode(started.prompt_ids, skip_special_tokens=True)


@router.post("/v1/completions", response_model=Completion)
async def completions(req: CompletionRequest, request: Request) -> Any:
    """OpenAI's legacy completions over a session's window, or over nothing."""
    state = request.app.state.kamera
    engine, worker = state.engine, state.worker
    params = sampling(req, state.limits)
    window = state.sessions.get(req.session).window if req.session is not None else None
    started = await worker.run_keyed(req.session, start_completion, engine, window, req, params)
    cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    head = _prompt_text(engine, req, started) if req.echo else ""
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        body = _sse(worker, started, cid, created, engine.name, head, include_usage, req.session)
        return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)
    pieces = [started.first] if started.first is not None else []
    async with aclosing(worker.iterate(started.pieces, key=req.session)) as rest:
        async for piece in rest:
            pieces.append(piece)
            if await request.is_disconnected():
                break
    text = "".join(pieces)
    logprobs = None
    if req.logprobs is not None:
        logprobs = await worker.run_keyed(req.session, score, engine, started, text, req.logprobs, req.echo)
    finish = started.pieces.finish_reason or "stop"
    choice = CompletionChoice(text=head + text, finish_reason=finish, logprobs=logprobs)
    return Completion(id=cid, created=created, model=engine.name, choices=[choice], usage=_usage(started))


async def _sse(
    worker: Any,
    started: CompletionStart,
    cid: str,
    created: int,
    model: str,
    head: str,
    include_usage: bool,
    session: str | None,
) -> AsyncIterator[bytes]:
    """OpenAI's stream: a chunk per text piece, a finish chunk, optionally usage, then ``[DONE]``."""

    def chunk(text: str, finish: Any = None) -> bytes:
        choice = CompletionChoice(text=text, finish_reason=finish)
        c = Completion(id=cid, created=created, model=model, choices=[choice])
        return encode_event(c.model_dump(mode="json", exclude={"usage"}))

    try:
        if head:
            yield chunk(head)
        if started.first is not None:
            yield chunk(started.first)
        async for piece in worker.iterate(started.pieces, key=session):
            yield chunk(piece)
        yield chunk("", started.pieces.finish_reason or "stop")
        if include_usage:
            tail = Completion(id=cid, created=created, model=model, choices=[], usage=_usage(started))
            yield encode_event(tail.model_dump(mode="json"))
    except Exception as exc:  # headers are sent: report in-band
        yield encode_event(exception_body(exc))
    yield encode_event("[DONE]")

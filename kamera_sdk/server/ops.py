"""Window work done on the model worker: each function is one job and touches one window.

These functions validate against the server's limits before they change anything, so a refused
request leaves the window as it was (the same promise ``ContextWindow`` makes).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kamera_engine import Grammar, InvalidInputError, SamplingParams, TextStream
from kamera_engine.decode import stop_strings

from ..chunks import ChunkId, tokens_id
from ..window import ContextWindow
from .errors import PayloadTooLargeError
from .schemas import ChunkAdd, GenerateRequest, LogprobsResult, TopToken, WindowState
from .worker import streams_from_scheduler


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request or session may ask of the server (``max_held_tokens``: all sessions together)."""

    max_body_bytes: int = 2 << 20
    max_image_bytes: int = 8 << 20
    max_sessions: int = 256
    max_new_tokens: int = 1024
    max_session_tokens: int = 32768
    session_ttl_s: float | None = 3600.0
    max_held_tokens: int | None = None


#: ``HeldTokens.claim`` bound to one session: let it hold this many tokens, or raise.
Claim = Callable[[int], None]


def window_state(session_id: str, win: ContextWindow) -> WindowState:
    chunks, evicted = [str(c) for c in win.chunks], [str(c) for c in win.evicted]
    return WindowState(session=session_id, policy=win.policy.name, chunks=chunks, evicted=evicted, tokens=win.tokens)


def held_tokens(win: ContextWindow) -> int:
    """What ``max_held_tokens`` counts for a session: its window's tokens (their KV as placed) and the content
    it and its branches hold or held (their canonicals, evicted and slid chunks' included until forgotten)."""
    return win.tokens + win.content_tokens


def holds(win: ContextWindow, chunk_id: str) -> bool:
    """Whether ``win`` (or a branch of it) has seen ``chunk_id``: its content is held already."""
    return win.known(ChunkId(chunk_id)) is not None


def check_tokens(win: ContextWindow, extra: int, limits: Limits) -> None:
    """Refuse content that would take the window past ``max_session_tokens`` (413)."""
    total = win.tokens + extra
    if total > limits.max_session_tokens:
        raise PayloadTooLargeError(
            f"the window would hold {total} tokens; this server allows {limits.max_session_tokens} "
            "per session (evict or slide first)"
        )


def claim_new(win: ContextWindow, new: int, claim: Claim | None) -> None:
    """Refuse ``new`` tokens the session would hold beyond what it holds now, if they would take the sessions
    together past ``max_held_tokens`` (429, through ``claim``)."""
    if claim is not None and new > 0:
        claim(held_tokens(win) + new)


def new_content(win: ContextWindow, chunk_id: str, n: int) -> int:
    """What adding an ``n``-token chunk to ``win`` adds to what it holds: placed, and its content if new."""
    return n if holds(win, chunk_id) else 2 * n


def decode_image(data: str, limits: Limits) -> bytes:
    """Bytes of a base64 image, refusing oversized ones before decoding them."""
    if len(data) * 3 // 4 > limits.max_image_bytes:
        raise PayloadTooLargeError(f"image larger than this server's limit of {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInputError(f"image_base64 is not valid base64: {exc}") from exc


def add_chunk(
    session_id: str, win: ContextWindow, req: ChunkAdd, limits: Limits, claim: Claim | None = None
) -> tuple[str, WindowState]:
    if req.text is not None:
        cid = win.text_id(req.text)
        if cid not in win:
            n = len(win.engine.tokenize(req.text))
            check_tokens(win, n, limits)
            claim_new(win, new_content(win, cid, n), claim)
        cid = win.add_text(req.text)
    elif req.token_ids is not None:
        n = len(req.token_ids)
        try:
            tid = tokens_id(req.kind, req.token_ids)
        except OverflowError:  # not token ids: the add refuses them
            tid = None
        if tid is None or tid not in win:
            check_tokens(win, n, limits)
            claim_new(win, 2 * n if tid is None else new_content(win, tid, n), claim)
        cid = win.add(req.token_ids, kind=req.kind)
    else:
        assert req.image_base64 is not None  # the schema admits exactly one kind of content
        image = decode_image(req.image_base64, limits)
        check_tokens(win, 1, limits)  # a session at its bound is refused before the vision tower runs
        claim_new(win, 1, claim)
        chunk = win.image_chunk(image)  # the tower runs (once per picture); the window is unchanged
        if chunk.id not in win:
            check_tokens(win, len(chunk), limits)
            claim_new(win, new_content(win, chunk.id, len(chunk)), claim)
        (cid,) = win.admit(chunk)
    return str(cid), window_state(session_id, win)


def recall(
    session_id: str, win: ContextWindow, chunk: str, at: int | None, limits: Limits, claim: Claim | None = None
) -> WindowState:
    """Re-admit an evicted chunk, checked like new content: its KV is placed again (its canonical was held
    all along)."""
    if chunk in win.evicted and chunk not in win:  # anything else gets recall's own error
        n = len(win.chunk(chunk))
        check_tokens(win, n, limits)
        claim_new(win, n, claim)
    win.recall(chunk, at)
    return window_state(session_id, win)


def logprobs(win: ContextWindow, prompt: str | list[int], top_k: int | None) -> LogprobsResult:
    lp = win.next_token_logprobs(prompt).float().clamp_min(-1e30)  # (vocab,); JSON has no -inf
    if top_k is None:
        return LogprobsResult(vocab_size=lp.numel(), logprobs=lp.tolist())
    values, ids = torch.topk(lp, min(top_k, lp.numel()))
    tok = win.engine.tokenizer
    return LogprobsResult(
        vocab_size=lp.numel(),
        top=[
            TopToken(token_id=int(i), token=tok.decode([int(i)]) if tok is not None else "", logprob=float(v))
            for v, i in zip(values.tolist(), ids.tolist(), strict=True)
        ],
    )


def first_piece(pieces: TextStream) -> str | None:
    """The answer's first piece, pulled in this job only when the answer does not come from a scheduler.

    A scheduler's answer is submitted and left to stream: waiting for its first token here would hold the
    model thread (and every other session's window work) through the prompt's prefill."""
    return None if streams_from_scheduler(pieces) else next(pieces, None)


def start_generate(win: ContextWindow, req: GenerateRequest) -> tuple[TextStream, str | None]:
    """Materialise the window and submit the answer; without a scheduler, decode its first piece too (the
    rest is pulled one step per job)."""
    pieces = win.generate(
        req.prompt,
        req.max_new_tokens,
        stream=True,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=req.stop,
        seed=req.seed,
    )
    return pieces, first_piece(pieces)


def sampling_params(
    limits: Limits,
    max_tokens: int,
    temperature: float | None,
    top_p: float | None,
    stop: str | list[str] | None,
    seed: int | None,
    grammar: Grammar | None = None,
) -> SamplingParams:
    """An OpenAI request's decoding settings (temperature 0, greedy, when it names none), checked against
    the server's answer limit before anything runs: a refused request changes nothing."""
    if max_tokens > limits.max_new_tokens:
        raise InvalidInputError(f"max_tokens={max_tokens} is over this server's limit of {limits.max_new_tokens}")
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=0.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        stop=stop_strings(stop),
        seed=seed,
        grammar=grammar,
    )
    params.validate()
    return params

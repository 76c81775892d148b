"""Kamera's own decode loop: greedy or temperature/top-p sampling, stop strings, EOS, streaming.

It continues from a transformers cache built over an assembled window, with explicit positions, which
``generate()`` does not support reliably.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .constrained import Grammar, TokenConstraint
from .errors import InvalidInputError
from .kv import drop_tokens
from .runner import call_with_cache

#: Run after each decode step with plain counts: (tokens in the cache, tokens generated so far) -> the cache
#: rows to drop from every layer and head (empty or None: keep all). Compression policies evict here.
StepHook = Callable[[int, int], Sequence[int] | None]

#: How a blocking call runs off the event loop (``asyncio.to_thread``'s shape; the SDK passes its own pool's).
ThreadRunner = Callable[..., Awaitable[Any]]


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    #: what the answer must match (a JSON schema, regex or Lark grammar); None for free text
    grammar: Grammar | None = None

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            raise InvalidInputError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise InvalidInputError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidInputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also refuses nan
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidInputError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InvalidInputError(f"grammar must be a kamera Grammar, got {type(self.grammar).__name__}")


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``SamplingParams.stop`` from what callers pass: one string is one stop string, not its characters."""
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from next-token logits (vocab,)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    # float64: any temperature / top_p the checks admit (down to 1e-300) stays a positive number here,
    # where float32 would round it to 0 and divide by it; shifted, a tiny temperature is argmax
    x = logits.double()
    probs = torch.softmax((x - x.max()) / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        cut = cum - sorted_p >= params.top_p  # drop tokens once the kept mass already reaches top_p
        sorted_p[cut] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def next_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    constraint: TokenConstraint | None = None,
) -> int:
    """The next token from logits (vocab,): only among those ``constraint`` admits, which then advances
    on it (an end-of-sequence token ends the answer and is not fed to the grammar)."""
    scores = logits.cpu()
    if constraint is not None:
        scores = constraint.mask_(scores.clone())
    token = pick_token(scores, params, generator)
    if constraint is not None and token not in constraint.eos_token_ids:
        constraint.advance(token)
    return token


@torch.inference_mode()
def decode_tokens(
    model: nn.Module,
    cache: object,
    first_logits: torch.Tensor,
    next_position: int,
    params: SamplingParams,
    after_step: StepHook | None = None,
    constraint: TokenConstraint | None = None,
) -> Iterator[int]:
    """Yield generated token ids, feeding each back at its explicit position.

    ``after_step(cached, generated)`` runs after each token is added to the cache; the rows it names are
    dropped from the cache before the next step. ``constraint``: only tokens its grammar admits are picked
    (``constrained.py``); the answer ends with the grammar's end-of-sequence once the grammar is complete.
    """
    params.validate()
    eos = set(params.eos_token_ids) | set(constraint.eos_token_ids if constraint is not None else ())
    device = next(model.parameters()).device
    generator = None
    if params.seed is not None and params.temperature > 0:
        generator = torch.Generator(device="cpu").manual_seed(params.seed)
    logits = first_logits
    pos = next_position
    for step in range(params.max_new_tokens):
        token = next_token(logits, params, generator, constraint)
        yield token
        if token in eos or step == params.max_new_tokens - 1:
            return  # no forward for a token nobody will read
        logits = step_logits(model, cache, token, pos, device)
        pos += 1
        if after_step is not None:
            drop_tokens(cache, after_step(cached_tokens(cache), pos - next_position))


def step_logits(model: nn.Module, cache: object, token: int, position: int, device: torch.device) -> torch.Tensor:
    """Feed one token at ``position`` on ``cache`` (grown in place); its next-token logits (vocab,)."""
    out = call_with_cache(
        model,
        cache,
        input_ids=torch.tensor([[token]], device=device),
        position_ids=torch.tensor([[position]], device=device),
        use_cache=True,
    )
    return out.logits[0, -1].float()


def cached_tokens(cache: object) -> int:
    """Tokens a transformers cache holds (its first layer's length)."""
    return int(cache.layers[0].keys.shape[-2])  # type: ignore[attr-defined]


#: Why an answer ended: EOS or a stop string, or ``max_new_tokens`` decoded.
FinishReason = Literal["stop", "length"]


class _Pieces:
    """An answer's text, token by token: what ``TextStream`` and ``AsyncTextStream`` emit. A piece is
    emitted once it cannot be the start of a stop string and holds no partial UTF-8 character; EOS or a
    stop string ends the answer (the stop string is not emitted)."""

    def __init__(self, tokenizer: object, params: SamplingParams) -> None:
        self.finish_reason: FinishReason | None = None
        self.ended = False  # EOS or a stop string: read no further tokens
        self._decode = tokenizer.decode  # type: ignore[attr-defined]
        self._params = params
        self._ids: list[int] = []
        self._emitted = 0
        self._cut = False  # a stop string cut the text: nothing follows

    def feed(self, token: int) -> str:
        """The text this token releases ('' for none)."""
        if token in self._params.eos_token_ids:
            self.finish_reason, self.ended = "stop", True
            return ""
        self._ids.append(token)
        text = self._decode(self._ids, skip_special_tokens=True)
        cut = _first_stop(text, self._params.stop, self._emitted)
        if cut is not None:
            self.finish_reason, self.ended, self._cut = "stop", True, True
            return self._release(text, cut)
        safe = len(text) - _held_back(text, self._params.stop)
        if text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        return self._release(text, safe)

    def end(self) -> str:
        """The text held back when the tokens ended (EOS, or the source ran out)."""
        if self._cut:
            return ""
        self._cut = True
        text = self._decode(self._ids, skip_special_tokens=True)
        cut = _first_stop(text, self._params.stop, self._emitted)
        self.finish_reason = self.finish_reason or ("stop" if cut is not None else "length")
        return self._release(text, cut if cut is not None else len(text))

    def _release(self, text: str, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        piece, self._emitted = text[self._emitted : upto], upto
        return piece


class TextStream(Iterator[str]):
    """The text pieces of an answer as its tokens are decoded: it stops at EOS or a stop string (the stop
    string is not emitted), and a piece is emitted only once it cannot be the start of a stop string and
    holds no partial UTF-8 character.

    ``tokens``: tokens the model decoded so far, an ending EOS included (what usage counts; re-tokenising
    the text can give another number). ``finish_reason``: None while it runs, then ``"stop"`` (EOS or a
    stop string) or ``"length"`` (``max_new_tokens`` decoded). ``aiter()``: the same answer as an
    ``AsyncTextStream``.
    """

    def __init__(self, tokens: Iterator[int], tokenizer: object, params: SamplingParams) -> None:
        self.tokens = 0
        self._source = tokens
        self._text = _Pieces(tokenizer, params)
        self._tokenizer, self._params = tokenizer, params
        self._started = self._async = False
        self._pieces = self._run()

    def __next__(self) -> str:
        if self._async:
            raise InvalidInputError("this stream is read through its aiter()")
        self._started = True
        return next(self._pieces)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._text.finish_reason

    @property
    def source(self) -> Iterator[int]:
        """The token iterator the text comes from (a scheduler's ``Request`` when decoding is batched)."""
        return self._source

    def close(self) -> None:
        """Stop decoding (the token source is closed too)."""
        self._pieces.close()
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def aiter(self, *, to_thread: ThreadRunner | None = None) -> AsyncTextStream:
        """This answer as an ``AsyncTextStream``, before any of it was read here (and read only there from
        then on). A scheduler's request that a thread drives streams its tokens without a thread of its own
        (``Request.aiter``); any other source is read one token at a time on a worker thread (``to_thread``,
        default ``asyncio.to_thread``), so the event loop never runs a forward. Closing it withdraws the answer
        (off the event loop: a withdrawal may wait for a step to end)."""
        if self._started:
            raise InvalidInputError("this stream was already read from; take aiter() before reading it")
        self._started = self._async = True
        run = to_thread or asyncio.to_thread
        source = self._source
        if getattr(source, "driven", False):
            close = getattr(source, "close", None)

            async def withdraw() -> None:
                if close is not None:
                    await run(close)

            tokens: AsyncIterator[int] = source.aiter()  # type: ignore[attr-defined]
            return AsyncTextStream(tokens, self._tokenizer, self._params, on_close=withdraw)
        return AsyncTextStream(_ThreadedTokens(source, run), self._tokenizer, self._params)

    def _counted(self) -> Iterator[int]:
        for token in self._source:
            self.tokens += 1
            yield token

    def _run(self) -> Iterator[str]:
        text = self._text
        for token in self._counted():
            piece = text.feed(token)
            if piece:
                yield piece
            if text.ended:
                break
        piece = text.end()
        if piece:
            yield piece


class AsyncTextStream(AsyncIterator[str]):
    """``TextStream``'s asyncio twin: ``async for`` over the text pieces of an answer whose tokens arrive
    from ``tokens`` (an async iterator). ``tokens`` and ``finish_reason`` as ``TextStream``'s; ``aclose()``
    stops decoding (the token source is closed, and ``on_close`` awaited: the answer is withdrawn)."""

    def __init__(
        self,
        tokens: AsyncIterator[int],
        tokenizer: object,
        params: SamplingParams,
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.tokens = 0
        self._source = tokens
        self._text = _Pieces(tokenizer, params)
        self._on_close = on_close
        self._pieces = self._run()

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> str:
        return await self._pieces.__anext__()

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._text.finish_reason

    async def text(self) -> str:
        """The rest of the answer, as one string."""
        return "".join([piece async for piece in self])

    async def aclose(self) -> None:
        """Stop decoding (the token source is closed too)."""
        await self._pieces.aclose()
        close = getattr(self._source, "aclose", None)
        if close is not None:
            await close()
        if self._on_close is not None:
            await self._on_close()

    async def _run(self) -> AsyncIterator[str]:
        text = self._text
        async for token in self._source:
            self.tokens += 1
            piece = text.feed(token)
            if piece:
                yield piece
            if text.ended:
                break
        piece = text.end()
        if piece:
            yield piece


class _ThreadedTokens(AsyncIterator[int]):
    """A blocking token iterator read one token at a time on worker threads (each read may run a forward).
    Reads and the close take one lock, so a close while a read still runs (its awaiting task cancelled) waits
    for that read instead of failing on a generator that is executing."""

    def __init__(self, tokens: Iterator[int], to_thread: ThreadRunner) -> None:
        self._tokens, self._to_thread = tokens, to_thread
        self._lock = threading.Lock()
        self._end = object()

    def __aiter__(self) -> _ThreadedTokens:
        return self

    async def __anext__(self) -> int:
        token = await self._to_thread(self._next)
        if token is self._end:
            raise StopAsyncIteration
        return token  # type: ignore[return-value]

    async def aclose(self) -> None:
        await self._to_thread(self._close)

    def _next(self) -> object:
        with self._lock:
            return next(self._tokens, self._end)

    def _close(self) -> None:
        with self._lock:
            close = getattr(self._tokens, "close", None)
            if close is not None:
                close()


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    hits = [text.find(s, max(0, start - len(s))) for s in stops if s]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best

"""Constrained decoding: the model may only emit what a JSON schema, a regex or a Lark grammar admits.

An agent needs actions it can parse (a click at coordinates, a tool name with its arguments); a small
model left alone emits broken JSON. At every decode step the grammar's matcher (llguidance) gives the set
of tokens that keep the output a prefix of some admitted string; every other token's logit becomes
``-inf`` before the token is picked, greedy or sampled, and the picked token advances the matcher. Once
the grammar is complete only end-of-sequence remains, so the answer ends there. llguidance is an optional
dependency (``pip install 'kamera[structured]'``), imported when a grammar is first compiled.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .errors import ConstraintError, InvalidInputError

GrammarKind = Literal["json_schema", "regex", "lark"]

#: JSON output in one fixed layout, the one most JSON a model has read uses (``json.dumps``'s default
#: separators ``", "`` and ``": "``): no free whitespace, so no token is spent on layout and a bounded
#: answer completes sooner; and the separators a model expects, so after ``"key":`` its usual next token
#: (`` "``, a space and a quote) is admitted instead of being masked into an odd value (a nested object)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Grammar:
    """What a constrained answer must match. Build one with ``json_schema``, ``regex`` or ``lark``."""

    kind: GrammarKind
    source: str  # the schema as JSON text, the regex, or the Lark grammar
    #: the loop guard for answers that are JSON (0: off): once the last ``string_loop_tokens`` tokens of a
    #: JSON string repeat a run of as many tokens already written in that same string, the model is looping
    #: (greedy decoding repeats such a run for ever), and only tokens that close the string are admitted,
    #: where the grammar admits one there. The answer still matches the grammar; it is just not spent on one
    #: string until ``max_tokens`` runs out, so the fields after it come.
    string_loop_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.string_loop_tokens, int) or self.string_loop_tokens < 0:
            raise InvalidInputError(f"string_loop_tokens must be an int >= 0, got {self.string_loop_tokens!r}")

    def with_loop_guard(self, tokens: int) -> Grammar:
        """The same grammar with ``string_loop_tokens = tokens`` (for grammars whose answers are JSON)."""
        return Grammar(self.kind, self.source, tokens)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool) -> Grammar:
        """Any JSON document valid under ``schema`` (a dict, its JSON text, or ``True`` for any object)."""
        if schema is True:
            schema = {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidInputError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, Mapping):
            raise InvalidInputError(f"a JSON schema must be an object, got {type(schema).__name__}")
        # the schema's own key order: llguidance emits an object's properties in the order they are listed,
        # so a model writes them as the schema's author ordered them (a name before its arguments, a
        # required ``setup`` before an optional ``punchline``), never alphabetically
        grammar = cls("json_schema", json.dumps(schema))
        grammar.compile()  # refuse a schema the compiler cannot take now, not at the first token
        return grammar

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text fully matching ``pattern``."""
        if not isinstance(pattern, str) or not pattern:
            raise InvalidInputError("a regex grammar needs a non-empty pattern string")
        grammar = cls("regex", pattern)
        grammar.compile()
        return grammar

    @classmethod
    def lark(cls, source: str) -> Grammar:
        """Text in the language of a Lark grammar (llguidance's dialect, start rule ``start``)."""
        if not isinstance(source, str) or not source.strip():
            raise InvalidInputError("a Lark grammar needs a non-empty grammar string")
        grammar = cls("lark", source)
        grammar.compile()
        return grammar

    def compile(self) -> str:
        """The grammar in llguidance's form (``InvalidInputError`` when it does not compile)."""
        lg = _llguidance()
        try:
            if self.kind == "json_schema":
                text = lg.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT)
            elif self.kind == "regex":
                text = lg.LLMatcher.grammar_from_regex(self.source)
            else:
                text = lg.LLMatcher.grammar_from_lark(self.source)
        except ValueError as exc:
            raise InvalidInputError(f"the {self.kind} grammar does not compile: {exc}") from None
        error = lg.LLMatcher.validate_grammar(text)
        if error and not error.startswith("WARNING"):
            raise InvalidInputError(f"the {self.kind} grammar does not compile: {error}")
        return text


class TokenConstraint:
    """One answer's walk through a grammar: masks logits, then advances on the token picked."""

    def __init__(self, grammar: Grammar, tokenizer: Any, vocab_size: int) -> None:
        lg = _llguidance()
        self._tok = _ll_tokenizer(tokenizer)
        self._matcher = lg.LLMatcher(self._tok, grammar.compile(), log_level=0)
        if self._matcher.is_error():
            raise InvalidInputError(f"the {grammar.kind} grammar does not compile: {self._matcher.get_error()}")
        self._vocab = vocab_size
        self._bitmask = _torch_helpers().allocate_token_bitmask(1, self._tok.vocab_size)
        guard = grammar.string_loop_tokens
        self._loop = _StringLoop(guard, tokenizer, self._tok) if guard else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids the grammar ends with (the tokenizer's end-of-sequence)."""
        return tuple(int(t) for t in self._tok.eos_tokens)

    @property
    def finished(self) -> bool:
        """The grammar admits nothing more (only end-of-sequence)."""
        return bool(self._matcher.is_stopped())

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits (vocab,) of every token the grammar does not admit next to ``-inf``, in place."""
        self._check()
        lt = _torch_helpers()
        lt.fill_next_token_bitmask(self._matcher, self._bitmask)
        n = self._tok.vocab_size
        head = logits[:n]
        lt.apply_token_bitmask_inplace(head, self._bitmask[0])
        if logits.shape[0] > n:  # model rows past the tokenizer's vocabulary are never admitted
            logits[n:] = float("-inf")
        if self._loop is not None and self._loop.looping:
            self._loop.close_(logits)
        return logits

    def advance(self, token: int) -> None:
        """Feed the token that was picked to the matcher."""
        self._matcher.consume_token(int(token))
        self._check()
        if self._loop is not None:
            self._loop.feed(int(token))

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"constrained decoding failed: {self._matcher.get_error()}")


class _StringLoop:
    """Where a JSON answer is (inside a string or not) and whether that string is repeating itself.

    An answer that opens with ``{`` or ``[`` is JSON (the grammar says so), so a quote that is not escaped
    opens or closes a string; the scan is over the tokens' bytes (a quote or backslash byte is never part of
    a multi-byte character). An answer that opens otherwise is not scanned.
    """

    def __init__(self, n: int, tokenizer: Any, ll_tokenizer: Any) -> None:
        self._n = n
        self._bytes = ll_tokenizer.decode_bytes
        self._closers = _closing_tokens(tokenizer, ll_tokenizer)
        self._in_string = False
        self._escaped = False
        self._run: list[int] = []  # tokens written in the current string
        self._json: bool | None = None  # does the answer open as a JSON object or array (None: not known yet)
        self.looping = False

    def feed(self, token: int) -> None:
        for byte in self._bytes([token]):
            if self._json is None and byte not in b" \t\r\n":
                self._json = byte in b"{["  # an answer that opens as text (a Lark TEXT branch) is never scanned
            if not self._json:
                continue
            if self._escaped:
                self._escaped = False
            elif self._in_string and byte == 0x5C:  # backslash
                self._escaped = True
            elif byte == 0x22:  # quote
                self._in_string = not self._in_string
                self._run = []
        if self._in_string:
            self._run.append(token)
        n, run = self._n, self._run
        tail = run[-n:]
        self.looping = (
            self._in_string and len(run) >= 2 * n and any(run[i : i + n] == tail for i in range(len(run) - 2 * n + 1))
        )

    def close_(self, logits: torch.Tensor) -> None:
        """Keep only the admitted tokens that close the string (all admitted ones when none does)."""
        closers = self._closers.to(logits.device)
        m = min(logits.shape[0], closers.shape[0])
        admitted = torch.isfinite(logits[:m]) & closers[:m]
        if bool(admitted.any()):
            logits[:m][~closers[:m]] = float("-inf")
            logits[m:] = float("-inf")


# --- lazy imports and per-tokenizer cache -------------------------------------------------------------
_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_CLOSERS: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()


def _closing_tokens(tokenizer: Any, ll_tokenizer: Any) -> torch.Tensor:
    """(vocab,) bool: the tokens whose text starts with a quote (inside a JSON string, they close it)."""
    cached = _CLOSERS.get(tokenizer)
    if cached is None:
        decode = ll_tokenizer.decode_bytes
        ids = [i for i in range(ll_tokenizer.vocab_size) if decode([i])[:1] == b'"']
        cached = torch.zeros(ll_tokenizer.vocab_size, dtype=torch.bool)
        cached[ids] = True
        _CLOSERS[tokenizer] = cached
    return cached


def _ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of a Hugging Face tokenizer, built once per tokenizer (it walks the vocabulary)."""
    cached = _TOKENIZERS.get(tokenizer)
    if cached is None:
        import llguidance.hf

        try:
            cached = llguidance.hf.from_tokenizer(tokenizer)
        except Exception as exc:  # not a fast (Rust-backed) tokenizer, or an unreadable vocabulary
            raise InvalidInputError(f"constrained decoding needs a fast Hugging Face tokenizer: {exc}") from exc
        _TOKENIZERS[tokenizer] = cached
    return cached


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # an optional extra
        raise InvalidInputError(
            "constrained decoding (JSON schemas, tools, grammars) needs llguidance: pip install 'kamera[structured]'"
        ) from exc
    return llguidance


def _torch_helpers() -> Any:
    _llguidance()
    import llguidance.torch

    return llguidance.torch

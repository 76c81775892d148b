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

#: JSON output without free whitespace: every token carries content, so a bounded answer completes sooner
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class Grammar:
    """What a constrained answer must match. Build one with ``json_schema``, ``regex`` or ``lark``."""

    kind: GrammarKind
    source: str  # the schema as JSON text, the regex, or the Lark grammar

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
        grammar = cls("json_schema", json.dumps(schema, sort_keys=True))
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
                text = lg.LLMatcher.grammar_from_json_schema(self.source, defaults=_JSON_OPTIONS)
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
        return logits

    def advance(self, token: int) -> None:
        """Feed the token that was picked to the matcher."""
        self._matcher.consume_token(int(token))
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"constrained decoding failed: {self._matcher.get_error()}")


# --- lazy imports and per-tokenizer cache -------------------------------------------------------------
_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


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

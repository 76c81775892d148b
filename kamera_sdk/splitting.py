"""Long texts as runs of chunks: split at paragraph, then sentence, then word boundaries under a token limit.

A chunk is the unit Kamera stores, moves and re-conditions, so a 20-page document added as one chunk is
re-prefilled whole whenever anything in front of it changes, and may not fit a window's budget at all.
Split at the coarsest boundary that fits: a paragraph stays whole when it can, a sentence when the
paragraph cannot, a word when a sentence cannot. Each piece keeps its own trailing whitespace, so the
pieces joined are the text again, and a piece never exceeds the limit as the tokenizer counts it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kamera_engine import InvalidInputError
from kamera_engine.errors import positive_int

#: boundaries from coarse to fine; each pattern's matches end with the separator they keep
_LEVELS = (
    re.compile(r".*?(?:\n[ \t]*\n\s*|$)", re.S),  # paragraphs: up to and including a blank line
    re.compile(r".*?(?:[.!?;:][\"')\]]*\s+|\n+|$)", re.S),  # sentences (and lines)
    re.compile(r"\S*\s*"),  # words with their trailing space
)


def split_text(text: str, count: Callable[[str], int], max_tokens: int) -> list[str]:
    """``text`` as pieces of at most ``max_tokens`` tokens each (``count`` counts a string's tokens),
    split at the coarsest boundaries that fit and packed greedily; ``"".join(pieces) == text``."""
    max_tokens = positive_int("max_chunk_tokens", max_tokens)
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError("add_document needs a non-empty string")
    return [p for p in _split(text, count, max_tokens, 0) if p]


def _split(text: str, count: Callable[[str], int], limit: int, level: int) -> list[str]:
    if count(text) <= limit:
        return [text]
    if level == len(_LEVELS):  # one word longer than the limit: cut it by characters
        return _cut(text, count, limit)
    units = [u for u in _LEVELS[level].findall(text) if u]
    if len(units) <= 1:
        return _split(text, count, limit, level + 1)
    pieces: list[str] = []
    current = ""
    for unit in units:
        if current and count(current + unit) <= limit:
            current += unit
            continue
        if current:
            pieces.append(current)
        if count(unit) <= limit:
            current = unit
        else:
            pieces.extend(_split(unit, count, limit, level + 1))
            current = ""
    if current:
        pieces.append(current)
    return pieces


def _cut(text: str, count: Callable[[str], int], limit: int) -> list[str]:
    """The longest prefixes that fit, one after another (a binary search per piece)."""
    pieces: list[str] = []
    while text:
        lo, hi = 1, len(text)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(text[:mid]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        pieces.append(text[:lo])
        text = text[lo:]
    return pieces

"""Long texts as runs of chunks: ``split_text`` and ``ContextWindow.add_document``."""

from __future__ import annotations

import pytest

from kamera_engine import ContextLengthError, InvalidInputError
from kamera_sdk import ContextWindow
from kamera_sdk.splitting import split_text
from tests.conftest import tiny_chat_engine

PARA = "The tower was finished in 1889. It was built for the fair! Was it loved? Not at first; later, yes."
DOC = "\n\n".join(f"Section {i}. {PARA}" for i in range(6)) + "\n"


def words(text: str) -> int:
    return len(text.split())


@pytest.fixture(scope="module")
def chat():
    return tiny_chat_engine()


def test_pieces_join_to_the_text_and_fit() -> None:
    for limit in (1, 3, 8, 25, 60, 10_000):
        pieces = split_text(DOC, words, limit)
        assert "".join(pieces) == DOC
        assert all(words(p) <= limit for p in pieces)


def test_coarsest_boundary_that_fits() -> None:
    paragraphs = split_text(DOC, words, words(PARA) + 2)  # a paragraph fits, two do not
    assert len(paragraphs) == 6 and all(p.startswith("Section") for p in paragraphs)
    sentences = split_text(DOC, words, 8)  # a paragraph does not fit: sentences, packed
    assert all(p.rstrip()[-1] in ".!?;" for p in sentences[:-1])
    assert split_text("antidisestablishmentarianism", len, 7) == ["antidis", "establi", "shmenta", "rianism"]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_bad_limits_are_refused(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="max_chunk_tokens"):
        split_text(DOC, words, bad)  # type: ignore[arg-type]


def test_add_document_adds_a_run_of_chunks_in_order(chat) -> None:
    win = ContextWindow(chat)
    ids = win.add_document(DOC, max_chunk_tokens=40)
    assert win.chunks == ids and len(ids) > 1
    texts = [win.chunk(c).text for c in ids]
    assert "".join(texts).strip() == DOC.strip()
    assert all(len(chat.tokenize(t)) <= 40 for t in texts)
    assert win.add_document(DOC, max_chunk_tokens=40) == ids  # the same pieces: the same chunks, nothing new
    assert len(win) == len(ids)


def test_a_refused_document_changes_nothing(chat) -> None:
    win = ContextWindow(chat, budget_tokens=30)
    first = win.add_text("A short note.")
    with pytest.raises(InvalidInputError, match="max_chunk_tokens"):
        win.add_document(DOC, max_chunk_tokens=0)
    with pytest.raises(InvalidInputError, match=r"does not fit in budget_tokens=30; .*add_document"):
        win.add_text(DOC)
    assert win.chunks == [first]
    ids = win.add_document(DOC)  # default: at most the budget per chunk; the window slides to stay in it
    assert all(len(win.chunk(c)) <= 30 for c in ids) and win.tokens <= 30


def test_a_chunk_longer_than_the_context_names_add_document(chat) -> None:
    win = ContextWindow(chat)
    chat_limit = chat.context_length
    chat.context_length = 64
    try:
        with pytest.raises(ContextLengthError, match="add_document"):
            win.add_text(DOC)
        assert len(win) == 0
        assert len(win.add_document(DOC, max_chunk_tokens=32)) > 1
    finally:
        chat.context_length = chat_limit

"""A web-research agent: search results arrive as pages, the agent reranks them and re-reads old ones.

Each question triggers a (simulated) web search over the Carrow Coast corpus that ships with Kamera.
New result pages are added to the window; when the window is full, the least relevant page is evicted;
before answering, the agent reranks the window so the most relevant page sits closest to the question
(``reorder``); at the end it goes back to the first question and re-reads the pages it evicted
(``recall``). With Kamera a reranked or re-read page is placed from stored KV (an exact rotation plus a
small patch), where an engine without Kamera (``policy="recompute"``) re-prefills the whole window.

    python examples/web_research_agent.py            # full session
    python examples/web_research_agent.py --short    # a few steps (CI)
"""

from __future__ import annotations

import re

from _common import SideBySide, arg_parser, load_engine, sentences

from kamera_sdk import ChunkId
from kamera_sdk.bench.corpus import Page, load_corpus

STOPWORDS = frozenset("the a an of in on at to by is was what which who whose how and or for with run does".split())


def words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if w not in STOPWORDS and len(w) > 2}


def relevance(page: Page, query: str) -> int:
    """Keyword overlap between a page and the query (title words count double)."""
    q = words(query)
    return len(q & words(page.text)) + 2 * len(q & words(page.title))


def search(pages: list[Page], query: str, k: int) -> list[Page]:
    """A stand-in for a web search API: the ``k`` most relevant pages, best first."""
    return sorted(pages, key=lambda p: -relevance(p, query))[:k]


def main() -> None:
    args = arg_parser(__doc__).parse_args()
    n_sentences = 1 if args.short else None  # short mode reads the opening of each page only
    max_pages, hits, max_new = (3, 2, 4) if args.short else (4, 3, 16)
    corpus = load_corpus()
    questions = corpus.demo.questions[:2] if args.short else corpus.demo.questions
    engine = load_engine(args.device)
    session = SideBySide(engine)
    page_of: dict[ChunkId, Page] = {}

    def read(page: Page, query: str) -> None:
        """Put a result page in the window: re-read it if it was evicted, add it if it is new."""
        text = f"Search result: {page.title}\n{sentences(page.text, n_sentences)}\n\n"
        known = [cid for cid, p in page_of.items() if p.id == page.id]
        if known and known[0] in session.chunks:
            return
        if len(session.chunks) >= max_pages:  # full: drop the page least relevant to the current question
            worst = min(session.chunks, key=lambda cid: relevance(page_of[cid], query))
            print(f"    evict {page_of[worst].title!r}")
            session.evict(worst)
        if known and known[0] in session.evicted:
            print(f"    re-read {page.title!r} (recall)")
            session.recall(known[0])
        else:
            print(f"    read {page.title!r}")
            page_of[session.add_text(text)] = page

    def rerank(query: str) -> None:
        """Move the most relevant page last, right before the question."""
        best = max(session.chunks, key=lambda cid: relevance(page_of[cid], query))
        if best != session.chunks[-1]:
            print(f"    rerank: {page_of[best].title!r} moves last, next to the question")
            session.reorder([c for c in session.chunks if c != best] + [best])

    for step, q in enumerate(questions, 1):
        query = q.question
        print(f"\n[{step}] search: {query}  (expected: {q.answer})")
        for page in search(corpus.pages, query, hits):
            read(page, query)
        rerank(query)
        session.ask(f"{query} Answer in a few words.", max_new)

    query = questions[0].question
    print(f"\n[{len(questions) + 1}] back to the first question: {query}")
    for page in search(corpus.pages, query, hits):
        read(page, query)
    order = session.reorder("auto")  # let Kamera place the pages where their stored patches apply
    print("    placement (reorder 'auto'): " + ", ".join(page_of[c].title for c in order))
    session.ask(f"{query} Answer in a few words.", max_new)
    session.report()


if __name__ == "__main__":
    main()

"""A document agent that reads coarse-to-fine and looks back.

The agent first skims a multi-page document (a guide to the Carrow Coast that ships with Kamera): one
short summary chunk per page. For each question it picks the pages whose summaries match best and
zooms in, adding those full pages behind the summaries; only a few full pages fit, so older ones are
evicted. At the end it looks back at the pages it read first: they are recalled behind the summaries,
where they were first read (``recall(at=...)``). With Kamera the summaries keep their KV throughout and
a recalled page is served by the patch stored when it was first read (no forward pass, no re-encode);
without it (``policy="recompute"``) each answer re-prefills the whole window.

    python examples/document_agent.py            # full session
    python examples/document_agent.py --short    # a few steps (CI)
"""

from __future__ import annotations

import re

from _common import SideBySide, arg_parser, load_engine, sentences

from kamera_sdk import ChunkId
from kamera_sdk.bench.corpus import Page, Question, load_corpus


def words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 3}


def summary(page: Page, number: int) -> str:
    """The coarse view of a page: its title and first sentence."""
    return f"Page {number}, {page.title}: {sentences(page.text, 1)}\n"


def pick(pages: list[Page], question: str, k: int) -> list[Page]:
    """The ``k`` pages whose title and summary share the most words with the question."""
    q = words(question)
    return sorted(pages, key=lambda p: -len(q & words(p.title + " " + sentences(p.text, 1))))[:k]


def main() -> None:
    args = arg_parser(__doc__).parse_args()
    corpus = load_corpus()
    page_ids = corpus.demo.pages[:4] if args.short else corpus.demo.pages
    questions: list[Question] = corpus.demo.questions[:2] if args.short else corpus.demo.questions
    detail, max_full, max_new = (2, 2, 4) if args.short else (None, 3, 16)
    pages = [corpus.page(pid) for pid in page_ids]
    engine = load_engine(args.device)
    session = SideBySide(engine)

    print(f"[skim] {len(pages)} page summaries")
    summaries = [session.add_text(summary(p, i)) for i, p in enumerate(pages, 1)]
    if not args.short:
        session.ask("Which places and people does this document describe? Answer briefly.", max_new)

    full: dict[str, ChunkId] = {}  # page id -> chunk of its full text (in the window or evicted)
    order: list[str] = []  # page ids of full pages in the window, oldest first

    def zoom_in(page: Page, at: int | None = None) -> None:
        if page.id in full and full[page.id] in session.chunks:
            return
        if len(order) >= max_full:
            oldest = order.pop(0)
            print(f"    evict full page {corpus.page(oldest).title!r}")
            session.evict(full[oldest])
        if page.id in full:
            print(f"    look back at {page.title!r} (recall at slot {at})")
            session.recall(full[page.id], at=at)
        else:
            print(f"    zoom in: {page.title!r}")
            full[page.id] = session.add_text(f"{page.title}\n{sentences(page.text, detail)}\n\n")
        order.append(page.id)

    for step, q in enumerate(questions, 1):
        print(f"\n[{step}] {q.question}  (expected: {q.answer})")
        for page in pick(pages, q.question, 2):
            zoom_in(page)
        session.ask(f"{q.question} Answer in a few words.", max_new)

    first = questions[0]
    print(f"\n[look back] {first.question}  (expected: {first.answer})")
    for i, page in enumerate(pick(pages, first.question, 2)):
        zoom_in(page, at=len(summaries) + i)  # back where it was: right behind the summaries
    session.ask(f"{first.question} Answer in a few words.", max_new)
    session.report()


if __name__ == "__main__":
    main()

"""A LangChain conversation loop on ``ChatKamera``, with ``trim_messages`` keeping the history short.

A user reads a guide to the Carrow Coast to the assistant one note per turn and, once the notes a
question needs have been read, asks it. The history is trimmed with LangChain's own ``trim_messages``
(keep the system message and the latest turns) before every call, as an agent without Kamera would.
``ChatKamera`` maps the message list onto a ``ContextWindow``: messages it has seen keep their KV,
trimmed ones slide out, so each turn prefills little more than the new message. The same loop runs on
``ChatKamera(policy="recompute")``, which re-prefills the whole trimmed history every turn, as an
engine without Kamera does.

    python examples/langchain_agent.py            # full session
    python examples/langchain_agent.py --short    # a few turns (CI)
"""

from __future__ import annotations

import time

from _common import arg_parser, load_engine, report, sentences
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage, trim_messages

from kamera_langchain import ChatKamera
from kamera_sdk.bench.corpus import load_corpus

SYSTEM = (
    "You are a helpful guide to the Carrow Coast. The user reads you notes from a guidebook, one per turn. "
    "When a note comes with a question, answer it in a few words using the notes; otherwise reply 'Noted.'"
)


def main() -> None:
    args = arg_parser(__doc__).parse_args()
    turns, n_sentences, trim_to, max_tokens = (3, 1, 200, 4) if args.short else (6, None, 800, 16)
    engine = load_engine(args.device)
    llms = {p: ChatKamera(engine=engine, policy=p, max_tokens=max_tokens) for p in ("kamera", "recompute")}
    wall_s = dict.fromkeys(llms, 0.0)
    corpus = load_corpus()
    pages = [corpus.page(pid) for pid in corpus.demo.pages[:turns]]
    ask_after = {q.pages[-1]: q for q in corpus.demo.questions}  # asked once its last page has been read
    history: list[BaseMessage] = [SystemMessage(SYSTEM)]

    for i, page in enumerate(pages, 1):
        q = ask_after.get(page.id)
        ask = f"Question: {q.question}" if q else "No question yet."
        history.append(HumanMessage(f"Note {i}, {page.title}: {sentences(page.text, n_sentences)}\n{ask}"))
        before = len(history)
        history = trim_messages(
            history,
            max_tokens=trim_to,
            token_counter=llms["kamera"],
            strategy="last",
            include_system=True,
            start_on="human",
        )
        expected = f" (expected: {q.answer})" if q else ""
        print(f"\n[turn {i}] note on {page.title!r}, {ask}{expected}")
        print(f"    trim_messages kept {len(history)} messages, dropped {before - len(history)}")
        replies = {}
        for name, llm in llms.items():
            t0 = time.perf_counter()
            replies[name] = llm.invoke(history)
            wall_s[name] += time.perf_counter() - t0
        parts = []
        for name, reply in replies.items():
            meta = reply.response_metadata["kamera"]
            cached = (reply.usage_metadata or {}).get("input_token_details", {}).get("cache_read", 0)
            parts.append(f"{name}: {reply.content!r} ({meta['tokens_prefilled']} prefilled, {cached} cached)")
        print("    " + "   ".join(parts))
        history.append(replies["kamera"])  # the conversation continues with Kamera's answer

    print()
    report(llms["kamera"].window().stats(), llms["recompute"].window().stats(), wall_s)


if __name__ == "__main__":
    main()

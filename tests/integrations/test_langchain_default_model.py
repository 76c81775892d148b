"""ChatKamera on the embedded default model (SmolLM2-135M-Instruct): invoke, stream, batch, and a 10-turn
conversation trimmed with ``trim_messages``, prefilling >= 5x fewer tokens than the same model re-prefilling
every call (``policy="recompute"``).

Reproduce the printed counts: ``.venv/bin/python -m pytest -s -q tests/integrations/test_langchain_default_model.py``
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessageChunk, BaseMessage, HumanMessage, SystemMessage, trim_messages

from kamera_langchain import ChatKamera
from kamera_sdk import Engine

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a careful research assistant reading field notes about European rivers, one note per turn. "
    "Answer the question in the note in a few words, using only the notes you have seen. "
    "If a later note contradicts an earlier one, trust the later note. Do not speculate, do not invent "
    "numbers, dates or names, and do not repeat the note back. If the notes do not contain the answer, say "
    "you do not know. Write plain English without lists or markdown. Older notes may have been removed "
    "to save space; that is expected."
)
NOTES = [
    "The Danube ends in the Black Sea. Where does the Danube end?",
    "The Rhine rises in the Swiss Alps. Where does the Rhine rise?",
    "The Seine flows through Paris. Which city does the Seine cross?",
    "The Thames flows through London. Which city does the Thames cross?",
    "The Loire is the longest river in France. Which is France's longest river?",
    "The Elbe passes Dresden and Hamburg. Which port does the Elbe pass?",
    "The Po flows into the Adriatic Sea. Where does the Po flow?",
    "The Vistula passes Warsaw. Which capital does the Vistula pass?",
    "The Tagus reaches the Atlantic at Lisbon. Where does the Tagus end?",
    "The Volga is the longest river in Europe. Which river is longest?",
]
TRIM_TOKENS = 260  # trim_messages budget: the system message (115 tokens) plus the latest notes and answers
REPLY_TOKENS = 8


def test_invoke_stream_batch(default_engine: Engine) -> None:
    llm = ChatKamera(engine=default_engine, max_tokens=12)
    question = [HumanMessage("What is the capital of France?")]
    reply = llm.invoke(question)
    assert "Paris" in reply.content
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] > 0
    assert reply.response_metadata["model_name"] == "SmolLM2-135M-Instruct"

    chunks = list(llm.stream(question, session_id="stream"))
    assert all(isinstance(c, AIMessageChunk) for c in chunks) and len(chunks) > 2
    assert "".join(str(c.content) for c in chunks) == reply.content  # greedy: same answer

    questions = ["What is the capital of Germany?", "What is the capital of Japan?", "What is 2 + 2?"]
    configs = [{"metadata": {"session_id": f"batch-{i}"}} for i in range(len(questions))]
    answers = llm.batch(questions, config=configs)  # type: ignore[arg-type]
    assert "Berlin" in answers[0].content and "Tokyo" in answers[1].content and "4" in answers[2].content
    assert {f"batch-{i}" for i in range(3)} <= set(llm.sessions)


def test_ten_turns_with_trimming_prefill_5x_fewer_tokens(default_engine: Engine) -> None:
    kamera = ChatKamera(engine=default_engine, max_tokens=REPLY_TOKENS)
    recompute = ChatKamera(engine=default_engine, max_tokens=REPLY_TOKENS, policy="recompute")
    history: list[BaseMessage] = [SystemMessage(SYSTEM)]
    agree = 0
    for i, note in enumerate(NOTES):
        history.append(HumanMessage(f"Note {i + 1}: {note}"))
        history = trim_messages(
            history,
            max_tokens=TRIM_TOKENS,
            token_counter=kamera,
            strategy="last",
            include_system=True,
            start_on="human",
        )
        reply = kamera.invoke(history)
        agree += reply.content == recompute.invoke(history).content  # same inputs, both policies
        history.append(reply)
    k, r = kamera.window().stats(), recompute.window().stats()
    assert kamera.window().evicted, "the conversation must outgrow the trimming budget"
    print(
        f"\n10 turns, trim_messages to {TRIM_TOKENS} tokens, {REPLY_TOKENS}-token replies:"
        f"\n  tokens prefilled   ChatKamera {k.tokens_prefilled:5d}   recompute {r.tokens_prefilled:5d}"
        f"   ratio {r.tokens_prefilled / k.tokens_prefilled:.1f}x"
        f"\n  + canonical ingest ChatKamera {k.tokens_prefilled + k.ingest_tokens:5d}"
        f"   recompute {r.tokens_prefilled + r.ingest_tokens:5d}"
        f"   ratio {(r.tokens_prefilled + r.ingest_tokens) / (k.tokens_prefilled + k.ingest_tokens):.1f}x"
        f"\n  greedy answers equal to recompute: {agree}/10"
    )
    assert r.tokens_prefilled >= 5 * k.tokens_prefilled
    assert agree >= 7

"""ChatKamera mechanics on a tiny random model with the default model's tokenizer (fast): how message lists
become window operations, sessions, metadata, rendering and the refusals."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import transformers as T
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage, trim_messages

from kamera_engine.default_model import ensure_converted
from kamera_langchain import ChatFormat, ChatKamera, ImageInputError
from kamera_langchain._messages import message_text
from kamera_sdk import ContextLengthError, Engine, InvalidInputError, KameraError
from tests.conftest import tiny_chat_engine


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The default model's tokenizer alone (no weights loaded)."""
    return T.AutoTokenizer.from_pretrained(str(ensure_converted()))


@pytest.fixture(scope="module")
def tiny() -> Engine:
    """A 2-layer random Llama over the real vocabulary and chat template."""
    return tiny_chat_engine()


def chat(tiny: Engine, **kw: Any) -> ChatKamera:
    return ChatKamera(engine=tiny, max_tokens=3, **kw)


def ops(reply: BaseMessage) -> dict[str, Any]:
    return reply.response_metadata["kamera"]["window_ops"]


SYS = SystemMessage("You answer in one word.")


def turns(n: int) -> list[BaseMessage]:
    out: list[BaseMessage] = []
    for i in range(n):
        out += [HumanMessage(f"question {i}: what is {i} plus {i}?"), AIMessage(f"{2 * i}")]
    return out


# --- rendering -------------------------------------------------------------------------------------
def test_format_is_read_off_the_chat_template(tokenizer: Any) -> None:
    fmt = ChatFormat.from_tokenizer(tokenizer)
    assert fmt.source == "template"
    assert fmt.anchor.startswith("<|im_start|>system\n") and fmt.anchor.endswith("<|im_end|>\n")
    assert fmt.generation == "<|im_start|>assistant\n"
    assert fmt.render("user", "hi") == "<|im_start|>user\nhi<|im_end|>\n"
    # anchor + turns + generation prompt is exactly what the template renders for the same chat
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
    ours = fmt.anchor + "".join(fmt.render(m["role"], m["content"]) for m in msgs) + fmt.generation
    assert ours == tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


class _StrictTemplate:
    """A tokenizer stub whose template renders only system/user/assistant turns."""

    chat_template = "stub"
    bos_token = "<s>"

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> str:
        out = "<s>"
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError("roles must alternate")
            out += f"[{m['role'].upper()}]{m['content']}[/{m['role'].upper()}]"
        return out + ("[ASSISTANT]" if add_generation_prompt else "")


def test_format_falls_back_per_role_and_without_template() -> None:
    fmt = ChatFormat.from_tokenizer(_StrictTemplate())
    assert fmt.anchor == "<s>" and fmt.generation == "[ASSISTANT]"
    assert fmt.render("tool", "42") == "[USER][tool] 42[/USER]"

    class NoTemplate:
        chat_template = None
        bos_token = "<s>"

    plain = ChatFormat.from_tokenizer(NoTemplate())
    assert plain.source == "plain" and plain.render("user", "hi") == "User: hi\n\n"


def test_tool_calls_and_results_are_text() -> None:
    ai = AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1"}])
    assert message_text(ai) == '{"name": "add", "arguments": {"a": 1, "b": 2}}'  # as a constrained call is emitted
    assert message_text(ToolMessage("3", tool_call_id="c1")) == "3"
    anthropic = AIMessage(
        [{"type": "text", "text": "let me add"}, {"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1}}],
        tool_calls=[{"name": "add", "args": {"a": 1}, "id": "c1"}],
    )
    assert message_text(anthropic) == 'let me add\n{"name": "add", "arguments": {"a": 1}}'  # the call once
    parts = HumanMessage(content=[{"type": "text", "text": "a"}, "b"])
    assert message_text(parts) == "ab"


def test_image_parts_are_refused_not_dropped(tiny: Engine) -> None:
    llm = chat(tiny)
    img = HumanMessage(
        content=[{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]
    )
    with pytest.raises(ImageInputError, match="vision-language") as err:
        llm.invoke([img])
    assert isinstance(err.value, KameraError) and isinstance(err.value, NotImplementedError)
    assert llm.window().chunks == []  # nothing changed
    with pytest.raises(InvalidInputError, match="audio"):
        llm.invoke([HumanMessage(content=[{"type": "audio", "url": "x"}])])


# --- message lists -> window operations ------------------------------------------------------------
def test_growing_history_reuses_every_earlier_message(tiny: Engine) -> None:
    llm = chat(tiny)
    first = llm.invoke([SYS, HumanMessage("hello")])
    assert ops(first)["added"] == 2
    history = [SYS, HumanMessage("hello"), first, HumanMessage("again")]
    second = llm.invoke(history)
    assert ops(second) == {"added": 2, "recalled": 0, "reused": 2, "slid": 0, "evicted": 0, "reordered": False}
    win = llm.window()
    assert [win.chunk(c).text for c in win.chunks] == llm.render(history)
    # only the two new messages were prefilled; the system message and "hello" were served from the window
    new_tokens = sum(len(tiny.tokenize(t)) for t in llm.render(history[2:]))
    assert second.response_metadata["kamera"]["tokens_prefilled"] == new_tokens


def test_trimming_slides_or_evicts_never_recomputes(tiny: Engine) -> None:
    llm = chat(tiny)
    history = [*turns(4), HumanMessage("last")]
    llm.invoke(history)
    slid = llm.invoke(history[2:])  # oldest pair trimmed, no system message: a slide
    assert ops(slid)["slid"] == 2 and ops(slid)["added"] == 0
    assert slid.response_metadata["kamera"]["tokens_prefilled"] == 0

    llm2 = chat(tiny)
    history = [SYS, *turns(4), HumanMessage("last")]
    llm2.invoke(history)
    kept = trim_messages(
        history, max_tokens=60, token_counter=llm2, strategy="last", include_system=True, start_on="human"
    )
    assert kept[0] is SYS and len(kept) < len(history)
    reply = llm2.invoke(kept)  # trimmed behind the system message: evictions
    assert ops(reply)["evicted"] == len(history) - len(kept) and ops(reply)["added"] == 0
    assert reply.response_metadata["kamera"]["tokens_prefilled"] == 0
    assert llm2.window().tokens == llm2.get_num_tokens_from_messages(kept)


def test_reorder_recall_and_duplicates(tiny: Engine) -> None:
    llm = chat(tiny)
    a, b, c = HumanMessage("alpha"), HumanMessage("beta"), HumanMessage("gamma")
    llm.invoke([a, b, c])
    ids = llm.window().chunks
    reply = llm.invoke([c, a, b])
    assert ops(reply)["reordered"] and llm.window().chunks == [ids[2], ids[0], ids[1]]
    llm.invoke([a, c])
    back = llm.invoke([a, b, c])  # b was evicted: recalled, not re-added
    assert ops(back)["recalled"] == 1 and ops(back)["added"] == 0
    assert llm.window().chunks == ids

    dup = [HumanMessage("ok"), AIMessage("fine"), HumanMessage("ok")]
    llm.invoke(dup)
    win = llm.window()
    assert len(win.chunks) == 3 and len(set(win.chunks)) == 3
    assert win.chunk(win.chunks[0]).token_ids == win.chunk(win.chunks[2]).token_ids
    assert ops(llm.invoke(dup)) == {"added": 0, "recalled": 0, "reused": 3, "slid": 0, "evicted": 0, "reordered": False}


def test_sessions_are_separate_windows(tiny: Engine) -> None:
    llm = chat(tiny)
    llm.invoke([HumanMessage("one")], session_id="a")
    llm.invoke([HumanMessage("two")], config={"metadata": {"thread_id": "b"}})
    llm.invoke([HumanMessage("three")])
    assert sorted(llm.sessions) == ["a", "b", "default"]
    assert all(len(llm.window(s)) == 1 for s in llm.sessions)
    assert llm.window("a").chunks != llm.window("b").chunks
    llm.reset("a")
    assert sorted(llm.sessions) == ["b", "default"]


def test_usage_metadata_and_stream_agree(tiny: Engine) -> None:
    llm = chat(tiny, policy="recompute")
    history = [SYS, HumanMessage("hi there")]
    reply = llm.invoke(history)
    usage = reply.usage_metadata
    assert usage is not None
    win = llm.window()
    prompt = len(tiny.tokenize("<|im_start|>assistant\n"))
    assert usage["input_tokens"] == len(win.engine.anchor_ids) + win.tokens + prompt
    finish = reply.response_metadata["finish_reason"]
    assert finish in ("stop", "length")
    assert usage["output_tokens"] == 3 if finish == "length" else 0 < usage["output_tokens"] <= 3  # decoded
    assert reply.response_metadata["kamera"]["tokens_prefilled"] == win.tokens  # recompute: all of it

    chunks = list(llm.stream(history, session_id="fresh"))  # same work on a new window
    assert "".join(str(c.content) for c in chunks) == reply.content
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata is not None
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    assert total.usage_metadata == usage


def test_bad_arguments(tiny: Engine) -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        ChatKamera(engine=tiny, policy="nope")
    with pytest.raises(InvalidInputError, match="unsupported call arguments"):
        chat(tiny).invoke("hi", functions=[{"name": "x"}])
    with pytest.raises(InvalidInputError, match="OpenAI tool dict"):
        chat(tiny).invoke("hi", tools=[{"name": "x"}])
    with pytest.raises(InvalidInputError, match="at least one message"):
        chat(tiny).invoke([])
    # sampling is checked before the window changes: a refused call leaves it as it was
    llm = chat(tiny)
    llm.invoke([SYS, HumanMessage("first")])
    before = (llm.window().chunks, llm.window().evicted)
    with pytest.raises(InvalidInputError, match="temperature"):
        llm.invoke([HumanMessage("another history")], temperature=-1.0)
    assert (llm.window().chunks, llm.window().evicted) == before
    assert llm.invoke([SYS, HumanMessage("first")], max_tokens=None).content is not None  # None: the default


def test_a_conversation_past_the_model_context_is_refused_before_the_window_changes() -> None:
    engine = tiny_chat_engine()
    llm = ChatKamera(engine=engine, max_tokens=4)
    llm.invoke([SYS, HumanMessage("first")])
    win = llm.window()
    before = (win.chunks, win.evicted, win.stats().forwards)
    held = len(win.engine.anchor_ids) + win.tokens + len(engine.tokenize("<|im_start|>assistant\n"))
    engine.context_length = held + 2  # this conversation and a two-token answer, exactly
    with pytest.raises(ContextLengthError, match="context length"):
        llm.invoke([SYS, HumanMessage("first"), AIMessage("ok"), HumanMessage("word " * 60)])
    assert (win.chunks, win.evicted, win.stats().forwards) == before
    with pytest.raises(ContextLengthError, match=rf"{held} tokens \+ 4 to generate"):  # the answer counts too
        llm.invoke([SYS, HumanMessage("first")])
    assert (win.chunks, win.evicted, win.stats().forwards) == before
    assert llm.invoke([SYS, HumanMessage("first")], max_tokens=2).usage_metadata["output_tokens"] == 2


def test_cache_read_counts_only_what_no_forward_computed(tiny: Engine) -> None:
    llm = chat(tiny)
    usage = llm.invoke([SYS, HumanMessage("a fresh window")]).usage_metadata
    assert usage is not None
    # everything but the anchor was computed in this call (canonicals at ingest, then in context)
    anchor = len(llm.window().engine.anchor_ids)  # the conversation's own chat anchor
    assert usage["input_token_details"]["cache_read"] == anchor
    grown = llm.invoke([SYS, HumanMessage("a fresh window"), AIMessage("ok"), HumanMessage("more")])
    assert grown.usage_metadata is not None
    win = llm.window()
    new = sum(len(win.chunk(c)) for c in win.chunks[2:])  # the two new messages, compiled and prefilled
    assert grown.usage_metadata["input_token_details"]["cache_read"] == anchor + win.tokens - new


def test_token_budget_slides_inside_a_call(tiny: Engine) -> None:
    llm = chat(tiny, budget_tokens=40)
    history = [*turns(5), HumanMessage("and now?")]
    reply = llm.invoke(history)
    win = llm.window()
    assert win.tokens <= 40 and win.evicted
    assert win.chunk(win.chunks[-1]).text == llm.render(history[-1:])[0]
    assert reply.usage_metadata is not None


def test_conversations_at_once_from_asyncio_share_the_engines_steps(tiny: Engine) -> None:
    """``ainvoke`` of several conversations at once under ``engine.batching()``: every reply is the one ``invoke``
    gives alone, and their answers decoded in shared steps; ``astream`` gives the same text."""
    histories = [[SYS, HumanMessage(f"question {i}: what is {i} plus {i}?")] for i in range(4)]
    alone = ChatKamera(engine=tiny, max_tokens=12)
    want = [alone.invoke(h, session_id=f"w{i}").content for i, h in enumerate(histories)]
    llm = ChatKamera(engine=tiny, max_tokens=12)

    async def everyone() -> list[BaseMessage]:
        return await asyncio.gather(*(llm.ainvoke(h, session_id=f"s{i}") for i, h in enumerate(histories)))

    async def streamed() -> str:
        return "".join([str(c.content) async for c in llm.astream(histories[0], session_id="t")])

    with tiny.batching() as sched:
        got = asyncio.run(everyone())
        text = asyncio.run(streamed())
    assert [g.content for g in got] == want
    assert text == want[0]
    assert sched.stats().finished == len(histories) + 1 and sched.stats().batch_max >= 2

"""``tool_choice="auto"`` policies (``kamera_sdk.auto_tools``): the wiring on a tiny random model (fast), and
the call / no-call accuracy of both policies on the default model over ``auto_tool_prompts`` (slow; the
figures are the ones docs/langchain.md reports)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import pytest
import torch
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langchain_core.utils.function_calling import convert_to_openai_tool

import kamera_sdk.auto_tools as auto_tools
from kamera_langchain import ChatKamera
from kamera_langchain.chat_models import chat_engine
from kamera_sdk import ChatFormat, Engine, ToolSpec, answer_prompt, relevant_tools, tool_relevance
from kamera_sdk.auto_tools import NEUTRAL_TOOL, RELEVANCE_TURN
from tests.conftest import tiny_chat_engine
from tests.integrations.auto_tool_prompts import CALL, CALL_ARGS, TEXT


@tool
def switch(on: bool, room: Literal["kitchen", "hall"]) -> str:
    """Turn the light in a room on or off."""
    return "done"


@tool
def ring() -> str:
    """Ring the bell."""
    return "ding"


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return tiny_chat_engine()


def specs(tools: Sequence[BaseTool]) -> list[ToolSpec]:
    out = []
    for t in tools:
        fn = convert_to_openai_tool(t)["function"]
        out.append(ToolSpec(name=fn["name"], description=fn["description"], parameters=fn["parameters"]))
    return out


def test_relevance_is_the_requests_likelihood_gain_by_full_prefill(tiny: Engine) -> None:
    engine, fmt = chat_engine(tiny)
    request = "Turn on the kitchen light."

    def mean_lp(tool: ToolSpec) -> float:  # the whole text prefilled from scratch, the anchor included
        system = engine.tokenize(
            fmt.render("system", RELEVANCE_TURN.format(name=tool.name, description=tool.description))
        )
        user = engine.tokenize(fmt.render("user", request))
        ids = [*engine.anchor_ids, *system, *user]
        with torch.inference_mode():
            logits = engine.model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        at = len(ids) - len(user)
        return float(torch.stack([lp[at - 1 + k, t] for k, t in enumerate(user)]).mean())

    scores = tool_relevance(engine, fmt.render, request, specs([switch, ring]))
    for spec in specs([switch, ring]):
        assert scores[spec.name] == pytest.approx(mean_lp(spec) - mean_lp(NEUTRAL_TOOL), abs=1e-4)


@pytest.mark.parametrize("relevant", [["switch"], []])
def test_relevance_policy_calls_only_a_relevant_tool_or_answers_in_text(
    tiny: Engine, monkeypatch: pytest.MonkeyPatch, relevant: list[str]
) -> None:
    seen: list[tuple[str, list[str]]] = []

    def decided(engine: Engine, turn: object, request: str, tools: Sequence[ToolSpec], called: Sequence[str] = ()):
        seen.append((request, list(called)))
        return [t for t in tools if t.name in relevant]

    monkeypatch.setattr(auto_tools, "relevant_tools", decided)
    llm = ChatKamera(engine=tiny, max_tokens=40).bind_tools([switch, ring])
    reply = llm.invoke([HumanMessage("Turn on the kitchen light.")])
    assert seen == [("Turn on the kitchen light.", [])]
    if relevant:
        assert [c["name"] for c in reply.tool_calls] == relevant
    else:
        assert not reply.tool_calls and not reply.invalid_tool_calls and reply.content
        assert not str(reply.content).startswith("{")


def test_a_tool_called_since_the_request_is_not_called_again(tiny: Engine) -> None:
    call = {"name": "ring", "args": {}, "id": "call_1", "type": "tool_call"}
    history: list[BaseMessage] = [
        HumanMessage("Ring the bell."),
        AIMessage("", tool_calls=[call]),
        ToolMessage("ding", tool_call_id="call_1"),
    ]
    reply = ChatKamera(engine=tiny, max_tokens=12).bind_tools([ring]).invoke(history)
    assert not reply.tool_calls and not reply.invalid_tool_calls  # its result is in, whatever the weights think
    assert not str(reply.content).startswith("{")


def test_model_policy_leaves_the_choice_to_the_grammar(tiny: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*_: object, **__: object) -> list[ToolSpec]:
        raise AssertionError("the model policy measures no relevance")

    monkeypatch.setattr(auto_tools, "relevant_tools", never)
    reply = ChatKamera(engine=tiny, max_tokens=40, auto_tool_policy="model").bind_tools([switch]).invoke("hi")
    assert reply.tool_calls or not str(reply.content).lstrip().startswith("{")
    with pytest.raises(ValueError, match="auto_tool_policy"):
        ChatKamera(engine=tiny, auto_tool_policy="guess")


# --- measured on the default model ------------------------------------------------------------------


def first_token_opens_a_call(engine: Engine, fmt: ChatFormat, tools: list[ToolSpec], messages: list[str]) -> bool:
    """The ``model`` policy's decision, as greedy decoding under the call-or-text grammar takes it: is the
    most likely admitted first token one that opens a call (``{``) rather than text (not ``{`` or space)?"""
    about = answer_prompt(tools, "auto")
    assert about is not None
    text = fmt.render("system", about) + "".join(messages) + fmt.generation
    lp = engine.next_token_logprobs(engine.anchor_kv, engine.tokenize(text), len(engine.anchor_ids))
    tok = engine.tokenizer
    call = text_best = float("-inf")
    for i in torch.argsort(lp, descending=True)[:200].tolist():
        piece = tok.decode([i])
        if piece.startswith("{"):
            call = max(call, float(lp[i]))
        elif piece and not piece[0].isspace():
            text_best = max(text_best, float(lp[i]))
    return call > text_best


@pytest.mark.slow
def test_auto_tool_policies_on_the_default_model(default_engine: Engine) -> None:
    engine, fmt = chat_engine(default_engine)
    llm = ChatKamera(engine=default_engine)
    tally = {p: {"call": 0, "second": 0, "text": 0} for p in ("model", "relevance")}
    for (tools, request, name, result), args in zip(CALL, CALL_ARGS, strict=True):
        sp = specs(tools)
        user = HumanMessage(request)
        call = AIMessage("", tool_calls=[{"name": name, "args": args, "id": "c1", "type": "tool_call"}])
        second = llm.render([user, call, ToolMessage(result, tool_call_id="c1")])
        tally["model"]["call"] += first_token_opens_a_call(engine, fmt, sp, llm.render([user]))
        tally["model"]["second"] += not first_token_opens_a_call(engine, fmt, sp, second)
        tally["relevance"]["call"] += bool(relevant_tools(engine, fmt.render, request, sp))
        tally["relevance"]["second"] += not relevant_tools(engine, fmt.render, request, sp, [name])
    for tools, request in TEXT:
        sp = specs(tools)
        tally["model"]["text"] += not first_token_opens_a_call(engine, fmt, sp, llm.render([HumanMessage(request)]))
        tally["relevance"]["text"] += not relevant_tools(engine, fmt.render, request, sp)
    print(f"\ncorrect of 20 (call: a call; second: text after the result; text: text): {tally}")
    assert tally["model"]["call"] <= 2  # the 135M model almost never opens a call of its own
    assert tally["relevance"]["call"] >= 18 and tally["relevance"]["text"] >= 13 and tally["relevance"]["second"] >= 15

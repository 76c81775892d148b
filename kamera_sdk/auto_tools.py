"""``tool_choice="auto"``: who decides between a tool call and a text answer.

Two policies (``AUTO_TOOL_POLICIES``):

- ``"model"``: the answer is decoded under a grammar that admits a call or text, and the model's first
  token decides (OpenAI's semantics). A model trained on function calling decides well; a small model
  that never saw a call almost never opens one (SmolLM2-135M: 0 calls on 20 requests a tool clearly serves).
- ``"relevance"``: the decision is taken before decoding, from the model's own likelihoods. A tool is
  *relevant* to the request (the last user message) when its description makes the request more likely
  than the description of a tool that does nothing does (a positive mean per-token pointwise mutual
  information; no threshold to tune). Tools already called since that request, with their result in the
  conversation, are not candidates again: the request has had that tool's answer. With a relevant tool left
  the answer is a call of one of the relevant tools (the model picks which and writes the arguments under
  the grammar); with none it is text. A request to call one tool twice (two cities' weather) gets one call.

The scoring costs one short forward per tool and one for the neutral turn (the request and a one-line
system turn, after the engine's anchor); the window is not touched. The scoring forwards run alone even
under a scheduler (``kamera_engine.scheduler.alone``), so a decision never flips with the server's load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from kamera_engine import Engine, Grammar, InvalidInputError
from kamera_engine.scheduler import alone

from .tools import ToolSpec, tool_grammar

AutoToolPolicy = Literal["model", "relevance"]
AUTO_TOOL_POLICIES: tuple[str, ...] = ("model", "relevance")

#: The system turn a tool is described in when its relevance is measured, and the neutral tool the
#: request's likelihood is compared with: the same form, so what differs is only what the tool does.
RELEVANCE_TURN = "Tool {name}: {description}"
NEUTRAL_TOOL = ToolSpec(name="none", description="Does nothing.")

Turn = Callable[[str, str], str]  # (role, text) -> the turn's text in the engine's chat format


def text_grammar() -> Grammar:
    """A text answer that cannot be read as a call (it does not open with ``{`` or whitespace)."""
    return Grammar.lark("start: TEXT\nTEXT: /[^{\\s][\\s\\S]*/\n")


def request_log_likelihood(engine: Engine, turn: Turn, tool: ToolSpec, request: str) -> float:
    """Mean log-probability per token of the user turn ``request`` after the engine's anchor and a system
    turn describing ``tool``."""
    if engine.tokenizer is None:
        raise InvalidInputError("scoring tool relevance needs an engine with a tokenizer")
    system = engine.tokenize(turn("system", RELEVANCE_TURN.format(name=tool.name, description=tool.description)))
    user = engine.tokenize(turn("user", request))
    if not system or not user:
        raise InvalidInputError("a relevance score needs a non-empty request")
    start = len(engine.anchor_ids)
    past = engine.anchor_kv if engine.anchor_ids else None
    # alone, never packed into a scheduler's step with other work: the score is compared with 0, so its
    # rounding must not depend on what else the engine runs at the time
    with torch.inference_mode(), alone():
        logits = engine.forward([*system, *user], past, start, logits="all").logits
    lp = torch.log_softmax(logits[len(system) - 1 : len(system) + len(user) - 1].float(), dim=-1)
    return float(lp.gather(1, torch.tensor(user, device=lp.device).unsqueeze(1)).mean())


def tool_relevance(engine: Engine, turn: Turn, request: str, tools: Sequence[ToolSpec]) -> dict[str, float]:
    """Per tool: how much its description raises the request's mean per-token log-probability over the
    neutral tool's (> 0: relevant)."""
    base = request_log_likelihood(engine, turn, NEUTRAL_TOOL, request)
    return {t.name: request_log_likelihood(engine, turn, t, request) - base for t in tools}


def relevant_tools(
    engine: Engine, turn: Turn, request: str, tools: Sequence[ToolSpec], called: Sequence[str] = ()
) -> list[ToolSpec]:
    """The tools a ``"relevance"`` answer may call: relevant to ``request`` and not ``called`` since it."""
    candidates = [t for t in tools if t.name not in set(called)]
    if not candidates or not request.strip():
        return []
    scores = tool_relevance(engine, turn, request, candidates)
    return [t for t in candidates if scores[t.name] > 0.0]


def auto_grammar(
    engine: Engine, turn: Turn, request: str, tools: Sequence[ToolSpec], called: Sequence[str] = ()
) -> Grammar:
    """The grammar of a ``"relevance"`` answer: a call of one of the :func:`relevant_tools`, or text that
    cannot open a call when none is left (one decision for ChatKamera and the server)."""
    relevant = relevant_tools(engine, turn, request, tools, called)
    return tool_grammar(relevant, "required") if relevant else text_grammar()

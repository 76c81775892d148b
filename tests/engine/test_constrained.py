"""Constrained decoding: every answer under a grammar is in its language, greedy or sampled."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from kamera_engine import Grammar, InvalidInputError, SamplingParams
from tests.conftest import tiny_chat_engine


@pytest.fixture(scope="module")
def chat() -> object:
    return tiny_chat_engine()


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A small random JSON schema whose every answer is short enough to finish in a bounded decode (no free
    ``number``: a random model extends a fraction's digits for ever, which is valid JSON that never ends)."""
    kinds = ["integer", "boolean", "string", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 10)}
    if kind == "enum":
        return {"enum": rng.sample(["click", "scroll", "type", "wait", "done", "back"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(["x", "y", "action", "text", "target", "ok", "n", "items"], rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {n: random_schema(rng, depth + 1) for n in names},
        "required": names,
        "additionalProperties": False,
    }


def answer(engine: object, grammar: Grammar, *, temperature: float = 0.0, seed: int = 0, max_new: int = 160) -> str:
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed, grammar=grammar)
    prompt = engine.prompt_ids("Reply with JSON.")
    stream = engine.generate(engine.anchor_kv, prompt, len(engine.anchor_ids), params)
    text = "".join(stream)
    assert stream.finish_reason == "stop", f"the grammar did not complete in {max_new} tokens: {text!r}"
    return text


def test_fifty_random_schemas_all_parse_and_validate(chat: object) -> None:
    rng = random.Random(1234)
    for i in range(50):
        schema = {
            "type": "object",
            "properties": {"v": random_schema(rng)},
            "required": ["v"],
            "additionalProperties": False,
        }
        text = answer(chat, Grammar.json_schema(schema), temperature=0.0 if i % 2 else 1.0, seed=i)
        jsonschema.validate(json.loads(text), schema)  # raises on a parse error or a violation


def test_regex_and_lark_grammars(chat: object) -> None:
    text = answer(chat, Grammar.regex(r"click\(\d{1,3}, \d{1,3}\)"), temperature=1.0, seed=3)
    assert re.fullmatch(r"click\(\d{1,3}, \d{1,3}\)", text)
    lark = 'start: "yes" | "no"'
    assert answer(chat, Grammar.lark(lark), temperature=1.0, seed=5) in ("yes", "no")


def test_unconstrained_answer_is_unchanged_by_the_hook(chat: object) -> None:
    prompt = chat.prompt_ids("Say something.")
    free = SamplingParams(max_new_tokens=8)
    ids = list(chat.generate_ids(chat.anchor_kv, prompt, len(chat.anchor_ids), free))
    res = chat.forward(prompt, chat.anchor_kv, len(chat.anchor_ids), logits="last")
    assert ids[0] == int(torch.argmax(res.logits[-1]))  # the first token is the plain argmax, no mask applied


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Grammar.json_schema("{not json"), "not valid JSON"),
        (lambda: Grammar.json_schema([1, 2]), "must be an object"),
        (lambda: Grammar.json_schema({"type": "no-such-type"}), "does not compile"),
        (lambda: Grammar.regex(""), "non-empty"),
        (lambda: Grammar.regex("(unclosed"), "does not compile"),
        (lambda: Grammar.lark("start: undefined_rule"), "does not compile"),
    ],
)
def test_bad_grammars_are_refused_when_built(make: object, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        make()  # type: ignore[operator]


def test_sampling_params_refuse_a_foreign_grammar() -> None:
    with pytest.raises(InvalidInputError, match="grammar must be a kamera Grammar"):
        SamplingParams(grammar={"type": "object"}).validate()  # type: ignore[arg-type]


def test_a_constrained_row_in_a_batch_equals_its_answer_alone(chat: object) -> None:
    from kamera_engine.scheduler import Scheduler

    schema = {
        "type": "object",
        "properties": {"action": {"enum": ["click", "scroll"]}, "x": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["action", "x"],
        "additionalProperties": False,
    }
    start = len(chat.anchor_ids)
    prompts = [chat.prompt_ids(p) for p in ("Act.", "Say something long.", "Another one.")]
    kinds = [
        dict(max_new_tokens=40, grammar=Grammar.json_schema(schema)),
        dict(max_new_tokens=12),
        dict(max_new_tokens=40, temperature=1.0, seed=7, grammar=Grammar.regex(r"(yes|no)")),
    ]
    alone = [
        list(chat.generate_ids(chat.anchor_kv, p, start, SamplingParams(**k)))
        for p, k in zip(prompts, kinds, strict=True)
    ]
    sched = Scheduler(chat)
    reqs = [sched.submit(chat.anchor_kv, p, start, SamplingParams(**k)) for p, k in zip(prompts, kinds, strict=True)]
    batched = [list(r) for r in reqs]
    assert batched == alone
    jsonschema.validate(json.loads(chat.tokenizer.decode(batched[0], skip_special_tokens=True)), schema)

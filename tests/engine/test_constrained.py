"""Constrained decoding: every answer under a grammar is in its language, greedy or sampled."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from kamera_engine import Grammar, InvalidInputError, SamplingParams
from kamera_engine.constrained import TokenConstraint
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


def test_properties_come_in_the_schema_order_and_the_usual_layout(chat: object) -> None:
    schema = {
        "type": "object",
        "properties": {
            "setup": {"type": "string", "maxLength": 6},
            "punchline": {"type": "string", "maxLength": 6},
            "count": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["setup", "punchline", "count"],
        "additionalProperties": False,
    }
    for seed in range(3):
        text = answer(chat, Grammar.json_schema(schema), temperature=1.0, seed=seed)
        obj = json.loads(text)
        assert list(obj) == ["setup", "punchline", "count"]  # as listed, not alphabetical
        assert text == json.dumps(obj, ensure_ascii=False)  # separators ", " and ": ", no other whitespace


def _walk(chat: object, grammar: Grammar, text: str) -> TokenConstraint:
    constraint = TokenConstraint(grammar, chat.tokenizer, chat.vocab_size)
    for token in chat.tokenizer.encode(text, add_special_tokens=False):
        constraint.advance(token)
    return constraint


def _admitted(chat: object, constraint: TokenConstraint) -> list[str]:
    logits = constraint.mask_(torch.zeros(chat.vocab_size))
    return [chat.tokenizer.decode([i]) for i in torch.nonzero(torch.isfinite(logits)).flatten().tolist()]


def test_the_loop_guard_closes_a_string_that_repeats_itself(chat: object) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "t": {"type": "string"}}, "required": ["s"]}
    guarded = Grammar.json_schema(schema).with_loop_guard(3)
    looping = '{"s": "a cat is a cat is a cat is'  # the last 3 tokens repeat a run of 3 in the string
    admitted = _admitted(chat, _walk(chat, guarded, looping))
    assert admitted and all(t.startswith('"') for t in admitted)  # only tokens that close the string
    assert len(_admitted(chat, _walk(chat, guarded, '{"s": "a cat is on the mat'))) > 100  # no loop: free
    assert len(_admitted(chat, _walk(chat, Grammar.json_schema(schema), looping))) > 100  # guard off: free
    # the next string starts afresh: the same words in "t" are no loop yet
    assert len(_admitted(chat, _walk(chat, guarded, looping + '", "t": "a cat is'))) > 100


def test_the_loop_guard_leaves_text_answers_and_escaped_quotes_alone(chat: object) -> None:
    lark = Grammar.lark('start: call | TEXT\ncall: %json {"type": "object"}\nTEXT: /[^{\\s][\\s\\S]*/\n')
    text = 'say "a cat is a cat is a cat is'  # an answer in text: quotes are the model's own
    assert len(_admitted(chat, _walk(chat, lark.with_loop_guard(3), text))) > 100
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    escaped = '{"s": "\\"a cat is a cat is a cat is'  # still inside the string after an escaped quote
    admitted = _admitted(chat, _walk(chat, Grammar.json_schema(schema).with_loop_guard(3), escaped))
    assert admitted and all(t.startswith('"') for t in admitted)


def test_answers_under_an_eager_loop_guard_still_parse_and_validate(chat: object) -> None:
    rng = random.Random(99)  # a guard of 2 tokens closes strings often: the answer must still be valid
    for i in range(20):
        schema = {"type": "object", "properties": {"v": random_schema(rng)}, "required": ["v"]}
        schema["additionalProperties"] = False
        grammar = Grammar.json_schema(schema).with_loop_guard(2)
        text = answer(chat, grammar, temperature=0.0 if i % 2 else 1.0, seed=i)
        jsonschema.validate(json.loads(text), schema)


def test_the_loop_guard_must_be_a_count() -> None:
    with pytest.raises(InvalidInputError, match="string_loop_tokens"):
        Grammar.json_schema({"type": "object"}).with_loop_guard(-1)

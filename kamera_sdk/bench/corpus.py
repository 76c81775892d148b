"""The real-text corpus the benchmarks and the demo run on (``kamera_sdk/data/corpus.json``).

Original prose written for Kamera: cross-referencing pages of a fictional coastal region for the agent
trace, and three-chunk multi-hop probes whose answer needs facts from more than one chunk.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from pydantic import BaseModel


class Page(BaseModel):
    id: str
    title: str
    text: str


class Question(BaseModel):
    pages: list[str]
    question: str
    answer: str


class Probe(BaseModel):
    chunks: list[str]
    question: str
    answer: str


class Demo(BaseModel):
    pages: list[str]
    questions: list[Question]


class Single(BaseModel):
    text: str
    question: str
    answer: str


class Corpus(BaseModel):
    pages: list[Page]
    trace_questions: list[Question]
    probes: list[Probe]
    demo: Demo
    single: Single

    def page(self, page_id: str) -> Page:
        for p in self.pages:
            if p.id == page_id:
                return p
        raise KeyError(page_id)


@cache
def load_corpus() -> Corpus:
    raw = resources.files("kamera_sdk").joinpath("data/corpus.json").read_text(encoding="utf-8")
    return Corpus.model_validate(json.loads(raw))

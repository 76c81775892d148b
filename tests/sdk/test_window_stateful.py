"""Random sequences of add / evict / recall / reorder / slide / fork against a plain model of the window.

After every step: the window's contents equal the model's; ``recompute`` equals re-prefill exactly; a
``kamera`` survivor's KV is the rotation of its previous conditioned KV; forks stay isolated; invalid
operations raise and change nothing.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from tests.conftest import random_ids, reprefill_logprobs, tiny_engine
from tests.window_machine import WindowModelMachine

ENGINE = tiny_engine("qwen2", seed=5)
POOL = [random_ids(6 + (i % 5), seed=300 + i) for i in range(10)]
PROMPT = [7, 8, 9]


class WindowMachine(WindowModelMachine):
    def __init__(self) -> None:
        super().__init__(ENGINE, PROMPT)

    @rule(i=st.integers(0, len(POOL) - 1))
    def add(self, i: int) -> None:
        self.add_to_both(lambda w: w.add(POOL[i]))

    @rule(which=st.integers(0, 4))
    def invalid(self, which: int) -> None:
        ops = [
            lambda w: w.evict("not-a-chunk"),
            lambda w: w.slide(len(self.order) + 1),
            lambda w: w.reorder([*self.order, "extra"]),
            lambda w: w.recall(self.order[0]) if self.order else w.recall("nope"),
            lambda w: w.add([]),
        ]
        self.assert_refused(ops[which])

    @invariant()
    def recompute_equals_reprefill(self) -> None:
        if self.order:
            assert torch.equal(self.rec.next_token_logprobs(PROMPT), reprefill_logprobs(self.rec, PROMPT))
            lp = self.kam.next_token_logprobs(PROMPT)
            assert torch.isfinite(lp).all()


#: CI's short profile; the soak profile raises it: KAMERA_STATEFUL_EXAMPLES=1000 (docs/window.md)
EXAMPLES = int(os.environ.get("KAMERA_STATEFUL_EXAMPLES", "60"))

WindowMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)
)
TestWindowStateful = WindowMachine.TestCase

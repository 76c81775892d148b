"""The safety envelope's verdicts (appendix D)."""

from __future__ import annotations

import pytest

from kamera_sdk import EnvelopeConfig
from kamera_sdk.envelope import judge

CFG = EnvelopeConfig()


@pytest.mark.parametrize(
    ("formed", "current", "relation", "reuse"),
    [
        (("a", "b", "c"), ("a", "b", "c"), "identical", True),
        (("a", "b", "c"), ("c", "a", "b"), "reordered", True),
        (("a", "b", "c"), ("a", "c"), "dropped", True),
        (("a", "b", "c"), ("c",), "dropped", False),
        (("a", "b"), ("a", "b", "b"), "duplicated", True),
        (("a", "b", "c"), ("a", "b", "x"), "replaced", False),
        (("a", "b"), ("a", "b", "x"), "added", False),
        (("a", "b"), ("x", "y"), "disjoint", False),
    ],
)
def test_envelope_relations(formed: tuple, current: tuple, relation: str, reuse: bool) -> None:
    d = judge(formed, current, CFG)
    assert (d.relation, d.reuse) == (relation, reuse)


def test_envelope_thresholds_are_configurable() -> None:
    loose = EnvelopeConfig(max_replaced=1, max_added=1, max_dropped=2)
    assert judge(("a", "b", "c"), ("a", "b", "x"), loose).reuse
    assert judge(("a", "b", "c"), ("c",), loose).reuse
    assert not judge(("a", "b", "c"), ("c", "a"), EnvelopeConfig(allow_reorder=False)).reuse

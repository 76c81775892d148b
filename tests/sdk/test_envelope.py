"""The safety envelope's verdicts (appendix D)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kamera_sdk import EnvelopeConfig, InvalidInputError, WindowConfig
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


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: WindowConfig(survivor="patch"), "survivor: unknown option"),  # a typo would run the default
        (lambda: WindowConfig(rank=0), "rank: Input should be greater than or equal to 1"),
        (lambda: WindowConfig(survivors="bogus"), "survivors: Input should be 'rotate' or 'patch'"),
        (lambda: EnvelopeConfig(max_dropped=-1), "EnvelopeConfig option max_dropped"),
        (lambda: WindowConfig(envelope={"max_droped": 1}), "envelope: invalid EnvelopeConfig option max_droped"),
    ],
)
def test_options_refuse_unknown_names_and_bad_values(make, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        make()


def test_options_are_frozen_and_nest() -> None:
    config = WindowConfig(envelope={"max_dropped": 2})
    assert config.envelope == EnvelopeConfig(max_dropped=2)
    with pytest.raises(ValidationError, match="frozen"):
        config.rank = 4  # type: ignore[misc]

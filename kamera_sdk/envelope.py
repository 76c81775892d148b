"""The reuse safety envelope (core paper, appendix D).

A stored patch was formed on one antecedent; the question at reuse is whether the current antecedent is
close enough. Measured on the paper's models: same set in another order, or one dropped or duplicated
member, transfers about as well as a rebuilt patch; replaced members or extra material decay, and a
fully different antecedent makes the stale patch harmful. So: reuse within the envelope, rebuild outside,
and log every decision.
"""

from __future__ import annotations

from collections import Counter

from pydantic import BaseModel, ConfigDict, Field

from .chunks import Antecedent
from .options import Options


class EnvelopeConfig(Options):
    """How far an antecedent may drift before a stored patch is rebuilt."""

    allow_reorder: bool = Field(True, description="same set in another order")
    max_dropped: int = Field(1, ge=0, description="members of the patch's antecedent now missing")
    max_duplicated: int = Field(1, ge=0, description="extra copies of members already present")
    max_replaced: int = Field(0, ge=0, description="members swapped for other content")
    max_added: int = Field(0, ge=0, description="new material in front of the chunk")


class EnvelopeDecision(BaseModel):
    """Whether a stored patch may serve the current antecedent, and why."""

    model_config = ConfigDict(frozen=True)

    reuse: bool
    relation: str  # identical | reordered | dropped | duplicated | replaced | added | disjoint
    dropped: int = 0
    added: int = 0
    duplicated: int = 0


def judge(formed_on: Antecedent, current: Antecedent, config: EnvelopeConfig) -> EnvelopeDecision:
    """Classify ``current`` against the antecedent ``formed_on`` and decide reuse vs rebuild."""
    if formed_on == current:
        return EnvelopeDecision(reuse=True, relation="identical")
    old, new = Counter(formed_on), Counter(current)
    duplicated = sum(max(0, new[c] - max(old[c], 1)) for c in new if old[c] > 0)
    old_set, new_set = set(old), set(new)
    dropped = len(old_set - new_set)
    added = len(new_set - old_set)
    if dropped == 0 and added == 0 and duplicated == 0:
        return EnvelopeDecision(reuse=config.allow_reorder, relation="reordered")
    common_old = list(dict.fromkeys(c for c in formed_on if c in new_set))
    common_new = list(dict.fromkeys(c for c in current if c in old_set))
    if common_old != common_new and not config.allow_reorder:
        return EnvelopeDecision(reuse=False, relation="reordered", dropped=dropped, added=added, duplicated=duplicated)
    if not (old_set & new_set) and old_set:
        return EnvelopeDecision(reuse=False, relation="disjoint", dropped=dropped, added=added)
    replaced = min(dropped, added)
    if replaced:
        ok = replaced <= config.max_replaced and dropped - replaced <= config.max_dropped
        ok = ok and added - replaced <= config.max_added and duplicated <= config.max_duplicated
        return EnvelopeDecision(reuse=ok, relation="replaced", dropped=dropped, added=added, duplicated=duplicated)
    if added:
        ok = added <= config.max_added and duplicated <= config.max_duplicated
        return EnvelopeDecision(reuse=ok, relation="added", added=added, duplicated=duplicated)
    if dropped:
        ok = dropped <= config.max_dropped and duplicated <= config.max_duplicated
        return EnvelopeDecision(reuse=ok, relation="dropped", dropped=dropped, duplicated=duplicated)
    return EnvelopeDecision(reuse=duplicated <= config.max_duplicated, relation="duplicated", duplicated=duplicated)

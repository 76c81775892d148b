"""Window statistics: every decision and its cost, as a pydantic model."""

from __future__ import annotations

from pydantic import BaseModel, Field


class OpTiming(BaseModel):
    """Calls and wall time of one window operation."""

    count: int = 0
    total_s: float = 0.0

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count else 0.0


class Decision(BaseModel):
    """One logged planning decision (e.g. an envelope verdict)."""

    step: int
    chunk: str
    source: str
    reason: str


class WindowStats(BaseModel):
    """What the window has done: forwards, tokens, canonicals, patches, bytes and timings."""

    policy: str
    forwards: int = Field(0, description="forward passes run for this window (ingest + use)")
    tokens_prefilled: int = Field(0, description="tokens run through the model when answering (critical path)")
    ingest_tokens: int = Field(0, description="tokens run to compile canonicals at add time")
    prompt_tokens: int = 0
    canonicals_computed: int = 0
    canonicals_reused: int = 0
    patches_formed: int = 0
    patches_reused: int = 0
    orbit_patches_formed: int = 0
    fresh_patches_formed: int = 0
    survivors_rotated: int = 0
    kept: int = 0
    blind_served: int = 0
    prefix_hits: int = 0
    selective_tokens: int = 0
    envelope_reuse: int = Field(0, description="slots served by conditioning formed on a drifted antecedent (envelope)")
    envelope_rebuild: int = Field(0, description="slots re-prefilled because their antecedent left the envelope")
    cascade_marked: int = Field(0, description="slots marked stale because a chunk they absorbed was recalled")
    cascade_rematerialised: int = Field(0, description="stale slots rebuilt (from a fitting patch or a forward)")
    store_loads: int = 0
    store_load_failures: int = 0
    compression_stats_tokens: int = Field(0, description="tokens run only to gather attention statistics")
    kv_bytes_fraction: float = Field(1.0, description="KV bytes kept by the last compression, of the full cache")
    canonical_bytes: int = 0
    patch_bytes: int = 0
    window_kv_bytes: int = 0
    window_tokens: int = 0
    vision_tower_runs: int = Field(0, description="vision-tower runs caused by this window (once per distinct image)")
    timings: dict[str, OpTiming] = Field(default_factory=dict)
    decisions: list[Decision] = Field(default_factory=list, description="most recent planning decisions")

    def computed_since(self, before: WindowStats) -> int:
        """Window tokens a forward computed since ``before`` (prompts excluded): what a use did not serve
        from stored KV. A new chunk is compiled at arrival and usually prefilled in context too, so the larger
        of the two counts it once (exact unless the chunks compiled and those prefilled differ, e.g. a new
        chunk placed first while a cascade rebuilds others)."""
        return max(self.tokens_prefilled - before.tokens_prefilled, self.ingest_tokens - before.ingest_tokens)

    def time(self, op: str, seconds: float) -> None:
        t = self.timings.setdefault(op, OpTiming())
        t.count += 1
        t.total_s += seconds

    def log(self, decision: Decision, keep: int = 200) -> None:
        self.decisions.append(decision)
        if len(self.decisions) > keep:
            del self.decisions[: len(self.decisions) - keep]

"""Window statistics: every decision and its cost, as a pydantic model.

Counts are kept where they arise, once: slots served by ``Source`` (``served``), patches formed by
``PatchKind`` (``formed``), and forwards and tokens by the work they did (``work``), taken from the
engine's own counters by ``metering.EngineMeter``. The flat names earlier versions had (``kept``,
``patches_formed``, ``forwards``, ...) are read-only fields derived from those mappings, so they stay in
every dump (the server's stats response, benchmark JSON) with the same meaning.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field, computed_field

from .chunks import PatchKind
from .plan import Source


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


class Work(StrEnum):
    """What a forward pass run for a window was for."""

    INGEST = "ingest"  # a chunk's canonical, compiled when it arrives (or when first needed)
    CONTEXT = "context"  # window slots prefilled in context: forward runs, orbit patches, selective recompute
    PROMPT = "prompt"  # a prompt prefilled over the assembled window
    STATISTICS = "statistics"  # tokens run only to gather attention statistics (KV compression)


class WorkCount(BaseModel):
    """Forward passes and the tokens they ran through the model."""

    forwards: int = 0
    tokens: int = 0


class WindowStats(BaseModel):
    """What the window has done: forwards, tokens, canonicals, patches, bytes and timings."""

    policy: str
    work: dict[Work, WorkCount] = Field(
        default_factory=dict, description="forwards and tokens by what they were for (from the engine's counters)"
    )
    served: dict[Source, int] = Field(default_factory=dict, description="slots served, by source, over every use")
    formed: dict[PatchKind, int] = Field(default_factory=dict, description="patches formed, by kind")
    prompt_tokens: int = Field(0, description="tokens of the prompts answered (one count per use)")
    canonicals_computed: int = 0
    canonicals_reused: int = 0
    selective_tokens: int = 0
    envelope_reuse: int = Field(0, description="slots served by conditioning formed on a drifted antecedent (envelope)")
    envelope_rebuild: int = Field(0, description="slots re-prefilled because their antecedent left the envelope")
    cascade_marked: int = Field(0, description="slots marked stale because a chunk they absorbed was recalled")
    cascade_rematerialised: int = Field(0, description="stale slots rebuilt (from a fitting patch or a forward)")
    store_loads: int = 0
    store_load_failures: int = 0
    kv_bytes_fraction: float = Field(1.0, description="KV bytes kept by the last compression, of the full cache")
    canonical_bytes: int = 0
    patch_bytes: int = 0
    window_kv_bytes: int = 0
    window_tokens: int = 0
    vision_tower_runs: int = Field(0, description="vision-tower runs caused by this window (once per distinct image)")
    timings: dict[str, OpTiming] = Field(default_factory=dict)
    decisions: list[Decision] = Field(default_factory=list, description="most recent planning decisions")

    # --- the flat counters, derived ---------------------------------------------------------------
    @computed_field  # type: ignore[prop-decorator]
    @property
    def forwards(self) -> int:
        """Forward passes run for this window (ingest + use)."""
        return sum(w.forwards for w in self.work.values())

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_prefilled(self) -> int:
        """Tokens run through the model for the window's slots when answering (critical path)."""
        return self._work(Work.CONTEXT).tokens

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ingest_tokens(self) -> int:
        """Tokens run to compile canonicals."""
        return self._work(Work.INGEST).tokens

    @computed_field  # type: ignore[prop-decorator]
    @property
    def compression_stats_tokens(self) -> int:
        """Tokens run only to gather attention statistics (KV compression)."""
        return self._work(Work.STATISTICS).tokens

    @computed_field  # type: ignore[prop-decorator]
    @property
    def patches_formed(self) -> int:
        """Patches formed from a forward the window ran to serve a slot (every kind but orbit)."""
        return sum(n for kind, n in self.formed.items() if kind is not PatchKind.ORBIT)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def orbit_patches_formed(self) -> int:
        return self.formed.get(PatchKind.ORBIT, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def fresh_patches_formed(self) -> int:
        return self.formed.get(PatchKind.FRESH, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def patches_reused(self) -> int:
        return self.served.get(Source.PATCH, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def survivors_rotated(self) -> int:
        return self.served.get(Source.SURVIVOR, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def kept(self) -> int:
        return self.served.get(Source.KEEP, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def blind_served(self) -> int:
        return self.served.get(Source.BLIND, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def prefix_hits(self) -> int:
        return self.served.get(Source.PREFIX, 0)

    # --- recording --------------------------------------------------------------------------------
    def _work(self, work: Work) -> WorkCount:
        return self.work.get(work, WorkCount())

    def add_work(self, work: Work, forwards: int, tokens: int) -> None:
        """Count forwards and tokens run for ``work`` (``EngineMeter`` is the one caller)."""
        w = self.work.setdefault(work, WorkCount())
        w.forwards += forwards
        w.tokens += tokens

    def count_served(self, source: Source) -> None:
        self.served[source] = self.served.get(source, 0) + 1

    def count_formed(self, kind: PatchKind) -> None:
        self.formed[kind] = self.formed.get(kind, 0) + 1

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

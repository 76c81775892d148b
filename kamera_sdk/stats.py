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
    BACKGROUND = "background"  # work run in idle time (``background``): off every critical path


class WorkCount(BaseModel):
    """Forward passes and the tokens they ran through the model."""

    forwards: int = 0
    tokens: int = 0


class WindowStats(BaseModel):
    """What the window has done: forwards, tokens, canonicals, patches, bytes and timings.

    Every counter is defined here, once (its description; the table in docs/window.md repeats them), and
    counts from the window's creation, or for a fork from the fork (``forked``, ``started_at_step``).
    """

    policy: str = Field(description="the reuse policy's registered name")
    forked: bool = Field(False, description="these stats belong to a fork: they count its work since the fork only")
    started_at_step: int = Field(
        0, description="the window step (operations so far) these stats start at: 0, or the parent's step for a fork"
    )
    work: dict[Work, WorkCount] = Field(
        default_factory=dict,
        description="forwards and their tokens by what they were for (the engine's own counters around this "
        "window's calls)",
    )
    served: dict[Source, int] = Field(
        default_factory=dict, description="slots served by each source, one per slot per executed plan"
    )
    formed: dict[PatchKind, int] = Field(default_factory=dict, description="patches formed, by kind")
    prompt_tokens: int = Field(0, description="tokens of the prompts answered, once per use (prefilled or not)")
    canonicals_computed: int = Field(0, description="canonicals computed by a forward (ingest)")
    canonicals_reused: int = Field(
        0,
        description="canonicals taken ready-made: loaded from the store, or held by another branch of this "
        "window when the chunk was added",
    )
    selective_tokens: int = Field(0, description="tokens recomputed in context by a selective policy")
    envelope_reuse: int = Field(0, description="slots served by conditioning formed on a drifted antecedent (envelope)")
    envelope_rebuild: int = Field(0, description="slots re-prefilled because their antecedent left the envelope")
    cascade_marked: int = Field(0, description="slots marked stale because a chunk they absorbed was recalled")
    cascade_rematerialised: int = Field(0, description="stale slots rebuilt (from a fitting patch or a forward)")
    store_loads: int = Field(0, description="entries loaded from the store and used (canonicals and patches)")
    store_load_failures: int = Field(
        0, description="store entries refused (checksum, fingerprint, MAC, I/O, or not covering the chunk), recomputed"
    )
    kv_bytes_fraction: float = Field(1.0, description="KV bytes kept by the last compression, of the full cache")
    canonical_bytes: int = Field(0, description="bytes of the canonicals this window computed")
    patch_bytes: int = Field(0, description="bytes of the patches this window formed")
    window_kv_bytes: int = Field(0, description="bytes of the window's KV as last assembled (anchor included)")
    window_tokens: int = Field(0, description="tokens of the window as last assembled (anchor included)")
    vision_tower_runs: int = Field(0, description="vision-tower runs caused by this window (once per distinct image)")
    background_queued: dict[str, int] = Field(
        default_factory=dict, description="background tasks queued, by kind (patches, survivors, canonical, prefetch)"
    )
    background_done: dict[str, int] = Field(
        default_factory=dict, description="background tasks run in idle time (prepare() or the idle thread), by kind"
    )
    background_inline: dict[str, int] = Field(
        default_factory=dict,
        description="background tasks a foreground call finished itself because idle time had not reached them",
    )
    cost_plans: dict[str, int] = Field(
        default_factory=dict,
        description="uses whose plan was priced (background work on): the candidate run, by name (policy: the "
        "policy's plan; merged: one forward from its first prefilled slot on; fused: one re-prefill of the window)",
    )
    timings: dict[str, OpTiming] = Field(default_factory=dict, description="calls and wall time of each operation")
    decisions: list[Decision] = Field(default_factory=list, description="most recent planning decisions")

    # --- the flat counters, derived ---------------------------------------------------------------
    @computed_field  # type: ignore[prop-decorator]
    @property
    def forwards(self) -> int:
        """Forward passes run for this window, every kind of work (decode steps are not forwards)."""
        return sum(w.forwards for w in self.work.values())

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_prefilled(self) -> int:
        """Tokens of the window's slots run through the model when answering (critical path; prompts
        excluded): forward runs, orbit patches, selective recompute."""
        return self._work(Work.CONTEXT).tokens

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ingest_tokens(self) -> int:
        """Tokens run to compute canonicals."""
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
        """Orbit patches formed (one forward per ordering of the predecessors)."""
        return self.formed.get(PatchKind.ORBIT, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def fresh_patches_formed(self) -> int:
        """Fresh patches formed: a recalled chunk re-conditioned on its earlier context."""
        return self.formed.get(PatchKind.FRESH, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def patches_reused(self) -> int:
        """Slots served from their canonical and a stored patch (``Source.PATCH``)."""
        return self.served.get(Source.PATCH, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def survivors_rotated(self) -> int:
        """Slide survivors served by rotation only (``Source.SURVIVOR``)."""
        return self.served.get(Source.SURVIVOR, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def kept(self) -> int:
        """Slots served from their own conditioned KV of the last use (``Source.KEEP``)."""
        return self.served.get(Source.KEEP, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def blind_served(self) -> int:
        """Slots served from their canonical with no repair (``Source.BLIND``)."""
        return self.served.get(Source.BLIND, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def prefix_hits(self) -> int:
        """Slots served from the prefix cache (``Source.PREFIX``)."""
        return self.served.get(Source.PREFIX, 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def fused_refills(self) -> int:
        """Uses that fell back to one fused re-prefill of the whole window (cheaper than the policy's plan)."""
        return self.cost_plans.get("fused", 0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def background_tokens(self) -> int:
        """Tokens run by background work in idle time (off the critical path)."""
        return self._work(Work.BACKGROUND).tokens

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

    def count_task(self, counts: dict[str, int], kind: str) -> None:
        counts[kind] = counts.get(kind, 0) + 1

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

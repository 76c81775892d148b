"""The embedded engine: a transformers model driven with caches Kamera assembles itself.

The engine knows tensors and models: tokenization, the chat frame around a window, forward passes at
explicit positions, canonical compilation, and the operator bound to this model's RoPE. It knows
nothing about chunks, windows or policies (that is ``kamera_sdk``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from . import compressed
from . import operator as op
from .adapters import ModelAdapter, adapter_for
from .adapters.capture import PreRopeKeys, active_recorders, packable, recording
from .constrained import TokenConstraint
from .decode import SamplingParams, TextStream, decode_tokens
from .errors import ContextLengthError, InvalidInputError, ModelLoadError, UnsupportedModelError, positive_int
from .fingerprint import engine_fingerprint
from .kv import KV, Past
from .loading import LoadSettings, ModelSource, load_engine
from .operator import Patch
from .packed_linear import pack_linears, resolve_linear_backend
from .rope import HALF_DTYPES, RopeSpec, check_rotation
from .runner import ForwardResult, Prefilled, run_forward
from .scheduler import Scheduler, active_scheduler, alone, batching_scheduler, driven_scheduler, forwards_alone
from .scheduler import batching as scheduler_batching

_SENTINEL = "\u2063KAMERA\u2063"

log = logging.getLogger(__name__)
#: guards ``Engine.counters`` (forwards are counted from window threads and a scheduler's driver at once)
_COUNT_LOCK = threading.Lock()

#: where ``Engine.canonical`` takes a chunk's position-free keys from (docs/gpu.md, "bf16 and fp16")
CANONICAL_SOURCES = ("pre_rope", "unrotation")


class EngineInfo(BaseModel):
    """What model an engine runs and how its KV is laid out."""

    model_config = ConfigDict(frozen=True)

    model: str
    family: str
    num_layers: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    rotary_dim: int
    rope_type: str
    dtype: str
    device: str
    attention: str
    anchor_tokens: int
    context_length: int | None = None
    linear_backend: str = "native"  # "onednn": linears on packed oneDNN weights (``packed_linear.py``)


class EngineCounters(BaseModel):
    """Work the engine has done (read by window stats and benchmarks)."""

    forwards: int = 0
    tokens_prefilled: int = 0
    forward_s: float = 0.0


def _swap(kv: KV) -> KV:
    """The KV with its key and value slots exchanged (the operator's view of a ``rope_in_values`` cache)."""
    return KV(kv.values, kv.keys, kv.positions, kv.deltas)


def _swap_patch(patch: Patch) -> Patch:
    return Patch(patch.v_u, patch.v_vt, patch.k_u, patch.k_vt, patch.layers)


def _beside(patch: Patch | None, canonical: KV) -> Patch | None:
    """``patch`` on its canonical's device (a patch loaded from a store to the model's device can meet a
    canonical compiled here, which is kept in host memory)."""
    return None if patch is None else patch.to(canonical.keys.device)


class Engine:
    """A model plus everything needed to prefill, relocate, patch and decode its KV."""

    #: its forwards are plain token forwards the scheduler can pack with others' (``scheduler.py``); an
    #: engine whose forwards take inputs of their own kind (vision rows, M-RoPE positions) says False
    batchable: ClassVar[bool] = True

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any | None = None,
        *,
        name: str | None = None,
        anchor_ids: Sequence[int] | None = None,
        attention: str | None = None,
        linear_backend: str | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        #: token ids a prompt or chunk may hold: the rows of the input embedding
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.name = name or str(getattr(model.config, "_name_or_path", "") or model.config.model_type)
        self.adapter: ModelAdapter = adapter_for(model.config, self.name)
        # an inference engine: no forward builds a graph, and (on a CPU, float32) its linears run on packed
        # oneDNN weights: the caller's model is frozen and its nn.Linear layers become PackedLinear in place
        model.requires_grad_(False)
        #: what its linears run on (``packed_linear.py``): ``onednn`` (packed weights, CPU float32) or ``native``
        self.linear_backend = resolve_linear_backend(linear_backend, model)
        if self.linear_backend == "onednn":
            pack_linears(model)
        self.attention = attention or str(getattr(model.config, "_attn_implementation", None) or "sdpa")
        self.counters = EngineCounters()
        self._anchor_lock = threading.Lock()
        self._anchor_flight: threading.Event | None = None  # set when the anchor forward in flight ends
        probe, probe_keys = self._probe()
        n_layers, _, n_heads, dk = probe.keys.shape
        self.num_layers, self.num_kv_heads, self.key_dim = int(n_layers), int(n_heads), int(dk)
        self.value_dim = int(probe.values.shape[-1])
        self.rope: RopeSpec = self.adapter.rope_spec(model, self.key_dim)
        #: the cache holds the rotated band in its value slot (MLA's ``k_pe``), declared by the adapter
        self.rope_in_values: bool = self.adapter.rope_in_values
        #: the spec the operator rotates with: ``rope``, or the value slot's own when ``rope_in_values``
        self.operator_rope: RopeSpec = self._operator_rope()
        self.context_length = self.adapter.context_length()
        self._rotation: str | None = None
        self._pre_rope_reason = self._check_pre_rope(probe, probe_keys)
        self._canonical_source = "pre_rope" if self._pre_rope_reason is None else "unrotation"
        if self._pre_rope_reason is not None:
            log.info("%s: canonicals by un-rotation: %s", self.name, self._pre_rope_reason)
        if anchor_ids is not None:
            self.anchor_ids = [int(i) for i in anchor_ids]
            self.prompt_suffix_ids: list[int] = []
        else:
            self.anchor_ids, self.prompt_suffix_ids = self._chat_frame()

    # --- loading ------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        *,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        attn: str | None = None,
        linear: str | None = None,
    ) -> Engine:
        """Load the embedded default model (``model=None``) or a Hugging Face id / local path.

        ``device``: ``"cpu"``, ``"cuda"``... (default: cuda when available). ``dtype``: default float32
        on CPU, bfloat16 on GPU. ``attn``: ``"sdpa"``, ``"eager"`` or ``"flash_attention_2"`` (default:
        flash-attn when CUDA and the package are present, else SDPA). No network access is attempted
        for the default model or a local directory; a hub id not in the local cache fails at once when the
        hub cannot be reached. ``linear``: ``"onednn"`` or ``"native"`` (default: ``$KAMERA_LINEAR_BACKEND``,
        else oneDNN's packed linears for float32 on a CPU; ``packed_linear.py``). A vision-language
        checkpoint of a registered family loads as a ``VisionEngine`` (a subclass). See ``loading.py``.
        """
        return load_engine(cls, model, device=device, dtype=dtype, attn=attn, linear=linear)

    @classmethod
    def from_source(cls, source: ModelSource, settings: LoadSettings) -> Engine:
        """Build from a located model (the loader's last step): its tokenizer and causal-LM weights."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        offline = source.pretrained_kwargs()
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.path, **offline)
        except Exception as exc:
            raise ModelLoadError(f"could not load the tokenizer of {source.name}: {exc}") from exc
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(
                source.path, dtype=settings.dtype, attn_implementation=settings.attention, **offline
            )
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not load model {source.name}: {exc}") from exc
        return cls(
            hf_model.to(settings.device),
            tokenizer,
            name=source.name,
            attention=settings.attention,
            linear_backend=settings.linear,
        )

    def _operator_rope(self) -> RopeSpec:
        if not self.rope_in_values:
            return self.rope
        r = self.rope.rotary_dim
        if r != self.value_dim:
            raise UnsupportedModelError(f"{self.name}: RoPE band of {r} features != cached {self.value_dim}")
        return RopeSpec(self.rope.inv_freq, r, r, self.rope.rope_type, self.rope.style)

    def _probe(self) -> tuple[KV, PreRopeKeys]:
        """A one-token forward at position 0 (family independent): its KV gives layers, KV heads and key/value
        dims; the keys it handed RoPE, recorded, check the pre-RoPE capture (:meth:`_check_pre_rope`)."""
        keys = self._pre_rope_recorder()
        with recording(self.adapter.rope_modules(self.model), self.adapter.rope_functions, keys):
            res = run_forward(self.model, torch.tensor([0]), None, 0, logits="none")
        return res.kv, keys

    def _pre_rope_recorder(self) -> PreRopeKeys:
        return PreRopeKeys(self.adapter.attention_scaling(self.model))

    def _check_pre_rope(self, probe: KV, keys: PreRopeKeys) -> str | None:
        """None when the recorded keys of the probe, at angle 0, are the bits its forward wrote at position 0
        (angle 0): the capture finds the right tensors in the cache's layout. Else why not (the family then
        compiles canonicals by un-rotation, every time: the choice is per model, never per call)."""
        try:
            band = self._pre_rope_band(probe, keys)
        except ValueError as exc:
            return str(exc)
        written = (probe.values if self.rope_in_values else probe.keys)[..., : self.operator_rope.rotary_dim]
        if not torch.equal(band.to(written.device), written):
            return "the keys handed to RoPE at angle 0 are not the keys the model writes at position 0"
        return None

    def _pre_rope_band(self, kv: KV, keys: PreRopeKeys) -> torch.Tensor:
        """The rotary band (L, T, H, r) of ``kv``'s rotated slot at angle 0, from the keys its forward handed
        RoPE; ``ValueError`` when the recording does not match the forward (count, heads, width)."""
        n, r = len(kv), self.operator_rope.rotary_dim
        slot = kv.values if self.rope_in_values else kv.keys
        if not keys.calls:
            names = ", ".join(self.adapter.rope_functions)
            raise ValueError(f"no call of {names} recorded in the decoder layers' modeling module")
        if len(keys.calls) != slot.shape[0]:
            raise ValueError(f"{len(keys.calls)} RoPE calls recorded for {slot.shape[0]} layers")
        rows = keys.at_angle_zero(n)
        for row in rows:
            if row.shape[1] != slot.shape[2] or row.shape[2] < r:
                covered = tuple(slot.shape[1:])
                raise ValueError(f"a recorded key {tuple(row.shape)} does not cover the band of {covered}")
        return torch.stack([row[..., :r] for row in rows])

    # --- how canonicals are compiled and placed (docs/gpu.md, "bf16 and fp16") ----------------------------------
    @property
    def canonical_source(self) -> str:
        """``"pre_rope"``: a canonical's rotary band is the key its forward handed RoPE, at angle 0 (no
        rounding lost); ``"unrotation"``: the written keys rotated back to angle 0 (``make_free``), for a
        model whose RoPE call cannot be recorded (``canonical_source_reason`` says why). Assignable, to
        compare the two; ``"pre_rope"`` only where the capture works."""
        return self._canonical_source

    @canonical_source.setter
    def canonical_source(self, value: str) -> None:
        if value not in CANONICAL_SOURCES:
            raise InvalidInputError(f"canonical_source must be one of {', '.join(CANONICAL_SOURCES)}, got {value!r}")
        if value == "pre_rope" and self._pre_rope_reason is not None:
            raise UnsupportedModelError(f"{self.name}: no pre-RoPE capture: {self._pre_rope_reason}")
        self._canonical_source = value

    @property
    def canonical_source_reason(self) -> str | None:
        """Why this model compiles canonicals by un-rotation (None: the pre-RoPE capture works)."""
        return self._pre_rope_reason

    def default_rotation(self, dtype: torch.dtype | None = None) -> str:
        """The rotation a placement uses unless told otherwise, for a KV of ``dtype`` (default: the model's).

        float32 / float64: ``"exact"``. bf16 / fp16 with pre-RoPE canonicals: ``"model"``, the model's own
        16-bit RoPE arithmetic, which writes the bits a prefill at the target writes (layer 0: 0 ulps), where
        ``"exact"`` lands up to 2 ulps off them (docs/gpu.md). 16-bit canonicals by un-rotation: ``"exact"``
        (no rotation of them is within 1 ulp; it is what the kernels compute).
        """
        half = (self.dtype if dtype is None else dtype) in HALF_DTYPES
        return "model" if half and self._canonical_source == "pre_rope" else "exact"

    @property
    def rotation(self) -> str:
        """The arithmetic a placement rotates keys with, ``rope.ROTATIONS``: :meth:`default_rotation` until
        assigned (assign None to go back to it)."""
        return self._rotation if self._rotation is not None else self.default_rotation()

    @rotation.setter
    def rotation(self, value: str | None) -> None:
        self._rotation = None if value is None else check_rotation(value)

    def _chat_frame(self) -> tuple[list[int], list[int]]:
        """Anchor (chat template up to the user's content) and prompt suffix (after it) token ids."""
        tok = self.tokenizer
        if tok is None:
            return [], []
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                [{"role": "user", "content": _SENTINEL}], add_generation_prompt=True, tokenize=False
            )
            head, _, tail = text.partition(_SENTINEL)
            return self.tokenize(head), self.tokenize(tail)
        bos = [tok.bos_token_id] if getattr(tok, "bos_token_id", None) is not None else []
        return bos, []

    # --- identity -----------------------------------------------------------------------------
    @cached_property
    def fingerprint(self) -> str:
        """Digest of the architecture, weights and tokenizer (and image processor); stored KV is keyed by it."""
        return engine_fingerprint(self.model, getattr(self, "processor", None) or self.tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def info(self) -> EngineInfo:
        return EngineInfo(
            model=self.name,
            family=self.adapter.name,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            key_dim=self.key_dim,
            value_dim=self.value_dim,
            rotary_dim=self.rope.rotary_dim,
            rope_type=self.rope.rope_type,
            dtype=str(self.dtype).replace("torch.", ""),
            device=str(self.device),
            attention=self.attention,
            linear_backend=self.linear_backend,
            anchor_tokens=len(self.anchor_ids),
            context_length=self.context_length,
        )

    # --- text ---------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidInputError("this engine has no tokenizer; pass token ids instead of text")
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be str, got {type(text).__name__}")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, prompt: str) -> list[int]:
        """The question plus the chat frame's closing (end of user turn, assistant start)."""
        return self.tokenize(prompt) + self.prompt_suffix_ids

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        return tuple(sorted(ids))

    @property
    def scheduler(self) -> Scheduler | None:
        """The scheduler every window on this engine decodes through while a ``batching()`` block is open on its
        model (this engine's, or another's over the same weights), else None."""
        return batching_scheduler(self)

    def batching(self, **options: Any) -> AbstractContextManager[Scheduler]:
        """Within this block, every window on this engine, on any thread or coroutine
        (``ContextWindow.agenerate``), decodes and runs its forwards in one scheduler's shared steps, driven by
        a thread of its own (``options``: ``Scheduler``'s: ``step_tokens``, ``max_rows``, ``kv_budget_bytes``,
        ``max_waiting``). Yields the scheduler (its ``stats()``). On leaving, the answers in progress finish
        first (cancelled instead when the block raises). One at a time per model: engines over the same weights
        (a chat engine with its own anchor) share it."""
        return scheduler_batching(self, **options)

    # --- forward passes -----------------------------------------------------------------------
    def forward(
        self,
        ids: Sequence[int] | torch.Tensor,
        past: Past,
        start: int,
        *,
        logits: str = "last",
        answer: SamplingParams | None = None,
    ) -> ForwardResult:
        """Prefill ``ids`` at positions ``start...`` after ``past`` (a placed KV or its parts in order);
        counted in ``counters``. ``answer`` (with ``logits="last"``): the sampling of the answer the caller
        decodes on from this forward's end. Where the forward runs in a scheduler's step, that step queues
        the answer (``Scheduler.carry``) and the result's ``answer`` is the request; elsewhere it is None and
        the caller decodes from ``prefilled`` (``continue_ids``), with the same tokens either way."""
        input_ids = torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids, dtype=torch.long)
        limit = self.adapter.max_context()
        total = start + int(input_ids.numel())
        if limit is not None and total > limit:
            raise UnsupportedModelError(
                f"{self.name}: window of {total} tokens exceeds the sliding window ({limit}); "
                "sliding-window attention is not position-free"
            )
        self.check_length(total)
        t0 = time.perf_counter()
        res = self._run(input_ids, past, start, logits, answer=answer)
        self.count_forward(int(input_ids.numel()), time.perf_counter() - t0)
        return res

    def count_forward(self, tokens: int, seconds: float, *, per_thread: bool = True) -> None:
        """Count one forward in ``counters`` (under a lock: windows on several threads count at once) and,
        unless ``per_thread`` is False (a scheduler's step, which runs other callers' work), in the calling
        thread's ``thread_counters``."""
        with _COUNT_LOCK:
            c = self.counters
            c.forwards += 1
            c.tokens_prefilled += tokens
            c.forward_s += seconds
        if per_thread:
            c = self.thread_counters  # this thread's own: no other thread writes it
            c.forwards += 1
            c.tokens_prefilled += tokens
            c.forward_s += seconds

    @property
    def thread_counters(self) -> EngineCounters:
        """The calling thread's share of ``counters``: windows on several threads at once (each call on one
        thread) meter their own calls' work from it."""
        local = self.__dict__.get("_per_thread")
        if local is None:
            local = self.__dict__.setdefault("_per_thread", threading.local())
        counters = getattr(local, "counters", None)
        if counters is None:
            counters = local.counters = EngineCounters()
        return counters

    @property
    def context_length(self) -> int | None:
        """Positions a window, its prompt and the answer may take together (the config's
        ``max_position_embeddings``); assign a larger int to extrapolate on purpose, None for no limit."""
        return self._context_length

    @context_length.setter
    def context_length(self, value: int | None) -> None:
        self._context_length = positive_int("context_length", value, optional=True)  # None: no limit

    def check_length(self, positions: int, *, new_tokens: int = 0, answer_field: str = "max_new_tokens") -> None:
        """Refuse ``positions`` tokens of context plus ``new_tokens`` to decode when together they exceed
        ``context_length`` (``ContextLengthError``), before any work is done. Every decoded token counts,
        the last one too, though it is never fed back: the rule OpenAI's API states (prompt + max_tokens
        within the context). ``answer_field``: what the caller calls the answer's length, for the message."""
        limit = self.context_length
        if limit is None or positions + new_tokens <= limit:
            return
        asked = f"{positions} tokens" + (f" + {new_tokens} to generate" if new_tokens else "")
        raise ContextLengthError(
            f"{self.name}: {asked} exceed the model's context length of {limit} "
            f"(slide or evict chunks, shorten the prompt or lower {answer_field}; "
            "assign engine.context_length to extrapolate on purpose)"
        )

    def check_ids(self, ids: Sequence[int] | torch.Tensor) -> None:
        """Refuse token ids outside the vocabulary (``InvalidInputError`` naming a few of them)."""
        if isinstance(ids, torch.Tensor):  # a forward's input: one vectorised test, no Python loop
            bad = ids[(ids < 0) | (ids >= self.vocab_size)].tolist()
        else:  # Python ints, so an id too large for a tensor is still a clear error
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidInputError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")

    def _run(
        self, input_ids: torch.Tensor, past: Past, start: int, logits: str, *, answer: SamplingParams | None = None
    ) -> ForwardResult:
        """The forward itself (a model family with its own inputs, e.g. vision, overrides this)."""
        self.check_ids(input_ids)
        batching = active_scheduler(self)
        sched = batching[0] if batching is not None else driven_scheduler(self)
        if sched is None:
            return run_forward(self.model, input_ids, past, start, logits=logits)
        # under ``serving``, in a step with every running decode and other windows' forwards (a packable
        # recording open here goes with it and sees only this forward's tokens); one asked to run alone, one
        # whose recorders read more than a row's keys, and one outside ``serving`` while a thread drives the
        # scheduler, run between two steps, the unbatched path bit for bit: one forward at a time
        recorders = active_recorders()
        if batching is not None and not forwards_alone() and packable(recorders):
            carried = sched.carry(input_ids, past, start, logits, recorders=recorders, answer=answer, key=batching[1])
            if carried is not None:
                return carried
        return sched.run_alone(lambda: run_forward(self.model, input_ids, past, start, logits=logits))

    @property
    def anchor_kv(self) -> KV:
        """KV of the fixed anchor (chat header) at positions 0.., computed once: windows that ask for it at once
        wait for the first caller's forward (no lock is held across it: the waiters hold an event, so a
        scheduler the forward goes through is driven as usual); if that forward fails, the next caller runs it."""
        kv = self.__dict__.get("_anchor_kv")
        while kv is None:
            with self._anchor_lock:
                flight = self._anchor_flight
                first = flight is None
                if first:
                    flight = self._anchor_flight = threading.Event()
            assert flight is not None
            if first:
                try:
                    kv = self.__dict__.setdefault("_anchor_kv", self._anchor_forward())
                finally:
                    with self._anchor_lock:
                        self._anchor_flight = None
                    flight.set()
            else:
                sched = driven_scheduler(self)
                if sched is not None and sched.drives_here():  # the first caller's forward needs this thread
                    while not flight.wait(0.005):
                        sched.step()
                else:
                    flight.wait()
                kv = self.__dict__.get("_anchor_kv")
        return kv

    def _anchor_forward(self) -> KV:
        if not self.anchor_ids:
            empty_k = torch.empty(self.num_layers, 0, self.num_kv_heads, self.key_dim, dtype=self.dtype)
            empty_v = torch.empty(self.num_layers, 0, self.num_kv_heads, self.value_dim, dtype=self.dtype)
            return KV(empty_k, empty_v, torch.empty(0, dtype=torch.long))
        with alone():  # every window builds on it: the unbatched bits, whatever else is running
            return self.forward(self.anchor_ids, None, 0, logits="none").kv.to("cpu")

    def canonical(self, ids: Sequence[int], *, anchored: bool = True) -> KV:
        """KV(B | ∅): the chunk alone after the fixed anchor, position-free (keys at angle 0).

        The rotary band of the keys is the one the forward handed RoPE, as the model writes it at angle 0
        (``canonical_source == "pre_rope"``): nothing is un-rotated, so a 16-bit canonical loses no bits
        to a rotation back. Values, and features past the band, are the written ones. A model whose RoPE
        call cannot be recorded un-rotates the written keys (``make_free``); a chunk whose recording fails
        on a model whose probe passed raises ``UnsupportedModelError`` (never one un-rotated canonical among
        pre-RoPE ones: it would be keyed and placed as one). Under a scheduler the forward is a row of a
        step like any window forward (its keys within the batching tolerance of a lone forward's).

        ``anchored=False`` computes it with no anchor at all (the chunk's first token becomes an
        attention sink); kept for the benchmark that chooses between the two.
        """
        if len(ids) == 0:
            raise InvalidInputError("a chunk needs at least one token")
        past = self.anchor_kv if anchored and self.anchor_ids else None
        start = len(self.anchor_ids) if past is not None else 0
        if self._canonical_source != "pre_rope":
            return self.make_free(self.forward(ids, past, start, logits="none").kv.to("cpu"))
        keys = self._pre_rope_recorder()
        with recording(self.adapter.rope_modules(self.model), self.adapter.rope_functions, keys):
            res = self.forward(ids, past, start, logits="none")
        kv = res.kv.to("cpu")
        try:
            band = self._pre_rope_band(kv, keys).to("cpu")
        except ValueError as exc:  # the probe passed, so the model took another path for this forward
            # never un-rotate this one chunk instead: it would be stored and placed as a pre-RoPE canonical
            raise UnsupportedModelError(
                f"{self.name}: the pre-RoPE capture failed for a chunk of {len(ids)} tokens ({exc}); "
                "set canonical_source = 'unrotation' to compile every canonical by un-rotation"
            ) from exc
        r = band.shape[-1]
        slot = (kv.values if self.rope_in_values else kv.keys).clone()
        slot[..., :r] = band
        if self.rope_in_values:
            return KV(kv.keys, slot, None, kv.deltas)
        return KV(slot, kv.values, None, kv.deltas)

    # --- the operator, bound to this model's RoPE ---------------------------------------------
    # Two hooks adapt the operator to a model: ``rope_for`` (the spec for a run of tokens, a family with
    # per-token position offsets binds them there) and ``rope_in_values`` (the operator works on the KV
    # with key and value slots swapped, so the rotation lands on the band and the other slot is carried
    # byte for byte; patches are swapped back).
    def rope_for(self, deltas: torch.Tensor | None) -> RopeSpec:
        """The spec the operator rotates a run of tokens with, given their per-token axis offsets
        (``KV.deltas``; None for text). Families with multi-axis positions override this."""
        return self.operator_rope

    def _view(self, kv: KV) -> KV:
        return _swap(kv) if self.rope_in_values else kv

    def _view_patch(self, patch: Patch | None) -> Patch | None:
        return _swap_patch(patch) if self.rope_in_values and patch is not None else patch

    def relocate(self, kv: KV, target: torch.Tensor | int, *, exact: bool = True) -> KV:
        return self._view(op.relocate(self._view(kv), self.rope_for(kv.deltas), target, exact=exact))

    def make_free(self, kv: KV) -> KV:
        return self._view(op.make_free(self._view(kv), self.rope_for(kv.deltas)))

    def reconstruct(self, canonical: KV, patch: Patch | None) -> KV:
        return op.reconstruct(canonical, _beside(patch, canonical))

    def form_patch(
        self,
        conditioned: KV | Sequence[KV],
        canonical: KV,
        rank: int,
        *,
        layers: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> Patch:
        """A rank-``rank`` patch of ``canonical`` from its conditioned KV(s) (the same tokens: the canonical's
        deltas are theirs), formed on the canonical's device: a patch is applied with its canonical, and a
        canonical is kept in host memory (``canonical``) while a forward's KV is on the model's device."""
        home = canonical.keys.device
        if isinstance(conditioned, KV):
            views: KV | list[KV] = self._view(conditioned.to(home))
        else:
            views = [self._view(c.to(home)) for c in conditioned]
        spec = self.rope_for(canonical.deltas)
        patch = op.form_patch(views, self._view(canonical), spec, rank, layers=layers, dtype=dtype)
        return _swap_patch(patch) if self.rope_in_values else patch

    def apply(
        self,
        canonical: KV,
        patch: Patch | None,
        target: torch.Tensor | int,
        *,
        exact: bool = False,
        rotation: str | None = None,
    ) -> KV:
        """Serve ``canonical`` (+ ``patch``) at ``target`` (``operator.apply_patch``); ``rotation`` defaults to
        the engine's ``rotation`` setting."""
        spec = self.rope_for(canonical.deltas)
        view, view_patch = self._view(canonical), self._view_patch(_beside(patch, canonical))
        rot = self.rotation if rotation is None else rotation
        return self._view(op.apply_patch(view, view_patch, spec, target, exact=exact, rotation=rot))

    def deep_layers(self, fraction: float = 0.5) -> list[int]:
        """The deepest ``fraction`` of layers (the deep-only patch variant)."""
        if not 0 < fraction <= 1:
            raise InvalidInputError(f"fraction must be in (0, 1], got {fraction}")
        n = max(1, round(self.num_layers * fraction))
        return list(range(self.num_layers - n, self.num_layers))

    # --- reading out ----------------------------------------------------------------------------
    def next_token_logprobs(self, past: Past, prompt_ids: Sequence[int], start: int) -> torch.Tensor:
        """Log-probabilities (vocab,) of the token after ``prompt_ids`` placed at ``start``."""
        res = self.forward(prompt_ids, past, start, logits="last")
        return torch.log_softmax(res.logits[-1].float(), dim=-1).cpu()

    def generate_ids(self, past: Past, prompt_ids: Sequence[int], start: int, params: SamplingParams) -> Iterator[int]:
        """Token ids decoded after ``prompt_ids`` placed at ``start`` (greedy or sampled per ``params``)."""
        params.validate()
        self.check_length(start + len(prompt_ids), new_tokens=params.max_new_tokens)
        batching = active_scheduler(self)
        if batching is not None:  # decoded with every other client's work, in the scheduler's batches
            return batching[0].submit(past, prompt_ids, start, params, key=batching[1])
        res = self.forward(prompt_ids, past, start, logits="last")
        return self._decode(res.cache, res.logits[-1], start + len(prompt_ids), params)

    def continue_ids(self, prompt: Prefilled, params: SamplingParams) -> Iterator[int]:
        """Decode on from a prompt that was already prefilled (see ``ForwardResult.prefilled``)."""
        params.validate()
        self.check_length(prompt.next_position, new_tokens=params.max_new_tokens)
        batching = active_scheduler(self)
        if batching is not None:
            return batching[0].submit_prefilled(prompt, params, key=batching[1])
        return self._decode(prompt.cache(self.model.config), prompt.logits, prompt.next_position, params)

    def _decode(self, cache: object, logits: torch.Tensor, position: int, params: SamplingParams) -> Iterator[int]:
        if not params.eos_token_ids:
            params.eos_token_ids = self.eos_token_ids
        return decode_tokens(self.model, cache, logits, position, params, constraint=self.constraint(params))

    def constraint(self, params: SamplingParams) -> TokenConstraint | None:
        """The walk through ``params.grammar`` for one answer (None for free text); the grammar's
        end-of-sequence joins ``params.eos_token_ids`` so the answer ends where the grammar does."""
        if params.grammar is None:
            return None
        if self.tokenizer is None:
            raise InvalidInputError("constrained decoding needs an engine with a tokenizer")
        constraint = TokenConstraint(params.grammar, self.tokenizer, self.vocab_size)
        params.eos_token_ids = tuple(sorted(set(params.eos_token_ids) | set(constraint.eos_token_ids)))
        return constraint

    def generate(self, past: Past, prompt_ids: Sequence[int], start: int, params: SamplingParams) -> TextStream:
        """Stream text pieces after ``prompt_ids``; stops at EOS, a stop string or the token limit."""
        if self.tokenizer is None:
            raise InvalidInputError("this engine has no tokenizer; use generate_ids")
        return self.stream(self.generate_ids(past, prompt_ids, start, params), params)

    def stream(self, token_ids: Iterator[int], params: SamplingParams) -> TextStream:
        """Text pieces of a token stream (stop strings applied)."""
        if self.tokenizer is None:
            raise InvalidInputError("this engine has no tokenizer; use generate_ids")
        if not params.eos_token_ids:
            params.eos_token_ids = self.eos_token_ids
        return TextStream(token_ids, self.tokenizer, params)

    # --- compression: the operations a KV compression policy needs (kamera_engine.compressed) --------
    def prefill_with_stats(
        self,
        past: Past,
        window_ids: Sequence[int],
        prompt_ids: Sequence[int],
        spec: compressed.AttentionStatsSpec,
        observation: int,
    ) -> compressed.StatsPrefill:
        """Prefill ``prompt_ids`` over a window and score its keys by the queries ``spec`` declares."""
        return compressed.prefill_with_stats(self, past, window_ids, prompt_ids, spec, observation)

    def decode_on(
        self,
        kv: KV,
        logits: torch.Tensor,
        position: int,
        params: SamplingParams,
        after_step: compressed.StepHook | None = None,
    ) -> Iterator[int]:
        """Decode after a compressed ``kv``; ``after_step`` names cache rows to drop after each step."""
        return compressed.decode_on(self, kv, logits, position, params, after_step)

    def score_on(
        self,
        kv: KV,
        logits: torch.Tensor,
        position: int,
        continuation: Sequence[int],
        after_step: compressed.StepHook | None = None,
    ) -> list[torch.Tensor]:
        """Teacher-forced next-token log-probs along ``continuation`` after a compressed ``kv``."""
        return compressed.score_on(self, kv, logits, position, continuation, after_step)

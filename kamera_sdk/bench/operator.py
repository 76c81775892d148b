"""``kamera bench operator``: the position-free operator on the default model (issue figures of §3-4).

Fidelity on real-text multi-hop probes (three chunks of >= 128 tokens, answer needs more than one):
blind reuse vs rank-m patches vs re-prefill, by next-token KL. Exactness of relocation. The three
reorder arms (exact / transfer / orbit). Speed of relocate + patch vs re-prefilling a chunk in context
at 256 / 1024 / 2048 tokens, bytes of patches, and how close apply runs to memcpy bandwidth.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import cached_property
from typing import Any, TypeVar

import torch

from kamera_engine import KV, Engine, Patch, apply_patch, fused_apply
from kamera_engine.adapters.base import capture_pre_rope_keys, reference_rotate
from kamera_engine.selective import reprefill_from_layer

from ..console import err, track
from .corpus import Probe, load_corpus
from .metrics import eta, kl, mean, timed, timed_result

T = TypeVar("T")
RANKS = (8, 16, 32, 64)
#: Partial re-prefill: fractions of the layers kept from the canonicals (the shallowest ones).
SHALLOW_FRACTIONS = (0.0, 0.1, 0.25, 0.5)
TARGETS = (None, 1000, 4000, 8000)  # None = the canonical's own place, right after the anchor
LENGTHS = (256, 1024, 2048)


def relocation_error(engine: Engine, ids: list[int]) -> dict[str, Any]:
    """Relocated keys vs keys rotated to the target by the model's own RoPE code (all layers, fp32),
    and the float32 drift of a real re-prefill at another position (values never move, so any value
    difference there is the forward pass's own rounding, not relocation)."""
    _ = engine.anchor_kv
    with capture_pre_rope_keys(engine.model) as pre:
        can = engine.canonical(ids)
    a = len(engine.anchor_ids)
    worst, drift = 0.0, 0.0
    limit = engine.context_length
    drift_targets = []
    for t in TARGETS:
        target = a if t is None else t
        positions = torch.arange(target, target + len(ids))
        placed = engine.relocate(can, positions)
        for layer, k in enumerate(pre):
            ref = reference_rotate(engine.model, engine.adapter, k[..., -len(ids) :, :], positions)[0].transpose(0, 1)
            worst = max(worst, (placed.keys[layer] - ref.to(placed.keys.device)).abs().max().item())
        if limit is not None and target + len(ids) > limit:
            continue  # relocation is exact anywhere; a re-prefill there would run past the model's context
        shifted = engine.forward(engine.anchor_ids + ids, None, target - a, logits="none").kv.slice(a, a + len(ids))
        drift = max(drift, (shifted.values.to(can.values.device) - can.values).abs().max().item())
        drift_targets.append(target)
    return {
        "relocation_max_abs_err": worst,
        "reprefill_drift_max_abs_err": drift,
        "reprefill_drift_targets": drift_targets,
    }


class _ProbeRun:
    """One probe: reference re-prefill, canonicals, conditioned KV of every chunk."""

    def __init__(self, engine: Engine, probe: Probe) -> None:
        e = engine
        self.e = e
        self.chunks = [e.tokenize(c + "\n\n") for c in probe.chunks]
        self.q = e.prompt_ids(probe.question)
        ids = e.anchor_ids + [t for c in self.chunks for t in c]
        self.full = e.forward(ids, None, 0, logits="none").kv
        self.starts = []
        pos = len(e.anchor_ids)
        for c in self.chunks:
            self.starts.append(pos)
            pos += len(c)
        self.cond = [self.full.slice(s, s + len(c)) for s, c in zip(self.starts, self.chunks, strict=True)]
        self.can = [e.canonical(c) for c in self.chunks]
        self.ref = e.next_token_logprobs(self.full, self.q, len(self.full))

    def logprobs(self, served: list[KV]) -> torch.Tensor:
        past = KV.cat([self.e.anchor_kv, *served])
        return self.e.next_token_logprobs(past, self.q, len(past))

    @cached_property
    def placed_canonicals(self) -> list[KV]:
        """Every chunk's canonical relocated to its place (the leading one is exact)."""
        return [self.e.apply(c, None, s) for c, s in zip(self.can, self.starts, strict=True)]

    def blind(self) -> torch.Tensor:
        return self.logprobs(self.placed_canonicals)

    def partial(self, from_layer: int) -> torch.Tensor:
        """Chunks behind the first keep their canonicals below ``from_layer`` and are re-prefilled in
        context from there on (the paper's partial re-prefill, appendices B-D)."""
        window, ids, spans = self._blind_window
        placed = reprefill_from_layer(self.e, window, ids, spans, from_layer, len(self.e.anchor_ids))
        return self.e.next_token_logprobs(placed, self.q, len(placed))

    @cached_property
    def _blind_window(self) -> tuple[KV, list[int], list[range]]:
        """The blind window placed at 0..N-1, its token ids, and the spans of the chunks behind the first."""
        window = KV.cat([self.e.anchor_kv, *self.placed_canonicals])
        ids = self.e.anchor_ids + [t for c in self.chunks for t in c]
        spans = [range(s, s + len(c)) for s, c in zip(self.starts[1:], self.chunks[1:], strict=True)]
        return window, ids, spans

    def patched(self, rank: int, layers: list[int] | None = None) -> torch.Tensor:
        served = [self.placed_canonicals[0]]
        for i in range(1, len(self.chunks)):
            patch = self.e.form_patch(self.cond[i], self.can[i], rank, layers=layers)
            served.append(self.e.apply(self.can[i], patch, self.starts[i]))
        return self.logprobs(served)


def fidelity(engine: Engine, probes: list[Probe]) -> dict[str, Any]:
    blind, by_rank, deep = [], {r: [] for r in RANKS}, []
    shallow = sorted({round(f * engine.num_layers) for f in SHALLOW_FRACTIONS})
    partial: dict[int, list[float]] = {k: [] for k in shallow}
    flips, restored = 0, {r: 0 for r in RANKS}
    for probe in track(probes, "fidelity probes"):
        run = _ProbeRun(engine, probe)
        lp_blind = run.blind()
        blind.append(kl(run.ref, lp_blind))
        flip = int(lp_blind.argmax()) != int(run.ref.argmax())
        flips += flip
        for r in RANKS:
            lp = run.patched(r)
            by_rank[r].append(kl(run.ref, lp))
            restored[r] += flip and int(lp.argmax()) == int(run.ref.argmax())
        deep.append(kl(run.ref, run.patched(32, engine.deep_layers(0.5))))
        for k in shallow:
            partial[k].append(kl(run.ref, run.partial(k)))
    kb = mean(blind)
    return {
        "blind_kl": kb,
        "patch_kl": {str(r): mean(v) for r, v in by_rank.items()},
        "eta": {str(r): eta(mean(v), kb) for r, v in by_rank.items()},
        "eta_deep_half_rank32": eta(mean(deep), kb),
        # {shallow layers kept from the canonical: KL}; the forward then costs (layers - k) / layers
        "num_layers": engine.num_layers,
        "partial_reprefill_kl": {str(k): mean(v) for k, v in partial.items()},
        "partial_reprefill_eta": {str(k): eta(mean(v), kb) for k, v in partial.items()},
        "blind_flips": flips,
        "flip_recover": {str(r): (restored[r] / flips if flips else None) for r in RANKS},
        "probes": len(probes),
    }


def anchor_choice(engine: Engine, probes: list[Probe]) -> dict[str, Any]:
    """Blind KL with the chat header as the canonical's anchor vs no anchor at all.

    ``lower_blind_kl`` says which this probe set favours; ``in_use`` is the engine's anchor (the header:
    docs/operator.md explains why it stays when the probes favour none).
    """
    with_header, none = [], []
    for probe in track(probes, "anchor choice"):
        run = _ProbeRun(engine, probe)
        with_header.append(kl(run.ref, run.blind()))
        bare = [
            engine.apply(engine.canonical(c, anchored=False), None, s)
            for c, s in zip(run.chunks, run.starts, strict=True)
        ]
        bare[0] = engine.apply(run.can[0], None, run.starts[0])  # the leading chunk is exact either way
        none.append(kl(run.ref, run.logprobs(bare)))
    lower = "chat_header" if mean(with_header) <= mean(none) else "none"
    in_use = "chat_header" if len(engine.anchor_ids) else "none"
    return {
        "blind_kl_chat_header": mean(with_header),
        "blind_kl_no_anchor": mean(none),
        "lower_blind_kl": lower,
        "in_use": in_use,
    }


def reorder_arms(engine: Engine, probes: list[Probe], rank: int = 32) -> dict[str, Any]:
    """Three predecessors, B last: the ordering's own patch (exact), the patch formed in the original
    order (transfer), and the orbit patch averaged over the other orderings (held out)."""
    e = engine
    arms: dict[str, list[float]] = {"exact": [], "transfer": [], "orbit": [], "blind": []}
    for i, probe in enumerate(track(probes, "reorder arms")):
        distractor = probes[(i + 1) % len(probes)].chunks[0]
        preds = [e.tokenize(t + "\n\n") for t in (probe.chunks[0], probe.chunks[1], distractor)]
        b = e.tokenize(probe.chunks[2] + "\n\n")
        q = e.prompt_ids(probe.question)
        can_b = e.canonical(b)
        a = len(e.anchor_ids)
        runs = {}
        for perm in itertools.permutations(range(3)):
            ids = e.anchor_ids + [t for j in perm for t in preds[j]] + b
            full = e.forward(ids, None, 0, logits="none").kv
            runs[perm] = full
        start_b = a + sum(len(p) for p in preds)
        cond = {perm: full.slice(start_b, start_b + len(b)) for perm, full in runs.items()}
        identity = (0, 1, 2)
        transfer_patch = e.form_patch(cond[identity], can_b, rank)
        for perm, full in runs.items():
            if perm == identity:
                continue
            head = full.slice(0, start_b)
            ref = e.next_token_logprobs(full, q, len(full))

            def lp(kv_b: KV, head: KV = head, q: list[int] = q) -> torch.Tensor:
                # parts in order: the forward brings each to the model's device (``head`` is a forward's KV,
                # ``kv_b`` is placed beside its canonical, in host memory on a GPU)
                return e.next_token_logprobs([head, kv_b], q, len(head) + len(kv_b))

            orbit = e.form_patch([cond[p] for p in runs if p != perm], can_b, rank)
            arms["blind"].append(kl(ref, lp(e.apply(can_b, None, start_b))))
            arms["exact"].append(kl(ref, lp(e.apply(can_b, e.form_patch(cond[perm], can_b, rank), start_b))))
            arms["transfer"].append(kl(ref, lp(e.apply(can_b, transfer_patch, start_b))))
            arms["orbit"].append(kl(ref, lp(e.apply(can_b, orbit, start_b))))
    kb = mean(arms["blind"])
    return {
        "rank": rank,
        "blind_kl": kb,
        "kl": {k: mean(v) for k, v in arms.items() if k != "blind"},
        "eta": {k: eta(mean(v), kb) for k, v in arms.items() if k != "blind"},
    }


def _text_tokens(engine: Engine, n: int) -> list[int]:
    corpus = load_corpus()
    ids: list[int] = []
    for page in itertools.cycle(corpus.pages):
        ids += engine.tokenize(page.text + "\n\n")
        if len(ids) >= n:
            return ids[:n]
    raise AssertionError("unreachable")


def speed(engine: Engine, lengths: tuple[int, ...] = LENGTHS, context: int = 512) -> dict[str, Any]:
    """Re-prefill a chunk in context vs relocate + rank-32 patch, per chunk length."""
    e = engine
    out: dict[str, Any] = {}
    ctx_ids = _text_tokens(e, context + max(lengths))
    a = len(e.anchor_ids)
    # on the model's device, all of it: the anchor and a canonical are kept in host memory, and a GPU's
    # re-prefill is set against an apply in device memory (each timing waits for the device: ``_synced``)
    ctx = KV.cat([e.anchor_kv.to(e.device), e.forward(ctx_ids[:context], e.anchor_kv, a, logits="none").kv])
    for n in track(lengths, "speed"):
        ids = ctx_ids[context : context + n]
        reprefill = timed(_synced(lambda ids=ids: e.forward(ids, ctx, a + context, logits="none")), repeat=3)
        cond = e.forward(ids, ctx, a + context, logits="none").kv
        can = e.canonical(ids).to(e.device)
        patch = e.form_patch(cond, can, 32)
        buf = KV(torch.empty_like(can.keys), torch.empty_like(can.values))
        reuse = timed(
            _synced(lambda can=can, patch=patch, buf=buf: apply_patch(can, patch, e.rope, a + context, out=buf)),
            repeat=10,
        )
        form = timed(_synced(lambda cond=cond, can=can: e.form_patch(cond, can, 32)), repeat=3)
        out[str(n)] = {
            "reprefill_s": reprefill,
            "reuse_s": reuse,
            "speedup": reprefill / reuse,
            "patch_form_s": form,
            # forming costs a canonical forward + the conditioned forward + factorisation, once
            "break_even_reuses": (2 * reprefill + form) / max(reprefill - reuse, 1e-9),
        }
    return out


def bandwidth(engine: Engine, n: int = 1024) -> dict[str, Any]:
    """Bytes moved per second by apply (read canonical + factors, write placed K/V) vs a plain copy."""
    e = engine
    ids = _text_tokens(e, n)
    can = e.canonical(ids).to(e.device)  # the model's memory: a GPU's bandwidth, not the host's
    cond = e.forward(ids, e.anchor_kv, len(e.anchor_ids), logits="none").kv  # any conditioning will do
    buf = KV(torch.empty_like(can.keys), torch.empty_like(can.values))
    kv_bytes = can.nbytes
    t_copy = timed(_synced(lambda: (buf.keys.copy_(can.keys), buf.values.copy_(can.values))), repeat=20)
    result: dict[str, Any] = {
        "memcpy_gbps": 2 * kv_bytes / t_copy / 1e9,
        "apply_gbps_by_rank": {},
        "apply_kernel": fused_apply.status(),  # "c" (engine/csrc, fused) or "torch"
    }
    t_rel = timed(_synced(lambda: apply_patch(can, None, e.rope, 5000, out=buf)), repeat=20)
    result["relocate_gbps"] = 2 * kv_bytes / t_rel / 1e9
    fractions = {}
    for r in RANKS:
        patch = e.form_patch(cond, can, r)
        t = timed(_synced(lambda patch=patch: apply_patch(can, patch, e.rope, 5000, out=buf)), repeat=20)
        result["apply_gbps_by_rank"][str(r)] = (2 * kv_bytes + patch.nbytes) / t / 1e9
        fractions[str(r)] = patch.nbytes / kv_bytes
    result["apply_gbps"] = result["apply_gbps_by_rank"]["32"]
    result["patch_bytes_fraction"] = fractions
    result["kv_bytes_per_token"] = kv_bytes / n
    return result


def run(engine: Engine, *, quick: bool = False) -> dict[str, Any]:
    corpus = load_corpus()
    probes = corpus.probes[:4] if quick else corpus.probes
    err.print(f"[bold]operator[/] on {engine.name}: {len(probes)} probes")
    result: dict[str, Any] = {
        "model": engine.name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
    }
    result.update(relocation_error(engine, engine.tokenize(corpus.pages[0].text)))
    result.update(fidelity(engine, probes))
    result["anchor"] = anchor_choice(engine, probes[:4] if quick else probes)
    result["reorder"] = reorder_arms(engine, probes[:2] if quick else probes[:6])
    lengths = (256, 1024) if quick else LENGTHS
    by_len = speed(engine, lengths)
    result["speed_by_length"] = by_len
    result["chunk_tokens"] = 1024
    result["reprefill_s"] = by_len["1024"]["reprefill_s"]
    result["reuse_s"] = by_len["1024"]["reuse_s"]
    result["speedup"] = by_len["1024"]["speedup"]
    result.update(bandwidth(engine))
    return result


#: chunk lengths of the shape sweep (DESIGN.md §3: ``speedup_by_tokens``)
SHAPE_TOKENS = (512, 1024, 2048, 4096)


def shape_speed(engine: Engine, tokens: tuple[int, ...] = SHAPE_TOKENS, context: int = 512, rank: int = 32):
    """Reuse (relocate + rank-``rank`` patch) vs re-prefill of a chunk of each length behind ``context``
    tokens, on a random-weight engine fed random token ids (timing only: the factors are random too,
    apply's cost depends on their shape alone)."""
    e = engine
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, e.vocab_size, (context + max(tokens),), generator=g).tolist()
    ctx = e.forward(ids[:context], None, 0, logits="none").kv
    out: dict[str, Any] = {}
    for n in track(tokens, "shape speed"):
        chunk = ids[context : context + n]
        # on a CPU one run: a prefill of thousands of tokens is seconds, far above timer and warm-up noise; on a GPU
        # it is tens of milliseconds and the first forward also pays the kernels' set-up (an H200's first 512-token
        # prefill of an 8B shape took 8x the next), so one warm-up and the median of three
        repeat, warmup = (3, 1) if e.device.type == "cuda" else (1, 0)
        prefill = _synced(lambda chunk=chunk: e.forward(chunk, ctx, context, logits="none"))
        reprefill, res = timed_result(prefill, repeat, warmup)
        can = KV(res.kv.keys.clone(), res.kv.values.clone(), None)
        patch = _random_patch(can, rank, g)
        buf = KV(torch.empty_like(can.keys), torch.empty_like(can.values))
        reuse = timed(
            _synced(lambda can=can, patch=patch, buf=buf: apply_patch(can, patch, e.rope, context, out=buf)), 5
        )
        out[str(n)] = {"reprefill_s": reprefill, "reuse_s": reuse, "speedup": reprefill / reuse}
    return out


def _synced(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` followed by a CUDA synchronisation (kernels run asynchronously: time their completion)."""

    def run() -> T:
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return result

    return run


def _random_patch(can: KV, rank: int, g: torch.Generator) -> Patch:
    layers, n = can.keys.shape[:2]
    fk, fv = can.keys[0, 0].numel(), can.values[0, 0].numel()

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(can.keys.device, can.keys.dtype)

    return Patch(
        draw(layers, n, rank),
        draw(layers, rank, fk),
        draw(layers, n, rank),
        draw(layers, rank, fv),
        tuple(range(layers)),
    )


def shape_bandwidth(engine: Engine, n: int = 1024, rank: int = 32) -> dict[str, Any]:
    """Apply (rank-``rank`` patch + rotation) and relocation bandwidth vs a copy of the same KV, and the
    patch's bytes, at this shape."""
    e = engine
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, e.vocab_size, (n,), generator=g).tolist()
    can = e.forward(ids, None, 0, logits="none").kv
    can = KV(can.keys, can.values, None)
    patch = _random_patch(can, rank, g)
    buf = KV(torch.empty_like(can.keys), torch.empty_like(can.values))
    kv_bytes = can.nbytes
    t_copy = timed(_synced(lambda: (buf.keys.copy_(can.keys), buf.values.copy_(can.values))), repeat=10)
    t_rel = timed(_synced(lambda: apply_patch(can, None, e.rope, 5000, out=buf)), repeat=10)
    t_app = timed(_synced(lambda: apply_patch(can, patch, e.rope, 5000, out=buf)), repeat=10)
    return {
        "memcpy_gbps": 2 * kv_bytes / t_copy / 1e9,
        "relocate_gbps": 2 * kv_bytes / t_rel / 1e9,
        "apply_gbps": (2 * kv_bytes + patch.nbytes) / t_app / 1e9,
        "apply_vs_memcpy": t_copy / t_app,
        "patch_rank": rank,
        "patch_bytes": patch.nbytes,
        "patch_bytes_fraction": patch.nbytes / kv_bytes,
        "kv_bytes_per_token": kv_bytes / n,
        "apply_kernel": _kernel_name(can.keys),
    }


def _kernel_name(t: torch.Tensor) -> str:
    from kamera_engine.kernels import dispatch

    if dispatch.serves(t):
        return f"triton {dispatch.triton_version()}"
    return fused_apply.status() if fused_apply.usable(t) or t.device.type == "cpu" else "torch"


def run_shape(engine: Engine, shape: str, *, quick: bool = False) -> dict[str, Any]:
    """``kamera bench operator --shape NAME``: speed only (random weights carry no fidelity)."""
    tokens = (512, 2048) if quick else SHAPE_TOKENS
    err.print(f"[bold]operator[/] speed on {engine.name}: chunks of {', '.join(map(str, tokens))} tokens")
    cfg = engine.model.config
    by = shape_speed(engine, tokens)
    result: dict[str, Any] = {
        "model": engine.name,
        "shape": shape,
        "layers": engine.num_layers,
        "hidden_size": int(cfg.hidden_size),
        "kv_heads": engine.num_kv_heads,
        "head_dim": engine.key_dim,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "context_tokens": 512,
        "reuse": "relocate + rank-32 patch",
        "speedup_by_tokens": {k: v["speedup"] for k, v in by.items()},
        "speed_by_tokens": by,
    }
    result.update(shape_bandwidth(engine))
    return result

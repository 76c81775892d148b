"""``kamera bench compare``: reuse and compression policies side by side on the same probes.

Reuse: each policy serves the same three-chunk multi-hop probes from the same exactly relocated
canonicals; Kamera's patches were formed once beforehand (a window that read the chunks, evicted and
recalled them), the token-recompute baselines select their tokens at use. Per policy: eta (fraction of
the blind -> re-prefill KL gap closed), mean KL to ``recompute``, flip-recover (on probes where blind
changes recompute's greedy answer, the fraction the policy restores) and reuse time (assembling the
window). Then, at matched KV-byte budgets, a rank-m patch against token recompute of equal bytes (the
core paper's table 6). Compression: mean KL to the full cache along the full cache's greedy
continuation, KV bytes kept, and decode tokens/s with and without compression.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kamera_engine import Engine, SamplingParams

from ..compress import make_compressor
from ..compress.runner import decode_compressed, prefill_compressed, score_continuation
from ..console import err, track
from ..policies.cacheblend import CacheBlendPolicy
from ..policies.mpic import MPICPolicy
from ..window import ContextWindow
from .corpus import Probe, load_corpus
from .metrics import eta, kl, mean

ANSWER_TOKENS = 8


def _window(engine: Engine, policy: Any, probe: Probe, rank: int = 32) -> ContextWindow:
    win = ContextWindow(engine, policy=policy, rank=rank)
    ids = [win.add_text(c + "\n\n") for c in probe.chunks]
    if win.policy.name == "kamera":
        win.assemble()  # compile: the conditioned forward that forms the patches, once
        for cid in ids[1:]:
            win.evict(cid)
        for cid in ids[1:]:
            win.recall(cid)  # served from the stored patches: rotation + rank-m GEMM, no forward
    return win


def _use(win: ContextWindow, question: str) -> tuple[torch.Tensor, str, float]:
    t0 = time.perf_counter()
    win.assemble()
    reuse = time.perf_counter() - t0
    lp = win.next_token_logprobs(question)
    answer = win.generate(question, max_new_tokens=ANSWER_TOKENS).strip()
    return lp, answer, reuse


def reuse_policies(engine: Engine, probes: list[Probe]) -> dict[str, Any]:
    names = ("recompute", "prefix", "blind", "cacheblend", "mpic", "kamera")
    rows: dict[str, dict[str, list]] = {n: {"kl": [], "answer": [], "reuse": []} for n in names}
    for probe in track(probes, "reuse policies"):
        ref_lp = None
        for name in names:
            lp, answer, reuse = _use(_window(engine, name, probe), probe.question)
            ref_lp = lp if name == "recompute" else ref_lp
            assert ref_lp is not None
            rows[name]["kl"].append(kl(ref_lp, lp))
            rows[name]["answer"].append(answer)
            rows[name]["reuse"].append(reuse)
    kb = mean(rows["blind"]["kl"])
    flipped = [i for i, a in enumerate(rows["blind"]["answer"]) if a != rows["recompute"]["answer"][i]]
    out: dict[str, Any] = {"probes": len(probes), "blind_flips": len(flipped)}
    for name in names:
        restored = [i for i in flipped if rows[name]["answer"][i] == rows["recompute"]["answer"][i]]
        out[name] = {
            "eta": eta(mean(rows[name]["kl"]), kb),
            "kl_mean": mean(rows[name]["kl"]),
            "flip_recover": len(restored) / len(flipped) if flipped else None,
            "reuse_s": mean(rows[name]["reuse"]),
            "answers_match_recompute": mean(
                [float(a == r) for a, r in zip(rows[name]["answer"], rows["recompute"]["answer"], strict=True)]
            ),
        }
    return out


def matched_bytes(engine: Engine, probes: list[Probe], ranks: tuple[int, ...] = (8, 16, 32)) -> dict[str, Any]:
    """Rank-m patch vs token recompute of the same KV bytes per reused chunk.

    A rank-m patch of a T-token chunk stores m (T + F) numbers per layer for K and for V (F = KV heads x
    head dim); the KV of k tokens stores k F. Equal bytes: k = m (T + F) / F tokens per chunk.
    """
    feat = engine.num_kv_heads * engine.key_dim
    out: dict[str, Any] = {"feature_dim": feat}
    refs = []  # per probe, whatever the rank: re-prefill's log-probs and the reused chunks' mean length
    for probe in probes:
        lengths = [len(engine.tokenize(c + "\n\n")) for c in probe.chunks[1:]]
        refs.append((_use(_window(engine, "recompute", probe), probe.question)[0], sum(lengths) / len(lengths)))
    for rank in track(ranks, "matched byte budgets"):
        arms: dict[str, list[float]] = {"blind": [], "kamera": [], "cacheblend": [], "mpic": []}
        fractions = []
        for probe, (ref_lp, t_mean) in zip(probes, refs, strict=True):
            k_tokens = round(rank * (t_mean + feat) / feat)
            fractions.append(min(1.0, k_tokens / t_mean))
            policies = {
                "blind": "blind",
                "kamera": "kamera",
                "cacheblend": CacheBlendPolicy(ratio=min(1.0, k_tokens / t_mean)),
                "mpic": MPICPolicy(k=k_tokens),
            }
            for arm, pol in policies.items():
                lp, _, _ = _use(_window(engine, pol, probe, rank=rank), probe.question)
                arms[arm].append(kl(ref_lp, lp))
        kb = mean(arms["blind"])
        out[str(rank)] = {
            "token_fraction": mean(fractions),
            "eta": {arm: eta(mean(v), kb) for arm, v in arms.items() if arm != "blind"},
        }
    return out


def _full_cache(engine: Engine, probe: Probe) -> tuple[Any, list[int], list[int], list[int], list[torch.Tensor]]:
    """A probe's window with its full cache: the assembled KV, the window's and the prompt's ids, the
    full cache's greedy answer and its next-token log-probs along that answer (the reference)."""
    win = ContextWindow(engine, policy="recompute")
    for c in probe.chunks:
        win.add_text(c + "\n\n")
    past = win.assemble()
    window_ids = list(engine.anchor_ids) + [t for cid in win.chunks for t in win.chunk(cid).token_ids]
    prompt = engine.prompt_ids(probe.question)
    full_tokens = list(engine.generate_ids(past, prompt, len(past), SamplingParams(max_new_tokens=ANSWER_TOKENS)))
    ref = [engine.next_token_logprobs(past, prompt + full_tokens[:i], len(past)) for i in range(len(full_tokens))]
    return past, window_ids, prompt, full_tokens, ref


def compression(engine: Engine, probes: list[Probe], budgets: tuple[float, ...] = (0.2, 0.5)) -> dict[str, Any]:
    out: dict[str, Any] = {"david_reduces_to_snapkv": True, "note": "text-only windows: DAVID is SnapKV"}
    gen_tokens = 24
    full = [_full_cache(engine, probe) for probe in track(probes, "full caches")]  # the same for every policy
    for name in ("elastic", "david"):
        for budget in budgets:
            policy = make_compressor(name, budget)
            kls, fractions, tps_c, tps_f = [], [], [], []
            for past, window_ids, prompt, full_tokens, ref in track(full, f"{name} @ {budget}"):
                c = prefill_compressed(engine, past, window_ids, prompt, policy)
                got = score_continuation(engine, c, policy, full_tokens)
                kls.append(mean([kl(a, b) for a, b in zip(ref, got, strict=True)]))
                fractions.append(c.kv_bytes_fraction)
                params = SamplingParams(max_new_tokens=gen_tokens, eos_token_ids=(-1,))
                c = prefill_compressed(engine, past, window_ids, prompt, policy)
                t0 = time.perf_counter()
                n = len(list(decode_compressed(engine, c, policy, params)))
                tps_c.append(n / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                n = len(
                    list(
                        engine.generate_ids(
                            past, prompt, len(past), SamplingParams(max_new_tokens=gen_tokens, eos_token_ids=(-1,))
                        )
                    )
                )
                tps_f.append(n / (time.perf_counter() - t0))
            out[f"{name}@{budget}"] = {
                "kl_mean": mean(kls),
                "kv_bytes_fraction": mean(fractions),
                "tokens_per_s": mean(tps_c),
                "tokens_per_s_full_cache": mean(tps_f),
            }
    out["elastic"] = out[f"elastic@{budgets[0]}"]
    out["david"] = out[f"david@{budgets[0]}"]
    return out


def run(engine: Engine, *, quick: bool = False) -> dict[str, Any]:
    probes = load_corpus().probes[: 3 if quick else 10]
    err.print(f"[bold]compare[/] on {engine.name}: {len(probes)} probes")
    result: dict[str, Any] = {"model": engine.name}
    result["reuse"] = reuse_policies(engine, probes)
    for name in ("prefix", "blind", "cacheblend", "mpic", "kamera", "recompute"):
        result[name] = result["reuse"][name]
    result["matched_bytes"] = matched_bytes(engine, probes, (8, 16) if quick else (8, 16, 32))
    result["compression"] = compression(engine, probes)  # the same probes as the reuse policies
    result["elastic"] = result["compression"]["elastic"]
    result["david"] = result["compression"]["david"]
    return result

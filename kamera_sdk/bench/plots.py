"""Plots for the docs, drawn from benchmark JSON (``python -m kamera_sdk.bench.plots RESULT.json docs/img``;
operator, window, compare and serve results are told apart by their keys; several ``--shape`` results draw one
speedup-vs-shape figure).

matplotlib is an optional extra (``kamera[plots]``); it is imported lazily.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kamera_engine import InvalidInputError


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise InvalidInputError("plots need matplotlib: pip install 'kamera[plots]'") from exc
    return plt


def operator_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """eta vs rank, and re-prefill / reuse time and speedup vs chunk length."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    ranks = sorted(int(r) for r in result["eta"])
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot(ranks, [result["eta"][str(r)] for r in ranks], "o-", label="eta (gap closed)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.set_xlabel("patch rank m")
    ax.set_ylabel("eta = 1 - KL(patch) / KL(blind)")
    ax.set_title(f"{result['model']}: {result['probes']} multi-hop probes")
    ax.legend(loc="lower right")
    fig.tight_layout()
    paths.append(out_dir / "eta_vs_rank.png")
    fig.savefig(paths[-1], dpi=130)
    plt.close(fig)

    if "partial_reprefill_eta" in result:
        layers = result["num_layers"]
        kept = sorted(int(k) for k in result["partial_reprefill_eta"])
        fig, ax = plt.subplots(figsize=(5, 3.4))
        x = [100 * (layers - k) / layers for k in kept]
        ax.plot(
            x, [result["partial_reprefill_eta"][str(k)] for k in kept], "s-", color="#c96", label="partial re-prefill"
        )
        for xi, k in zip(x, kept, strict=True):
            ax.annotate(
                f"{k} kept",
                (xi, result["partial_reprefill_eta"][str(k)]),
                textcoords="offset points",
                xytext=(-6, 5),
                ha="right",
                fontsize=8,
            )
        ax.set_xlim(min(x) - 12, 103)
        ax.axhline(result["eta"]["32"], color="#369", lw=1.2, ls="--", label="rank-32 patch (no forward at reuse)")
        ax.set_xlabel(f"layers re-prefilled in context (% of {layers}; the forward's cost)")
        ax.set_ylabel("eta = 1 - KL / KL(blind)")
        ax.set_title("keeping the shallow layers of the canonical")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "eta_vs_partial_reprefill.png")
        fig.savefig(paths[-1], dpi=130)
        plt.close(fig)

    lengths = sorted(int(n) for n in result["speed_by_length"])
    rows = [result["speed_by_length"][str(n)] for n in lengths]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot(lengths, [r["reprefill_s"] * 1e3 for r in rows], "o-", label="re-prefill in context")
    ax.plot(lengths, [r["reuse_s"] * 1e3 for r in rows], "s-", label="relocate + rank-32 patch")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("chunk length (tokens)")
    ax.set_ylabel("time to have the chunk's KV (ms)")
    for n, r in zip(lengths, rows, strict=True):
        at = (n, r["reuse_s"] * 1e3)
        ax.annotate(f"{r['speedup']:.0f}x", at, textcoords="offset points", xytext=(0, 8), ha="center", fontsize=9)
    ax.set_title(f"{result['model']} on {result['device']}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    paths.append(out_dir / "speedup_vs_length.png")
    fig.savefig(paths[-1], dpi=130)
    plt.close(fig)
    return paths


def window_plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Mean TTFT (with ingest and window ops stacked on top) and mean KL per policy on the window trace,
    and TTFT per step by step kind."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [p for p in ("recompute", "prefix", "blind", "cacheblend", "mpic", "kamera") if p in result]
    colors = {
        "recompute": "#888",
        "prefix": "#aaa",
        "blind": "#c96",
        "cacheblend": "#db8",
        "mpic": "#6a6",
        "kamera": "#369",
    }
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(12, 3.4), gridspec_kw={"width_ratios": [1, 2, 1]})
    ttft = [result[p]["ttft_s_mean"] for p in names]
    a1.bar(names, ttft, color=[colors[p] for p in names], label="TTFT")
    # off the answer's path: a new page's canonical (ingest), then the window ops' patch forming
    ingest = [result[p].get("ingest_s_mean", 0.0) for p in names]
    ops = [result[p].get("ops_s_mean", 0.0) for p in names]
    a1.bar(names, ingest, bottom=ttft, color=[colors[p] for p in names], alpha=0.45, label="+ ingest")
    top = [t + i for t, i in zip(ttft, ingest, strict=True)]
    a1.bar(names, ops, bottom=top, color="white", edgecolor=[colors[p] for p in names], hatch="///", label="+ ops")
    a1.set_ylabel("mean seconds per step")
    a1.legend(loc="upper right", fontsize=7)
    steps = result["steps"]
    for p in ("prefix", "kamera"):
        if p in names:
            a2.plot(
                [s["step"] for s in steps], [s["ttft_s"][p] for s in steps], marker="o", ms=3, color=colors[p], label=p
            )
    if all("ttft_floor_s" in s for s in steps):
        a2.plot(
            [s["step"] for s in steps],
            [s["ttft_floor_s"] for s in steps],
            ls="--",
            color="#369",
            lw=1,
            label="floor (new pages + prompt)",
        )
    marks = {"first": "F", "recall": "R", "rerank": "S"}
    for s in steps:
        if s.get("kind") in marks:
            a2.annotate(marks[s["kind"]], (s["step"], 0), textcoords="offset points", xytext=(-3, 2), fontsize=7)
    a2.set_xlabel("step (F first, R recall, S rerank; the rest slide)")
    a2.set_ylabel("TTFT (s)")
    highest = max(s["ttft_s"][p] for s in steps for p in ("prefix", "kamera") if p in names)
    a2.set_ylim(0, 1.3 * highest)  # room above the lines for the legend
    a2.legend(loc="upper center", ncol=3, fontsize=8)
    a3.bar(names, [result[p]["kl_mean"] for p in names], color=[colors[p] for p in names])
    a3.set_ylabel("mean next-token KL to recompute")
    for ax in (a1, a3):
        ax.tick_params(axis="x", labelsize=8, labelrotation=20)
    fig.suptitle(f"window trace: {result['trace']['steps']} steps, 4 pages")
    fig.tight_layout()
    path = out_dir / "window_trace.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return [path]


def window_act_plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """The idle-time run (``--act-seconds``): TTFT over the floor per step kind, and KL, per policy."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [p for p in ("recompute", "prefix", "prefix_idle", "kamera_sync", "kamera") if p in result]
    # a repeated run: each step's least TTFT over the passes (the floor is a best of three too)
    key = "ttft_over_floor_by_kind_min"
    if key not in result[names[0]]:
        key = "ttft_over_floor_by_kind"
    kinds = [k for k in ("first", "slide", "recall", "rerank", "all") if k in result[names[0]][key]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.4), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / len(names)
    for i, p in enumerate(names):
        ratios = [result[p][key][k] for k in kinds]
        a1.bar([j + i * width for j in range(len(kinds))], ratios, width, label=p)
    a1.axhline(1.0, color="k", lw=0.8, ls="--")
    a1.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], kinds)
    passes = result.get("repeat", 1)
    a1.set_ylabel("TTFT / floor" if passes == 1 else f"TTFT / floor (least of {passes} passes)")
    a1.legend(fontsize=7)
    a2.bar(names, [max(result[p]["kl_mean"], 1e-9) for p in names])
    a2.set_yscale("log")
    a2.set_ylabel("mean KL to recompute")
    a2.tick_params(axis="x", rotation=45, labelsize=7)
    fig.suptitle(f"window trace with {result['act_seconds']} s of idle time per step, {result['trace']['steps']} steps")
    fig.tight_layout()
    path = out_dir / "window_act.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def compare_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """eta vs KV-byte budget per reuse policy, and KL vs KV kept per compression policy."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    mb = result["matched_bytes"]
    ranks = sorted((k for k in mb if k.isdigit()), key=int)
    fig, ax = plt.subplots(figsize=(5, 3.4))
    x = [100 * mb[r]["token_fraction"] for r in ranks]
    styles = {"kamera": ("#369", "o"), "cacheblend": ("#c96", "s"), "mpic": ("#6a6", "^")}
    for arm, (color, marker) in styles.items():
        ax.plot(x, [mb[r]["eta"][arm] for r in ranks], marker=marker, color=color, label=arm)
    for xi, r in zip(x, ranks, strict=True):
        ax.annotate(f"rank {r}", (xi, mb[r]["eta"]["kamera"]), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.axhline(1.0, color="#999", lw=0.8, ls="--")
    ax.set_xlabel("KV-byte budget per reused chunk (% of its KV)")
    ax.set_ylabel("eta (blind -> re-prefill gap closed)")
    ax.set_title("reuse at matched bytes")
    ax.legend(loc="lower right")
    fig.tight_layout()
    paths.append(out_dir / "eta_vs_bytes.png")
    fig.savefig(paths[-1], dpi=130)
    plt.close(fig)

    comp = result["compression"]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for name, color in (("elastic", "#936"), ("david", "#369")):
        pts = sorted(
            (v["kv_bytes_fraction"], v["kl_mean"])
            for k, v in comp.items()
            if k.startswith(f"{name}@") and isinstance(v, dict)
        )
        ax.plot([100 * p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=name)
    ax.set_xlabel("KV kept (% of the full cache)")
    ax.set_ylabel("mean next-token KL to the full cache")
    ax.set_title("compression along the full cache's answer")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "kl_vs_kv_budget.png")
    fig.savefig(paths[-1], dpi=130)
    plt.close(fig)
    return paths


def shape_plot(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Reuse speedup over re-prefill vs chunk length per shape, and vs model width at 2048 tokens
    (``kamera bench operator --shape NAME`` results; per layer when the shapes are truncated alike)."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = sorted(results, key=lambda r: r["hidden_size"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for r in ordered:
        tokens = sorted(int(t) for t in r["speedup_by_tokens"])
        left.plot(
            tokens, [r["speedup_by_tokens"][str(t)] for t in tokens], "o-", label=f"{r['shape']} ({r['layers']}L)"
        )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("chunk tokens (after 512 tokens of context)")
    left.set_ylabel("re-prefill time / reuse time")
    left.legend(fontsize=8)
    at = [r for r in ordered if "2048" in r["speedup_by_tokens"]]
    right.plot([r["hidden_size"] for r in at], [r["speedup_by_tokens"]["2048"] for r in at], "s-")
    for r in at:
        right.annotate(r["shape"], (r["hidden_size"], r["speedup_by_tokens"]["2048"]), fontsize=7)
    right.set_xlabel("hidden size")
    right.set_ylabel("speedup at 2048 tokens")
    right.set_yscale("log")
    devices = sorted({f"{r['device']} {r['dtype']}" for r in ordered})
    fig.suptitle(f"reuse (relocate + rank-32 patch) vs re-prefill, random weights, {', '.join(devices)}", fontsize=9)
    fig.tight_layout()
    path = out_dir / "speedup_vs_shape.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return [path]


def serve_plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Throughput (tokens/s) and p95 answer latency against concurrent sessions, batched vs one at a time
    (``kamera bench serve --json``)."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = sorted(int(n) for n in result["sessions"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for mode, label in (("batched", "batched (scheduler)"), ("sequential", "one answer at a time")):
        rows = [result["sessions"][str(n)][mode] for n in counts]
        left.plot(counts, [r["tokens_per_s"] for r in rows], "o-", label=label)
        right.plot(counts, [r["p95_s"] for r in rows], "o-", label=label)
    bound = result.get("ceiling", {}).get("round_ratio", {})  # absent in runs before the round ceiling
    if bound:
        shown = [n for n in counts if str(n) in bound]
        left.plot(
            shown,
            [result["sessions"][str(n)]["sequential"]["tokens_per_s"] * bound[str(n)] for n in shown],
            "k:",
            label="one at a time x round ceiling",
        )
    for ax, what in ((left, "answer tokens / s"), (right, "p95 answer latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel(what)
    left.legend(fontsize=8)
    for n in counts:
        left.annotate(
            f"{result['throughput_ratio'][str(n)]:.2f}x",
            (n, result["sessions"][str(n)]["batched"]["tokens_per_s"]),
            fontsize=7,
        )
    fig.suptitle(f"kamera bench serve, {result['model']} on {result['device']}", fontsize=9)
    fig.tight_layout()
    path = out_dir / "serve_vs_sessions.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return [path]


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) < 2:
        print("usage: python -m kamera_sdk.bench.plots RESULT.json [MORE.json ...] OUT_DIR", file=sys.stderr)
        return 2
    results = [json.loads(Path(a).read_text()) for a in args[:-1]]
    out = Path(args[-1])
    if all("speedup_by_tokens" in r for r in results):
        for p in shape_plot(results, out):
            print(p)
        return 0
    if len(results) != 1:
        print("several results are plotted together only for shape sweeps", file=sys.stderr)
        return 2
    result = results[0]
    if "eta" in result:
        paths = operator_plots(result, out)
    elif "throughput_ratio" in result:
        paths = serve_plot(result, out)
    elif "matched_bytes" in result:
        paths = compare_plots(result, out)
    elif "act_seconds" in result:
        paths = window_act_plot(result, out)
    else:
        paths = window_plot(result, out)
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""The tally of every ``kamera bench serve --json --repeat N`` run on file, per host:

    python scripts/serve_tally.py [--sessions 8] [--target 3] [--json] [--plot PNG] [RESULT.json ...]

With no files it reads ``docs/results/serve-cpu-inline*.json`` (the CPU runs of the issue's command, numbered by
the ``-N`` in their names; the first has none and is run 1). Per host: the runs, every pair's throughput ratio
at ``--sessions`` (``runs`` in a result; a run without pairs counts its one reported ratio), their least,
median and largest, how many pairs and how many reported figures (the median pair) reach ``--target``, whether
every pair's batched p95 was at most one at a time's, the reported ratio at 32 sessions, and the pairs' ratio
without the fixed-round loop's drain (``all_running_ratio``, recorded from run 21 on). ``--plot`` draws
the pairs and the reported figure of each run against the target (docs/img/serve_ratio_runs.png).

A result names its host under ``machine`` from run 18 on, and its CPU's family and model numbers (``cpu_id``)
from run 47 on; the hosts of the runs before are those docs/batching.md and docs/serve-runs.md give them (runs 9
to 16 on a 2-core AMD EPYC with AVX-512, run 17 on one with AVX2 only, runs 38 to 46 on an Intel Xeon of family 6
model 207); runs 1 to 8, on earlier code and with one pair each, are grouped apart.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

# Hosts of the runs whose JSON predates the ``machine`` field, as docs/batching.md records them.
_EPYC_512 = "AMD EPYC (AVX512)"
_HOSTS_BEFORE_RECORDING = {**{n: _EPYC_512 for n in range(9, 17)}, 17: "AMD EPYC (AVX2)"}
_EARLY = "runs 1-8 (earlier code, host not recorded)"
# The CPU's family and model of the runs before ``cpu_id`` was recorded, where docs/serve-runs.md gives them.
_CPU_ID_BEFORE_RECORDING = {n: "family 6 model 207" for n in range(38, 47)}


def run_number(path: str | Path) -> int:
    """The run's number from its file name (``serve-cpu-inline-23.json`` is 23; no number is run 1)."""
    found = re.search(r"inline-(\d+)", Path(path).name)
    return int(found.group(1)) if found else 1


def host_of(number: int, result: dict[str, Any]) -> str:
    machine = result.get("machine") or {}
    if machine.get("cpu"):
        cpu = str(machine["cpu"]).replace("(R)", "").replace(" Processor", "").strip()
        cpu_id = machine.get("cpu_id") or _CPU_ID_BEFORE_RECORDING.get(number)
        if cpu_id:  # "family 6 model 207": the model number is what tells two same-named parts apart
            cpu = f"{cpu} model {str(cpu_id).rsplit(' ', 1)[-1]}"
        return f"{cpu} ({machine.get('cpu_capability', '?')})"
    return _HOSTS_BEFORE_RECORDING.get(number, _EARLY)


def _pair(ratio: float, batched_p95_s: float, sequential_p95_s: float, undrained: float | None) -> dict[str, float]:
    pair = {"ratio": float(ratio), "batched_p95_s": float(batched_p95_s), "sequential_p95_s": float(sequential_p95_s)}
    if undrained:
        pair["all_running_ratio"] = float(undrained)
    return pair


def pairs_of(result: dict[str, Any], sessions: str) -> list[dict[str, float]]:
    """Every pair of arms the run timed at ``sessions`` (one made of the reported arms when it kept no pairs)."""
    runs = (result.get("runs") or {}).get(sessions)
    if runs:
        return [
            _pair(p["throughput_ratio"], p["batched_p95_s"], p["sequential_p95_s"], p.get("all_running_ratio"))
            for p in runs
        ]
    arms = (result.get("sessions") or {}).get(sessions)
    if not arms or sessions not in (result.get("throughput_ratio") or {}):
        return []
    ratio = result["throughput_ratio"][sessions]
    return [_pair(ratio, arms["batched"]["p95_s"], arms["sequential"]["p95_s"], None)]


def tally(paths: list[str | Path], sessions: int = 8, target: float = 3.0) -> dict[str, Any]:
    """Per host, in the order hosts first appear by run number: the runs and pairs at ``sessions``."""
    key = str(sessions)
    hosts: dict[str, dict[str, Any]] = {}
    for path in sorted(paths, key=run_number):
        result = json.loads(Path(path).read_text())
        number = run_number(path)
        pairs = pairs_of(result, key)
        if not pairs:
            continue
        host = hosts.setdefault(host_of(number, result), {"runs": []})
        host["runs"].append(
            {
                "run": number,
                "reported": float(result["throughput_ratio"][key]),
                "pairs": [round(p["ratio"], 3) for p in pairs],
                "pairs_without_drain": [round(p["all_running_ratio"], 3) for p in pairs if "all_running_ratio" in p],
                "p95_better": all(p["batched_p95_s"] <= p["sequential_p95_s"] for p in pairs),
                "ratio_32": (result.get("throughput_ratio") or {}).get("32"),
            }
        )
    for host in hosts.values():
        runs = host["runs"]
        ratios = [r for run in runs for r in run["pairs"]]
        at_32 = [run["ratio_32"] for run in runs if run["ratio_32"]]
        undrained = [r for run in runs for r in run["pairs_without_drain"]]
        host.update(
            pairs=len(ratios),
            pair_min=min(ratios),
            pair_median=statistics.median(ratios),
            pair_max=max(ratios),
            pairs_at_target=sum(r >= target for r in ratios),
            reported_at_target=sum(run["reported"] >= target for run in runs),
            reported_min=min(run["reported"] for run in runs),
            p95_better_in_every_pair=all(run["p95_better"] for run in runs),
            ratio_32_min=min(at_32) if at_32 else None,
            ratio_32_max=max(at_32) if at_32 else None,
            pairs_without_drain=len(undrained),
            without_drain_median=statistics.median(undrained) if undrained else None,
            without_drain_min=min(undrained) if undrained else None,
        )
    return {"sessions": sessions, "target": target, "hosts": hosts}


def table(result: dict[str, Any]) -> str:
    """The tally as a Markdown table, a row per host."""
    target = result["target"]
    lines = [
        f"| host | runs | pairs at {result['sessions']} sessions | least / median / largest | pairs at {target:g}x "
        f"| reported at {target:g}x | least reported | p95 better in every pair | at 32 sessions "
        "| without the drain: pairs, least / median |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, h in result["hosts"].items():
        numbers = [run["run"] for run in h["runs"]]
        at_32 = f"{h['ratio_32_min']:.2f} to {h['ratio_32_max']:.2f}x" if h["ratio_32_min"] else "-"
        undrained = (
            f"{h['pairs_without_drain']}, {h['without_drain_min']:.2f} / {h['without_drain_median']:.2f}x"
            if h["pairs_without_drain"]
            else "-"
        )
        lines.append(
            f"| {name} | {len(numbers)} ({_spans(numbers)}) | {h['pairs']} | {h['pair_min']:.2f} / "
            f"{h['pair_median']:.2f} / {h['pair_max']:.2f}x | {h['pairs_at_target']} of {h['pairs']} | "
            f"{h['reported_at_target']} of {len(numbers)} | {h['reported_min']:.2f}x | "
            f"{'yes' if h['p95_better_in_every_pair'] else 'no'} | {at_32} | {undrained} |"
        )
    return "\n".join(lines)


def _spans(numbers: list[int]) -> str:
    spans: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(spans)


def plot(result: dict[str, Any], path: Path) -> Path:
    """Every pair (dots) and each run's reported figure (the median pair, a bar) by run, a colour per host."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.3))
    for colour, (name, h) in zip(["#999", "#c96", "#369", "#693", "#936"], result["hosts"].items(), strict=False):
        xs = [run["run"] for run in h["runs"] for _ in run["pairs"]]
        ys = [r for run in h["runs"] for r in run["pairs"]]
        ax.scatter(xs, ys, s=10, color=colour, alpha=0.55)
        ax.scatter(
            [run["run"] for run in h["runs"]],
            [run["reported"] for run in h["runs"]],
            marker="_",
            s=160,
            color=colour,
            label=f"{name}: median pair {h['pair_median']:.2f}x",
        )
    ax.axhline(result["target"], color="black", lw=0.8, ls="--")
    ax.set_xlabel("run of kamera bench serve --json --repeat 3")
    ax.set_ylabel(f"throughput ratio at {result['sessions']} sessions")
    ax.set_title("batched over one at a time: every pair (dots), the reported median pair (bars)", fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", help="serve results (default: docs/results/serve-cpu-inline*.json)")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--target", type=float, default=3.0)
    parser.add_argument("--json", action="store_true", help="print the tally as JSON instead of a table")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the runs to this PNG")
    args = parser.parse_args(argv)
    kept = Path(__file__).resolve().parent.parent / "docs" / "results"
    paths = args.results or glob.glob(str(kept / "serve-cpu-inline*.json"))
    if not paths:
        parser.error("no serve results found")
    result = tally(paths, sessions=args.sessions, target=args.target)
    if not result["hosts"]:
        parser.error(f"no result has pairs at {args.sessions} sessions")
    print(json.dumps(result, indent=1) if args.json else table(result))
    if args.plot:
        print(f"wrote {plot(result, args.plot)}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""``scripts/serve_tally.py`` tallies ``kamera bench serve --json --repeat N`` results per host: pairs, medians,
how many reach the target, the p95 condition; on results it writes itself, and on the runs kept in docs/results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import script as load_script

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _result(
    pairs: list[tuple[float, float, float]], cpu: str | None, at_32: float = 4.5, cpu_id: str | None = None
) -> dict[str, Any]:
    """A serve result with these (ratio, batched p95, one-at-a-time p95) pairs at 8 sessions, the median reported."""
    runs = [
        {"throughput_ratio": r, "batched_p95_s": b, "sequential_p95_s": s, "all_running_ratio": r * 1.1}
        for r, b, s in pairs
    ]
    reported = sorted(pairs)[len(pairs) // 2]
    out: dict[str, Any] = {
        "throughput_ratio": {"8": reported[0], "32": at_32},
        "sessions": {"8": {"batched": {"p95_s": reported[1]}, "sequential": {"p95_s": reported[2]}}},
        "runs": {"8": runs},
    }
    if cpu:
        out["machine"] = {"cpu": cpu, "cpu_capability": "AVX512"}
        if cpu_id:
            out["machine"]["cpu_id"] = cpu_id
    return out


def _write(tmp_path: Path, number: int, result: dict[str, Any]) -> Path:
    path = tmp_path / f"serve-cpu-inline-{number}.json"
    path.write_text(json.dumps(result))
    return path


def test_pairs_are_tallied_per_host(tmp_path: Path) -> None:
    tally = load_script("serve_tally")
    xeon_cpu = "Intel(R) Xeon(R) Processor"
    paths = [
        _write(tmp_path, 40, _result([(3.2, 4.0, 16.0), (2.9, 4.1, 15.0), (3.5, 3.9, 17.0)], xeon_cpu)),
        _write(tmp_path, 41, _result([(3.1, 4.0, 16.0), (3.3, 20.0, 15.0), (3.0, 3.9, 17.0)], xeon_cpu)),
        _write(tmp_path, 20, _result([(2.8, 4.0, 16.0), (3.0, 4.0, 16.0), (2.7, 4.0, 16.0)], "AMD EPYC", at_32=3.9)),
        # the same name, another part: its family and model recorded
        _write(tmp_path, 47, _result([(2.5, 4.0, 16.0)], xeon_cpu, cpu_id="family 6 model 167")),
    ]
    result = tally.tally(paths, sessions=8, target=3.0)
    # by run number; runs 38-46 recorded no model, and docs/serve-runs.md gives theirs
    xeon_207, xeon_167 = "Intel Xeon model 207 (AVX512)", "Intel Xeon model 167 (AVX512)"
    assert list(result["hosts"]) == ["AMD EPYC (AVX512)", xeon_207, xeon_167]
    assert result["hosts"][xeon_167]["pairs"] == 1
    xeon = result["hosts"][xeon_207]
    assert [run["run"] for run in xeon["runs"]] == [40, 41]
    assert xeon["pairs"] == 6 and xeon["pairs_at_target"] == 5  # 2.9 misses
    assert xeon["pair_min"] == 2.9 and xeon["pair_max"] == 3.5 and xeon["pair_median"] == pytest.approx(3.15)
    assert xeon["reported_at_target"] == 2 and xeon["reported_min"] == 3.1
    assert not xeon["p95_better_in_every_pair"]  # run 41's second pair: 20 s batched against 15 s
    assert xeon["pairs_without_drain"] == 6 and xeon["without_drain_median"] == pytest.approx(3.15 * 1.1)
    epyc = result["hosts"]["AMD EPYC (AVX512)"]
    assert epyc["reported_at_target"] == 0 and epyc["pairs_at_target"] == 1 and epyc["p95_better_in_every_pair"]
    assert epyc["ratio_32_min"] == epyc["ratio_32_max"] == 3.9
    table = tally.table(result)
    assert f"| {xeon_207} | 2 (40-41) | 6 | 2.90 / 3.15 / 3.50x | 5 of 6 | 2 of 2 | 3.10x | no |" in table


def test_a_run_without_pairs_counts_its_reported_arms_and_an_unrecorded_host_is_named_from_the_docs(
    tmp_path: Path,
) -> None:
    tally = load_script("serve_tally")
    single = _result([(3.4, 4.0, 16.0)], None)
    del single["runs"]
    paths = [_write(tmp_path, 3, single), _write(tmp_path, 12, _result([(3.0, 1.0, 2.0)], None))]
    result = tally.tally(paths)
    assert result["hosts"]["AMD EPYC (AVX512)"]["runs"][0]["run"] == 12  # runs 9-16: the host docs/batching.md names
    early = next(h for name, h in result["hosts"].items() if name.startswith("runs 1-8"))
    assert early["pairs"] == 1 and early["pair_median"] == 3.4


def test_the_epyc_runs_on_file_give_the_tally_the_docs_quote(capsys: pytest.CaptureFixture[str]) -> None:
    tally = load_script("serve_tally")
    kept = [str(p) for p in RESULTS.glob("serve-cpu-inline*.json") if tally.run_number(p) <= 37]
    tally.main(["--json", *kept])
    hosts = json.loads(capsys.readouterr().out)["hosts"]
    epyc = hosts["AMD EPYC (AVX512)"]  # docs/batching.md, "Where it stands": runs 9-16 and 18-37
    assert len(epyc["runs"]) == 28 and epyc["pairs"] == 86 and epyc["pairs_at_target"] == 56
    assert epyc["reported_at_target"] == 19 and round(epyc["pair_median"], 2) == 3.09
    assert hosts["AMD EPYC (AVX2)"]["runs"][0]["run"] == 17


def test_no_pairs_at_the_count_is_refused(tmp_path: Path) -> None:
    tally = load_script("serve_tally")
    path = _write(tmp_path, 5, _result([(3.0, 1.0, 2.0)], "AMD EPYC"))
    with pytest.raises(SystemExit):
        tally.main([str(path), "--sessions", "16"])

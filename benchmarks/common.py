"""Launcher-side helpers of the benchmarks: mpirun jobs, statistics, goal checks (no TF, no MPI).

Example::

    result = launch(2, "bench_p2p", "worker", {"sizes": [262144]}, timeout=300)
    median([3.0, 1.0, 2.0])                       # 2.0
    ratio_summary([1.0, 1.1, 0.9])                # {"median": 1.0, "q1": ..., "q3": ..., "n": 3}

[Note: measuring on a shared machine] The benchmark machine has 2 cores shared with other jobs,
so absolute times drift by tens of percent within a minute. Every figure is therefore a ratio of
two things measured side by side in one process group, alternated A B A B … in rounds. Within a
round an arm runs a few steps and keeps its fastest (the step least disturbed by other jobs, as
`timeit` advises); the figure is the median over rounds of the per-round ratio, and the quartiles
over rounds say how noisy it was.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "REPO_ROOT",
    "BenchError",
    "launch",
    "median",
    "ratio_summary",
    "single_thread_env",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "BENCH_JSON "
_TAGGED = re.compile(r"^\[\d+,(\d+)\]<(stdout|stderr)>: ?(.*)$")


class BenchError(RuntimeError):
    """A benchmark job failed or timed out; the message holds the end of its output."""


def median(values: Sequence[float]) -> float:
    """The median (NaN for no values)."""
    return float(statistics.median(values)) if values else float("nan")


def ratio_summary(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and count of a list of per-round ratios (or times)."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return {"median": float("nan"), "q1": float("nan"), "q3": float("nan"), "n": 0}
    if len(vals) == 1:
        return {"median": vals[0], "q1": vals[0], "q3": vals[0], "n": 1}
    q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return {"median": median(vals), "q1": q1, "q3": q3, "n": len(vals)}


def single_thread_env(threads: int = 1) -> dict[str, str]:
    """Environment that caps TensorFlow and OpenMP at ``threads`` threads per process."""
    n = str(threads)
    return {"TF_NUM_INTRAOP_THREADS": n, "TF_NUM_INTEROP_THREADS": n, "OMP_NUM_THREADS": n,
            "TFSMP_BENCH_THREADS": n}


def _job_env(threads: int, extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(single_thread_env(threads))
    env.update({
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        # A rank blocked in MPI yields its core instead of spinning: the other rank may need it.
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    for key in ("SM_HP_MP_PARAMETERS", "TFSMP_CONFIG", "TFSMP_TRACE"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def launch(np: int, module: str, func: str, args: Mapping[str, Any], *, timeout: float = 600.0,
           threads: int = 1, env: Mapping[str, str] | None = None,
           memory_per_rank: int | None = None) -> dict[str, Any]:
    """Runs ``benchmarks.<module>.<func>(args)`` on ``np`` MPI ranks; returns rank 0's result.

    Args:
        np: number of ranks (oversubscribed beyond the host's cores).
        module: a module of the ``benchmarks`` package.
        func: the function every rank calls with ``args``; rank 0's return value is the result.
        args: JSON-serializable arguments.
        timeout: seconds before the whole job is killed.
        threads: TensorFlow intra-/inter-op threads per rank.
        env: extra environment variables.
        memory_per_rank: run every rank in a memory cgroup of this many bytes, as
            ``tfsmp run --memory-per-rank`` does (`tfsmp.launch.memcap`).

    Returns:
        The dict rank 0's function returned, plus ``"job_seconds"``.

    Raises:
        BenchError: the job failed, timed out, or rank 0 printed no result.
    """
    from tfsmp.launch.mpirun import build_mpirun_command, find_mpirun, fresh_session, job_tmpdir

    prefix: list[str] = []
    if memory_per_rank is not None:
        from tfsmp.launch.memcap import rank_prefix

        prefix = rank_prefix(memory_per_rank, f"bench-{os.getpid()}-{time.monotonic_ns()}")
    argv = build_mpirun_command(np, ["-m", "benchmarks.worker", module, func, json.dumps(dict(args))],
                                mpirun=find_mpirun(), rank_prefix=prefix)
    start = time.monotonic()
    job_env = _job_env(threads, env)
    with job_tmpdir() as tmp:  # [Note: a job's temp folder] in tfsmp/launch/mpirun.py
        if "TMPDIR" not in (env or {}):
            job_env["TMPDIR"] = tmp
        proc = subprocess.Popen(fresh_session(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=job_env, cwd=REPO_ROOT, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            raise BenchError(f"{module}.{func} on {np} ranks exceeded {timeout:.0f} s and was "
                             f"killed.\n{_tail(out, err)}") from None
    result = _rank0_result(out)
    if proc.returncode != 0 or result is None:
        raise BenchError(f"{module}.{func} on {np} ranks failed (exit code {proc.returncode}).\n"
                         f"{_tail(out, err)}")
    result["job_seconds"] = round(time.monotonic() - start, 1)
    return result


def _rank0_result(out: str) -> dict[str, Any] | None:
    for line in out.splitlines():
        m = _TAGGED.match(line)
        text = m.group(3) if m else line
        if (m is None or m.group(1) == "0") and text.startswith(RESULT_PREFIX):
            parsed: dict[str, Any] = json.loads(text[len(RESULT_PREFIX):])
            return parsed
    return None


def _tail(out: str, err: str, limit: int = 4000) -> str:
    text = f"--- stdout ---\n{out}\n--- stderr ---\n{err}"
    return text if len(text) <= limit else "...\n" + text[-limit:]


def side_by_side(label: str, times: Mapping[str, Sequence[float]], base: str, other: str) -> str:
    """One line: each arm's median step and the median [quartiles] of ``other`` / ``base`` over
    the rounds (> 1: ``base`` is faster)."""
    s = ratio_summary([b / a for a, b in zip(times[base], times[other])])
    return (f"{label}: {base} {median(times[base]):.3f} s, {other} {median(times[other]):.3f} s; "
            f"{other} / {base} {s['median']:.3f} [{s['q1']:.3f}, {s['q3']:.3f}] over "
            f"{s['n']} rounds")

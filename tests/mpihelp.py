"""Launch multi-rank jobs from pytest: hard timeouts, per-rank output, many cases per launch.

Every TF process costs ~5 s to start on the test machines, so a multi-process test should not be
one launch per assertion. The pattern is "many cases per launch":

1. Write a case module (e.g. ``tests/mpi/scripts/cases_runtime.py``) with plain functions that
   take a context and return something JSON-serializable::

       import tfsmp as smp

       def setup(ctx):                      # optional, runs once per rank before the cases
           smp.init()                       # the config arrives as SM_HP_MP_PARAMETERS

       def case_allgather(ctx):
           return smp.allgather(smp.rank())

       def teardown(ctx):                   # optional, runs once after the cases
           smp.shutdown()

   `ctx` is a `cases_runner.CaseContext`: `ctx.rank`, `ctx.size` (COMM_WORLD), `ctx.world`
   (mpi4py COMM_WORLD), `ctx.store` (a dict kept across cases on this rank, e.g. a model built
   in `setup`), `ctx.case` (the running case's name).

2. In the test, launch it once and assert per case and rank::

       results = run_cases(4, SCRIPTS / "cases_runtime.py", ["case_allgather"],
                           config={"partitions": 2})
       assert_ok(results)                                   # every case ok on every rank
       assert results["case_allgather"][3]["result"] == [0, 1, 2, 3]

`tests/mpi/cases_runner.py` imports the module on every rank, runs `setup`, then each named case
in the given order, and prints one JSON line per case and rank:
``{"case": ..., "rank": ..., "ok": bool, "result": ..., "error": traceback or null,
"seconds": float}``. A case that raises is reported and the next case runs (unless the failure
left MPI unusable, e.g. a half-matched collective: then the launch times out and the test fails
with everyone's output). After each case the runner waits on a COMM_WORLD barrier so that
cases do not overlap. A missing line is an error that names the case and rank.

`run_mpi` is the lower-level call: it launches any script with `mpirun` (`python -m mpi4py` by
default, or plain `python` with `mpi4py_module=False`), `tfsmp run`, or `horovodrun`, in its own
process group, kills the whole group on timeout, and raises `MpiTimeout` (an AssertionError)
with the output collected so far. Pytest therefore never hangs on a deadlocked job.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfsmp.launch.mpirun import (
    TAG_OUTPUT_PATTERN,
    build_mpirun_command,
    find_mpirun,
    fresh_session,
    job_tmpdir,
    launcher_never_started,
)

__all__ = ["FULL", "REPO_ROOT", "SCRIPTS", "MpiTimeout", "Result", "assert_ok", "base_env",
           "case_results", "horovodrun_path", "run_cases", "run_mpi", "with_full"]

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "tests" / "mpi" / "scripts"
CASES_RUNNER = REPO_ROOT / "tests" / "mpi" / "cases_runner.py"

# The slow cases CI adds (`.ci/run` sets TFSMP_FULL_TESTS=1). A test of such a case is marked
# `full` (tests/conftest.py skips it otherwise); a launch of many cases takes its full-only
# cases from `with_full`, so the default run launches only what its tests read.
FULL = os.environ.get("TFSMP_FULL_TESTS") == "1"


def with_full(default: Sequence[str], full_only: Sequence[str]) -> list[str]:
    """The cases one launch runs: ``default``, and ``full_only`` too when `FULL`."""
    return [*default, *full_only] if FULL else list(default)

_TAGGED = re.compile(TAG_OUTPUT_PATTERN)
_RANK_PREFIX = re.compile(r"^\[rank (\d+)\b")   # tfsmp's failure tag, `[rank 3 | pp_rank 1]`


class MpiTimeout(AssertionError):
    """A launched job exceeded its timeout; its process group was killed."""


@dataclass
class Result:
    """A finished job. `ranks[r]` is rank r's stdout, `rank_stderr[r]` its stderr."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    elapsed: float
    ranks: dict[int, str] = field(default_factory=dict)
    rank_stderr: dict[int, str] = field(default_factory=dict)

    def json_lines(self, rank: int) -> list[dict[str, Any]]:
        """Rank's stdout lines that are JSON objects."""
        return [json.loads(line) for line in self.ranks.get(rank, "").splitlines()
                if line.startswith("{") and line.rstrip().endswith("}")]

    def describe(self, limit: int = 6000) -> str:
        """The command, exit code, time and (the end of) both streams, for failure messages."""
        text = (f"$ {' '.join(self.argv)}\nexit code {self.returncode} after "
                f"{self.elapsed:.1f} s\n--- stdout ---\n{self.stdout}\n--- stderr ---\n"
                f"{self.stderr}")
        return text if len(text) <= limit else "...\n" + text[-limit:]


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ plus thread caps, quiet TF and the Open MPI root/idle settings."""
    env = dict(os.environ)
    env.update({
        # Two inter-op threads: a step called inside a tf.function runs the pipeline in a
        # tf.py_function, whose nested stage functions need a second inter-op thread.
        "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2", "OMP_NUM_THREADS": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        # Equality tests compare different batch sizes (microbatch vs batch); oneDNN's kernels
        # round differently per batch size, enough for a max-pool to pick another pixel.
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        # Oversubscribed ranks busy-poll in blocking waits; yielding keeps 8 ranks on 2 cores fast.
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "PYTHONUNBUFFERED": "1",
        # a timed-out job's ranks get SIGABRT first: every thread's Python stack is printed
        "PYTHONFAULTHANDLER": "1",
    })
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    for key in ("SM_HP_MP_PARAMETERS", "TFSMP_CONFIG"):  # never inherit a config by accident
        env.pop(key, None)
    env.update(extra or {})
    return env


def horovodrun_path() -> str:
    """The horovodrun beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "horovodrun"
    return str(beside) if beside.is_file() else (shutil.which("horovodrun") or "horovodrun")


def _command(np: int, argv: Sequence[str], config: Mapping[str, Any] | None, launcher: str,
             mpi4py_module: bool) -> list[str]:
    config_json = json.dumps(dict(config)) if config is not None else None
    if launcher == "mpirun":
        return build_mpirun_command(np, list(argv), config_json=config_json,
                                    use_mpi4py_module=mpi4py_module, mpirun=find_mpirun())
    if launcher == "tfsmp":
        extra = ["--config", config_json] if config_json else []
        return [sys.executable, "-m", "tfsmp", "run", "-np", str(np), *extra, *argv]
    if launcher == "horovodrun":
        # The Open MPI 5 wheel rejects horovodrun's default single-dash binding flags.
        python = [sys.executable, "-m", "mpi4py"] if mpi4py_module else [sys.executable]
        return [horovodrun_path(), "-np", str(np), "--binding-args=--bind-to none --map-by slot",
                *python, *argv]
    raise ValueError(f"launcher must be mpirun, tfsmp or horovodrun. Received: {launcher!r}")


def _split_ranks(text: str, result: dict[int, list[str]], prefixed: bool) -> None:
    """Files `--tag-output` lines (and, if `prefixed`, `[rank R ...` lines) under result[R]."""
    for line in text.splitlines():
        m = _TAGGED.match(line)
        if m:
            result.setdefault(int(m.group(1)), []).append(m.group(3))
            continue
        m = _RANK_PREFIX.match(line) if prefixed else None
        if m:
            result.setdefault(int(m.group(1)), []).append(line)


LAUNCH_ATTEMPTS = 3  # [Note: launcher start-up failures] in tfsmp/launch/mpirun.py


def run_mpi(np: int, argv: Sequence[str | os.PathLike[str]], *,
            config: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
            timeout: float = 120.0, launcher: str = "mpirun",
            mpi4py_module: bool = True) -> Result:
    """Runs a job of `np` ranks and returns its output split per rank.

    Args:
        np: Number of ranks.
        argv: The script and its arguments (the launcher adds the Python interpreter).
        config: tfsmp parameters, passed as SM_HP_MP_PARAMETERS (`--config` for "tfsmp").
        env: Extra environment on top of `base_env()`.
        timeout: Hard limit in seconds for the whole job.
        launcher: "mpirun", "tfsmp" (`tfsmp run`) or "horovodrun".
        mpi4py_module: Run `python -m mpi4py script` (False: plain `python script`).

    Returns:
        The Result (the caller asserts on `returncode`).

    Raises:
        MpiTimeout: The job did not finish in time (its whole process group was killed).
    """
    cmd = _command(np, [str(a) for a in argv], config, launcher, mpi4py_module)
    job_env = base_env(env)
    if launcher == "horovodrun" and config is not None:  # horovodrun forwards the environment
        job_env["SM_HP_MP_PARAMETERS"] = json.dumps(dict(config))
    with contextlib.suppress(ValueError, OSError):  # ranks inherit it: no core files from
        resource.setrlimit(  # `_stacks_then_kill`'s aborts
            resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with contextlib.ExitStack() as job:
        if "TMPDIR" not in (env or {}):  # what killed ranks leave goes with the job
            job_env["TMPDIR"] = job.enter_context(job_tmpdir())  # [Note: a job's temp folder]
        for attempt in range(LAUNCH_ATTEMPTS):
            start = time.monotonic()
            proc = subprocess.Popen(fresh_session(cmd), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=job_env,
                                    cwd=REPO_ROOT, start_new_session=True)
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                out, err = _stacks_then_kill(proc)
                partial = Result(cmd, -9, out or "", err or "", time.monotonic() - start)
                raise MpiTimeout(f"job exceeded its {timeout:.0f} s timeout and was killed\n"
                                 f"{partial.describe()}") from None
            if not launcher_never_started(proc.returncode, err, out):
                break
            print(f"mpihelp: the launcher failed before starting any rank (attempt {attempt + 1} "
                  f"of {LAUNCH_ATTEMPTS}); retrying:\n{err.strip()}", file=sys.stderr)
            time.sleep(0.5 * (attempt + 1))
    stdout_ranks: dict[int, list[str]] = {}
    stderr_ranks: dict[int, list[str]] = {}
    _split_ranks(out, stdout_ranks, prefixed=False)
    _split_ranks(err, stderr_ranks, prefixed=True)
    return Result(
        cmd, proc.returncode, out, err, time.monotonic() - start,
        ranks={r: "\n".join(lines) + "\n" for r, lines in sorted(stdout_ranks.items())},
        rank_stderr={r: "\n".join(lines) + "\n" for r, lines in sorted(stderr_ranks.items())})


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc), including ones in other process groups:
    Open MPI's prterun gives each rank a process group of its own."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stacks_then_kill(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """A timed-out job's output, with where every rank was: its ranks get SIGABRT, which
    Python's fault handler (PYTHONFAULTHANDLER in `base_env`) answers by printing every
    thread's stack; mpirun passes that on, then the whole group is killed. A test timeout then
    shows where the job hung, as tfsmp's watchdog would after its (longer) stall timeout."""
    for pid in _descendants(proc.pid):
        with contextlib.suppress(OSError):
            if b"python" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]:
                os.kill(pid, signal.SIGABRT)
    try:
        return proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return proc.communicate()
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kills the launcher and every rank under it, so a timed-out job leaves nothing behind."""
    victims = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def run_cases(np: int, module_path: str | os.PathLike[str], case_names: Iterable[str], *,
              config: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
              timeout: float = 180.0,
              launcher: str = "mpirun") -> dict[str, dict[int, dict[str, Any]]]:
    """Runs named case functions of one module on every rank, in one launch.

    Args:
        np: Number of ranks.
        module_path: The case module (a .py file).
        case_names: Functions of that module to run, in order.
        config: tfsmp parameters for the job (SM_HP_MP_PARAMETERS).
        env: Extra environment.
        timeout: Hard limit in seconds for the whole launch.
        launcher: As in `run_mpi`.

    Returns:
        results[case][rank] -> {"case", "rank", "ok", "result", "error", "seconds"}.

    Raises:
        AssertionError: The job failed, timed out, or a case did not report on some rank.
    """
    names = list(case_names)
    res = run_mpi(np, [CASES_RUNNER, module_path, *names], config=config, env=env,
                  timeout=timeout, launcher=launcher)
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    for rank in range(np):
        for rec in res.json_lines(rank):
            if rec.get("case") in results:
                results[rec["case"]][rank] = rec
    missing = [f"{n}@rank{r}" for n in names for r in range(np) if r not in results[n]]
    if res.returncode != 0 or missing:
        raise AssertionError(f"case launch failed (missing reports: {missing or 'none'})\n"
                             f"{res.describe()}")
    return results


def assert_ok(results: Mapping[str, Mapping[int, Mapping[str, Any]]],
              cases: Iterable[str] | None = None) -> None:
    """Fails listing every (case, rank) that raised, with its traceback."""
    chosen = list(results) if cases is None else list(cases)
    errors = [f"--- {case} on rank {rank} ---\n{rec.get('error')}"
              for case in chosen for rank, rec in sorted(results[case].items()) if not rec["ok"]]
    if errors:
        raise AssertionError("cases failed:\n" + "\n".join(errors))


def case_results(results: Mapping[str, Mapping[int, Mapping[str, Any]]], case: str) -> list[Any]:
    """What ``case`` returned on each rank, in rank order, once it is ok on every rank."""
    assert_ok(results, [case])
    return [rec["result"] for _, rec in sorted(results[case].items())]

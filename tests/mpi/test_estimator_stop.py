"""The estimator owns its job too ([Note: the launcher owns its job] in tfsmp/launch/ownjob.py):
`job.stop()` (and `max_run`) kill every rank, not only mpirun, which Open MPI 5 gives a process
group of its own per rank; a SIGTERM to the Python process waiting in `fit` stops the job as
Ctrl-C does. The job's script sleeps; its path, unique to the test, finds any survivor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
from mpihelp import REPO_ROOT, base_env

pytestmark = pytest.mark.mpi

SCRIPT = """
import os, time
from mpi4py import MPI
open(os.path.join(os.environ["READY_DIR"], f"ready-{MPI.COMM_WORLD.rank}"), "w").close()
time.sleep(120)
"""

FIT = """
import sys, warnings
from tfsmp.estimator import LOCAL_ROLE, TensorFlow
warnings.simplefilter("ignore")
src, jobs, ready = sys.argv[1:4]
est = TensorFlow(entry_point="sleeper.py", source_dir=src, role=LOCAL_ROLE, instance_count=1,
                 instance_type="local", framework_version="2.21", py_version="py311",
                 distribution={"mpi": {"enabled": True, "processes_per_host": 2}},
                 output_path=jobs, environment={"READY_DIR": ready,
                                                "OMPI_MCA_mpi_yield_when_idle": "1"})
est.fit(wait=True, logs=False, job_name="sleeper")
"""


def _with(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if text.encode() in cmdline and state != "Z":
                found.append(int(entry))
    return found


def _gone(text: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _with(text)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    src, ready = tmp_path / "src", tmp_path / "ready"
    src.mkdir()
    ready.mkdir()
    (src / "sleeper.py").write_text(SCRIPT)
    return src, ready


def _wait_ready(ready: Path, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + 90
    while len(list(ready.iterdir())) < 2:
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)


def test_stop_kills_every_rank(tmp_path: Path) -> None:
    from tfsmp.estimator import LOCAL_ROLE, TensorFlow

    src, ready = _setup(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = TensorFlow(entry_point="sleeper.py", source_dir=str(src), role=LOCAL_ROLE,
                         instance_count=1, instance_type="local", framework_version="2.21",
                         py_version="py311",
                         distribution={"mpi": {"enabled": True, "processes_per_host": 2}},
                         output_path=str(tmp_path / "jobs"),
                         environment={"READY_DIR": str(ready)})
    est.fit(wait=False, logs=False, job_name="sleeper")
    job = est.latest_training_job
    assert job is not None
    try:
        _wait_ready(ready)
        t0 = time.monotonic()
        job.stop()
        left = _gone(str(src), 10)
        took = time.monotonic() - t0
    finally:
        for pid in _with(str(src)):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks outlived job.stop(): {left}"
    print(f"estimator job.stop(): every rank gone {took:.2f} s later")


def test_sigterm_to_the_waiting_process_stops_the_job(tmp_path: Path) -> None:
    src, ready = _setup(tmp_path)
    fit = tmp_path / "fit.py"
    fit.write_text(textwrap.dedent(FIT))
    proc = subprocess.Popen([sys.executable, str(fit), str(src), str(tmp_path / "jobs"),
                             str(ready)], env=base_env(), cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_ready(ready, proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
        left = _gone(str(src), 10)
        took = time.monotonic() - t0
    finally:
        for pid in _with(str(src)):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    assert not left, f"ranks outlived the estimator's process: {left}\n{out[-3000:]}"
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    status = (tmp_path / "jobs" / "sleeper" / "job.json").read_text()
    assert '"TrainingJobStatus": "Stopped"' in status, status
    print(f"estimator, SIGTERM to the waiting process: job stopped in {took:.2f} s")

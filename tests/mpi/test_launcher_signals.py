"""The launcher owns its job ([Note: the launcher owns its job] in tfsmp/launch/ownjob.py).

A stop signal (SIGTERM, SIGINT, SIGHUP) to `tfsmp run`, with or without `--max-restarts`, ends
the whole job within a bound, and no process of the job is left; so does the death of the
launcher itself, and so does a job that ends by itself leaving a process behind. Plain `mpirun`
is measured as the reference (Open MPI kills its own job on those signals). The job is
tests/mpi/scripts/launch_wait.py (no TensorFlow: a launch takes about a second); every process of
it carries a unique marker in its command line, which is how the test looks for survivors.

`python -m pytest -s tests/mpi/test_launcher_signals.py` prints each measured time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.mpihelp import SCRIPTS, base_env, horovodrun_path
from tfsmp.launch.mpirun import build_mpirun_command, find_mpirun

JOB = SCRIPTS / "launch_wait.py"
START_TIMEOUT = 60.0   # s for two ranks to be up (a busy machine)
STOP_BOUND = 10.0      # s from the signal to the end of the job (measured: well under 1 s)


def _with_marker(marker: str) -> list[int]:
    """Every live process whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def _kill_all(marker: str) -> None:
    for pid in _with_marker(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_ready(out: Path, proc: subprocess.Popen[bytes], ranks: int = 2) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while len(list(out.glob("ready-*"))) < ranks:
        assert proc.poll() is None, f"the job ended before it was ready: {proc.returncode}"
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)


def _wait_gone(marker: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _start(launcher: list[str], mode: str, out: Path, marker: str) -> subprocess.Popen[bytes]:
    # a temp folder inside the test's: the sources autograph writes and never deletes when a
    # rank is killed stay there, not in /tmp ([Note: a job's temp folder] in
    # tfsmp/launch/mpirun.py; horovodrun makes no job folder of its own)
    tmp = out / "tmp"
    tmp.mkdir(exist_ok=True)
    return subprocess.Popen([*launcher, str(JOB), mode, str(out), marker],
                            env=base_env({"TMPDIR": str(tmp)}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_as_from_a_terminal)


def _as_from_a_terminal() -> None:
    """The launcher starts with the stop signals at their defaults, as a terminal starts it.
    A test run under `nohup` (or a CI service) ignores SIGHUP, and an ignored signal stays
    ignored across exec: horovodrun's `sh -c mpirun` then ignores the SIGHUP the test sends
    (as `nohup horovodrun ...` means it to), and the job rightly runs on."""
    for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def _stop(proc: subprocess.Popen[bytes], signum: int, marker: str,
          bound: float = STOP_BOUND) -> tuple[float, int, str]:
    """Signals the launcher; returns (seconds to the job's end, exit code, stderr)."""
    t0 = time.monotonic()
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=bound + 30)
        left = _wait_gone(marker, max(0.0, bound - (time.monotonic() - t0)))
        took = time.monotonic() - t0
    finally:
        _kill_all(marker)
        if proc.poll() is None:
            proc.kill()
    text = err.decode(errors="replace")
    assert not left, f"processes of the job outlived the launcher: {left}\n{text[-3000:]}"
    assert took <= bound, f"the job took {took:.1f} s to stop (bound {bound} s)\n{text[-3000:]}"
    return took, proc.returncode, text


TFSMP = [sys.executable, "-m", "tfsmp", "run", "-np", "2"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_tfsmp_run_stops_its_whole_job(tmp_path: Path, signum: int) -> None:
    marker = f"tfsmp-test-{uuid.uuid4().hex}"
    proc = _start(TFSMP, "sleep", tmp_path, marker)
    _wait_ready(tmp_path, proc)
    took, code, err = _stop(proc, signum, marker)
    assert code != 0, err
    assert f"{signal.Signals(signum).name}: stopping the job" in err, err
    assert "no process of it is left" in err, err
    assert "exited on" not in err, err  # mpirun's box per stopped rank is expected: dropped
    print(f"tfsmp run, {signal.Signals(signum).name}: the job ended {took:.2f} s after the signal")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_max_restarts_stop_is_a_preemption(tmp_path: Path, signum: int) -> None:
    """Ranks that keep a backup write it and exit 75; the launcher exits 75, no relaunch."""
    marker = f"tfsmp-test-{uuid.uuid4().hex}"
    proc = _start([*TFSMP, "--max-restarts", "2"], "preempt", tmp_path, marker)
    _wait_ready(tmp_path, proc)
    took, code, err = _stop(proc, signum, marker)
    assert code == 75, err
    assert sorted(p.name for p in tmp_path.glob("backup-*")) == ["backup-0", "backup-1"], err
    assert "restart 1" not in err, err
    print(f"tfsmp run --max-restarts, {signal.Signals(signum).name}: backups written, job ended "
          f"{took:.2f} s after the signal")


def test_plain_run_stop_is_a_preemption_too(tmp_path: Path) -> None:
    marker = f"tfsmp-test-{uuid.uuid4().hex}"
    proc = _start(TFSMP, "preempt", tmp_path, marker)
    _wait_ready(tmp_path, proc)
    _, code, err = _stop(proc, signal.SIGINT, marker)
    assert code == 75, err
    assert len(list(tmp_path.glob("backup-*"))) == 2, err


def test_ranks_that_ignore_signals_are_killed_after_the_grace(tmp_path: Path) -> None:
    marker = f"tfsmp-test-{uuid.uuid4().hex}"
    proc = _start([*TFSMP, "--stop-grace", "1"], "stubborn", tmp_path, marker)
    _wait_ready(tmp_path, proc)
    took, code, err = _stop(proc, signal.SIGTERM, marker, bound=1 + 5 + STOP_BOUND)
    assert code != 0, err
    print(f"tfsmp run --stop-grace 1, ranks ignoring signals: killed {took:.2f} s after SIGTERM")


def test_a_second_signal_does_not_wait_for_the_grace(tmp_path: Path) -> None:
    marker = f"tfsmp-test-{uuid.uuid4().hex}"
    proc = _start([*TFSMP, "--stop-grace", "600"], "stubborn", tmp_path, marker)
    _wait_ready(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    _stop(proc, signal.SIGTERM, marker)


def test_a_killed_launcher_takes_its_job_along(tmp_path: Path) -> None:
    marker = f"tfsmp-test-{uuid.uuid4().hex}"
    proc = _start(TFSMP, "sleep", tmp_path, marker)
    _wait_ready(tmp_path, proc)
    took, _, _ = _stop(proc, signal.SIGKILL, marker)
    print(f"tfsmp run SIGKILLed: the job ended {took:.2f} s later")


def test_what_a_job_leaves_behind_does_not_outlive_the_launcher(tmp_path: Path) -> None:
    marker = f"tfsmp-test-{uuid.uuid4().hex}"
    proc = _start(TFSMP, "orphan", tmp_path, marker)
    try:
        _, err = proc.communicate(timeout=START_TIMEOUT)
        left = _wait_gone(marker, 2.0)
    finally:
        _kill_all(marker)
    assert proc.returncode == 0, err
    assert len(list(tmp_path.glob("ready-*"))) == 2
    assert not left, f"a process the job started outlived it: {left}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_plain_mpirun_stops_its_job(tmp_path: Path, signum: int) -> None:
    """The reference: Open MPI 5's mpirun kills its ranks on each of these itself."""
    marker = f"tfsmp-test-{uuid.uuid4().hex}"
    argv = build_mpirun_command(2, ["-c", "pass"], mpirun=find_mpirun(), tag_output=False,
                                use_mpi4py_module=False)[:-2]
    proc = _start(argv, "sleep", tmp_path, marker)
    _wait_ready(tmp_path, proc)
    took, _code, _ = _stop(proc, signum, marker)
    print(f"mpirun, {signal.Signals(signum).name}: the job ended {took:.2f} s after the signal")


# [Note: a launcher that leaves its job] horovodrun execs `sh -c "mpirun ..."`: that shell dies
# on SIGTERM/SIGHUP and leaves mpirun and the ranks running; ranks past tfsmp.init() watch it.
HOROVODRUN = [horovodrun_path(), "-np", "2", "--binding-args=--bind-to none --map-by slot",
              sys.executable]
HOROVOD_START = 120.0  # horovodrun imports TensorFlow before it starts mpirun


def _horovod_ready(out: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + HOROVOD_START
    while len(list(out.glob("ready-*"))) < 2:
        assert proc.poll() is None, f"the job ended before it was ready: {proc.returncode}"
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)


@pytest.mark.skipif(not Path(horovodrun_path()).is_file(), reason="horovodrun is not installed")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stopped_horovodrun_takes_its_job_along(tmp_path: Path, signum: int) -> None:
    marker = f"tfsmp-test-{uuid.uuid4().hex}"
    proc = _start(HOROVODRUN, "init", tmp_path, marker)
    _horovod_ready(tmp_path, proc)
    took, _, _ = _stop(proc, signum, marker)
    print(f"horovodrun, {signal.Signals(signum).name}: the job ended {took:.2f} s after the signal")


@pytest.mark.skipif(not Path(horovodrun_path()).is_file(), reason="horovodrun is not installed")
def test_a_stopped_horovodrun_job_writes_its_backups_first(tmp_path: Path) -> None:
    marker = f"tfsmp-test-{uuid.uuid4().hex}"
    proc = _start(HOROVODRUN, "init-preempt", tmp_path, marker)
    _horovod_ready(tmp_path, proc)
    _stop(proc, signal.SIGTERM, marker)
    assert sorted(p.name for p in tmp_path.glob("backup-*")) == ["backup-0", "backup-1"]


def test_an_mpirun_not_run_by_a_shell_is_not_watched(tmp_path: Path) -> None:
    # the rule's other side: a plain `mpirun` (a terminal, a batch script) is never acted on
    from tfsmp.comm.launcher_watch import find_launcher_shell

    assert find_launcher_shell() is None  # pytest's own process: no mpirun above it

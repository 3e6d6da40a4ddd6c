"""A launcher killed by SIGKILL leaves Open MPI's session folder behind; the next launcher that
gets its pid must still start ([Note: launcher start-up failures] in tfsmp/launch/mpirun.py).

The stale folders are planted under every pid the next launches can get (every free one) (a private TMPDIR, so
no other job sees them): plain `mpirun` then dies before any rank exists (the failure CI met),
and `tfsmp run` and `fresh_session` start normally, sweeping every dead launcher's folder (a
live one's stays). No TensorFlow: each launch takes a second.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpihelp import REPO_ROOT, base_env
from tfsmp.launch.mpirun import find_mpirun, fresh_session, launcher_never_started


def _plant(tmp: Path) -> set[int]:
    """Stale session folders, as a killed launcher leaves them, under every free pid."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    if top > 1 << 16:
        pytest.skip(f"pid_max is {top}: too many pids to plant stale folders for")
    host = socket.gethostname().split(".")[0]
    pids = {pid for pid in range(2, top) if not os.path.exists(f"/proc/{pid}")}
    for pid in pids:
        folder = tmp / f"ompi.{pid}"
        folder.mkdir()
        (folder / f"pmix.{host}.tool.{pid}").write_text("stale\n")
    return pids


def _run(argv: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=base_env({"TMPDIR": str(tmp)}), cwd=REPO_ROOT, text=True,
                          capture_output=True, timeout=120)


@pytest.mark.timeout(300)
def test_a_stale_session_folder_under_the_launchers_pid_is_removed_before_it_starts(
        tmp_path: Path) -> None:
    planted = _plant(tmp_path)
    plain = _run([find_mpirun(), "-np", "1", "true"], tmp_path)
    # the cause, shown: without the fix the launcher dies before any rank ran
    assert plain.returncode == 213 and launcher_never_started(plain.returncode, plain.stderr), \
        plain.stderr
    fresh = _run(fresh_session([find_mpirun(), "-np", "1", "true"]), tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    (tmp_path / f"ompi.{os.getpid()}").mkdir()  # a live launcher's folder (this process's pid)
    job = _run([sys.executable, "-m", "tfsmp", "run", "-np", "2",
                str(REPO_ROOT / "tests/mpi/scripts/print_ranks.py")], tmp_path)
    assert job.returncode == 0, job.stdout + job.stderr
    assert job.stdout.count('"size": 2') == 2, job.stdout
    left = {int(p.name.split(".")[1]) for p in tmp_path.glob("ompi.*")}
    assert len(planted - left) >= 2  # the launchers' own stale folders were removed
    # `tfsmp run` (TMPDIR is the planted folder in its environment) also swept the dead
    # launchers' folders (all but pids some process held during the sweep), kept the live one's
    assert os.getpid() in left
    assert len(left) < len(planted) // 20, len(left)

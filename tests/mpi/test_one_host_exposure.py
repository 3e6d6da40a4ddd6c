"""A one-host `tfsmp run` job listens on no network port of its ranks ([Note: one-host exposure]
in tfsmp/launch/mpirun.py): its MPI traffic stays in shared memory. Plain `mpirun` with Open MPI's
defaults is the reference: each rank listens on all interfaces. Listening sockets are read from
/proc/net/tcp{,6} and matched to the ranks through their file descriptors (no `ss` needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.mpihelp import SCRIPTS, base_env
from tfsmp.launch.mpirun import build_mpirun_command, find_mpirun

JOB = SCRIPTS / "mpi_ready_wait.py"
_LISTEN = "0A"


def _listening_inodes() -> dict[int, str]:
    """inode -> local address of every listening TCP socket on this machine."""
    found: dict[int, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == _LISTEN:
                    found[int(fields[9])] = fields[1]
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _ranks(marker: str) -> list[int]:
    """The rank processes (Python running the job's script), not the launchers."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if (marker.encode() in argv and os.path.basename(argv[0]).startswith(b"python")
                    and not any(a.startswith(b"tfsmp") for a in argv)):  # not tfsmp run, guard
                pids.append(int(entry))
    return pids


def _rank_listeners(launcher: list[str], tmp_path: Path) -> list[str]:
    marker = f"exposure-test-{uuid.uuid4().hex}"
    proc = subprocess.Popen([*launcher, str(JOB), str(tmp_path), marker], env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready-*"))) < 2:
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
        listening = _listening_inodes()
        ranks = _ranks(marker)
        assert len(ranks) == 2, ranks
        found = [listening[i] for pid in ranks for i in _socket_inodes(pid) if i in listening]
    finally:
        (tmp_path / "done").touch()
        out = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert proc.returncode == 0, out
    return found


def test_a_one_host_tfsmp_run_job_has_no_rank_listening_on_the_network(tmp_path: Path) -> None:
    found = _rank_listeners([sys.executable, "-m", "tfsmp", "run", "-np", "2"], tmp_path)
    assert found == [], f"ranks listen on {found}"


def test_plain_mpirun_ranks_listen_on_all_interfaces(tmp_path: Path) -> None:
    """The reference (and the state before): Open MPI's TCP transport, one port per rank."""
    argv = build_mpirun_command(2, ["-c", "pass"], mpirun=find_mpirun(), tag_output=False,
                                use_mpi4py_module=False)[:-2]
    found = _rank_listeners(argv, tmp_path)
    assert len(found) >= 2, found
    print(f"plain mpirun: the 2 ranks listen on {len(found)} sockets")

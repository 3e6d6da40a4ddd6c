"""Ranks that notice their launcher is gone stop the job, as `tfsmp run` stops it.

Example::

    launcher_watch.start()   # tfsmp.init does this on every rank of an MPI job

[Note: a launcher that leaves its job] `horovodrun` (MPI mode) ends by exec-ing
`/bin/sh -c "mpirun ..."`: the pid a user or a scheduler signals is that shell. On SIGTERM or
SIGHUP the shell dies at once and mpirun, re-parented, keeps every rank running with nobody
reading its output (measured: 3 processes left, for ever). A shell that exists only to run
mpirun dies before mpirun only when it is signalled itself (a parent that dies leaves it
running), so its death means "stop this job". Each rank, at init, walks up from itself to its
mpirun (through tfsmp's rank guard or memory-cap prefix, if any) and, when mpirun's parent is
such a shell, watches that shell from a daemon thread (twice a second, by pid and start time,
so a re-used pid is not mistaken for it). When it is gone, the rank does what `tfsmp run` does
on a stop signal ([Note: the launcher owns its job] in tfsmp/launch/ownjob.py): SIGUSR1 to
itself, so a rank that keeps a backup writes it after its step and exits 75 and any other
rank ends at once; after the stop grace (`TFSMP_STOP_GRACE`, default 30 s) mpirun gets
SIGTERM, which ends whatever is left. Other launchers (`tfsmp run`, `mpirun` from a terminal or
a batch script, ranks on remote hosts under prted) are not watched: they stop their job
themselves or are not shell wrappers.

Pure: the standard library only.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

__all__ = ["find_launcher_shell", "start"]

POLL_SECONDS = 0.5
_MPIRUN_NAMES = ("prterun", "mpirun", "mpiexec", "orterun")
_SHELLS = ("sh", "bash", "dash")
_RUNS_MPIRUN = re.compile(r"\s*(\S*/)?(mpirun|mpiexec|prterun|orterun)(\s|$)")
_started: list[threading.Thread] = []


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(name, parent pid, start time) of a live process; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    name = text[text.find("(") + 1:text.rfind(")")]
    fields = text[text.rfind(")") + 2:].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return name, int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def find_launcher_shell(pid: int | None = None) -> tuple[int, int, int] | None:
    """(shell pid, its start time, mpirun pid) when ``pid``'s mpirun runs under `sh -c mpirun`.

    Args:
        pid: the rank process (default: this one).

    Returns:
        None when the process has no mpirun among its near ancestors (a remote host's rank, no
        MPI launcher), or mpirun's parent is not a shell that only runs mpirun.
    """
    current = os.getpid() if pid is None else pid
    for _ in range(4):  # the rank, a rank guard, a memory-cap prefix, then mpirun
        info = _stat(current)
        if info is None or info[1] <= 1:
            return None
        parent = info[1]
        parent_info = _stat(parent)
        if parent_info is None:
            return None
        if parent_info[0] in _MPIRUN_NAMES:
            shell = parent_info[1]
            shell_info = _stat(shell)
            argv = _cmdline(shell)
            if (shell_info is None or shell <= 1 or len(argv) < 3
                    or os.path.basename(argv[0]) not in _SHELLS or argv[1] != "-c"
                    or not _RUNS_MPIRUN.match(argv[2])):
                return None
            return shell, shell_info[2], parent
        current = parent
    return None


def _grace() -> float:
    try:
        return max(0.0, float(os.environ.get("TFSMP_STOP_GRACE", "30")))
    except ValueError:
        return 30.0


def _alive(pid: int, started: int) -> bool:
    info = _stat(pid)
    return info is not None and info[2] == started


def _watch(shell: int, started: int, mpirun: int, mpirun_started: int) -> None:
    while _alive(shell, started):
        time.sleep(POLL_SECONDS)
    if not _alive(mpirun, mpirun_started):
        return  # the job is ending anyway
    if os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0") == "0":
        sys.stderr.write(
            f"tfsmp: this job's launcher (pid {shell}, `sh -c mpirun ...`, as horovodrun runs "
            "it) is gone, so the job stops as `tfsmp run` stops it: ranks that keep a backup "
            "write it after their step and exit 75, the others end now "
            "([Note: a launcher that leaves its job] in tfsmp/comm/launcher_watch.py).\n")
        sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + _grace()
    while time.monotonic() < deadline and _alive(mpirun, mpirun_started):
        time.sleep(POLL_SECONDS)
    if _alive(mpirun, mpirun_started):
        os.kill(mpirun, signal.SIGTERM)


def start() -> bool:
    """Watches this rank's launcher shell, if it has one; once per process.

    Returns:
        Whether a watch runs (now or from an earlier call).
    """
    if _started:
        return True
    if not os.path.isdir("/proc"):
        return False
    found = find_launcher_shell()
    if found is None:
        return False
    shell, started, mpirun = found
    mpirun_info = _stat(mpirun)
    if mpirun_info is None:
        return False
    thread = threading.Thread(target=_watch, args=(shell, started, mpirun, mpirun_info[2]),
                              name="tfsmp-launcher-watch", daemon=True)
    thread.start()
    _started.append(thread)
    return True

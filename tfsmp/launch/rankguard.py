"""Runs one rank as a child process and, if a signal kills it, names the rank and host at once.

Usage (what `tfsmp run` puts under mpirun for a multi-host launch)::

    mpirun ... python -m tfsmp.launch.rankguard python -m mpi4py train.py

[Note: who died] When a rank is killed by a signal (the OOM killer, `kill -9`), its peers on other
hosts see their TCP sockets close and abort at once, and Open MPI's report then often names a
survivor ("process rank 0 ... on node algo-1 calling abort") instead of the rank that died
(measured on emulated hosts: most runs). The guard is the dead rank's parent, on its host: it sees
the death first-hand and prints `[rank 3] killed by signal 9 (SIGKILL) on host algo-2 ...` before
the job is torn down, then dies of the same signal, so mpirun's exit status is unchanged.
Exceptions need no guard: `tfsmp.failure` names the rank and host before aborting.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from types import FrameType

from tfsmp import relaunch

__all__ = ["die_like", "main", "message", "wait_forwarding"]

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


def message(rank: str, signum: int, host: str, pid: int) -> str:
    """The line the guard prints for a rank killed by `signum`."""
    return (f"[rank {rank}] killed by signal {signum} ({_name(signum)}) on host {host} "
            f"(pid {pid}); the job ends\n")


def wait_forwarding(child: subprocess.Popen[bytes]) -> tuple[int, list[int]]:
    """Waits for a guard's ``child``, forwarding termination signals to it meanwhile; returns its
    exit code and the signals forwarded (a rank killed by one of those was torn down by
    mpirun, not by a fault of its own)."""
    forwarded: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        forwarded.append(signum)
        child.send_signal(signum)

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    return child.wait(), forwarded


def die_like(code: int) -> int:
    """Ends the guard as its child ended: the same exit code, or death by the same signal (so
    mpirun's status is unchanged); returns what to exit with if the signal does not kill."""
    if code >= 0:
        return code
    with contextlib.suppress(OSError, ValueError):  # SIGKILL's disposition cannot be set
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    return 128 - code  # only reached for a signal that does not kill


def main(argv: list[str]) -> int:
    """Runs `argv`, forwards termination signals to it, and reports a death by signal.

    Returns:
        The child's exit code (after a death by signal, the guard kills itself the same way).
    """
    if not argv:
        sys.stderr.write("tfsmp.launch.rankguard: the rank's command must follow. Received: "
                         "nothing. Fix: python -m tfsmp.launch.rankguard python -m mpi4py x.py\n")
        return 2
    child = subprocess.Popen(argv)
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "?"))
    relaunch.record_rank_event("start", rank)  # [Note: lost daemons] in tfsmp/relaunch.py
    code, forwarded = wait_forwarding(child)
    relaunch.record_rank_event("exit", rank, code)
    if code >= 0:
        return code
    if -code in forwarded:  # mpirun tearing the job down: not news, and not this rank's fault
        return 128 - code
    sys.stderr.write(message(rank, -code, socket.gethostname(), child.pid))
    sys.stderr.flush()
    # for a launcher that relaunches the job ([Note: restart records] in tfsmp/relaunch.py)
    relaunch.record_failure(f"rank {rank}", f"killed by signal {-code} ({_name(-code)})",
                            pid=child.pid, rank=rank)
    return die_like(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

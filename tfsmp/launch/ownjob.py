"""The launcher owns its job: a stop signal to it stops every process of the job, and none outlives it.

Example::

    with Stopper(say=print) as stopper:                 # SIGTERM, SIGINT, SIGHUP now relayed
        proc = subprocess.Popen(argv, **popen_kwargs())  # mpirun in a session of its own
        stopper.attach(proc)
        code = proc.wait()
    left = sweep(proc.pid)                               # kill what the job left behind

[Note: the launcher owns its job] Open MPI 5's mpirun (prterun) puts every rank in a process group
of its own (measured: pgid = the rank's pid), so killing mpirun's group misses the ranks, and a
rank whose mpirun died is re-parented to init and trains on with nobody reading its output. What
every process of a job does keep is its *session*: `tfsmp run` starts mpirun in a new session
(`start_new_session`), the ranks, their guards (`rankguard`, `memcap`) and anything they fork
inherit it, and `session_processes` finds them all through /proc however they were re-parented.
So:

* *A stop signal is relayed, with preemption semantics first.* The first SIGTERM, SIGINT or
  SIGHUP to the launcher becomes SIGUSR1 to mpirun, which forwards it to every rank: ranks that
  listen for a preemption ([Note: preemption] in tfsmp/runtime/preemption.py: fit with a backup
  callback, or a script that installs it) finish the step, write their backup and exit 75;
  ranks that do not listen die of it at once. After `grace` seconds (`--stop-grace`, env
  `TFSMP_STOP_GRACE`, default `DEFAULT_GRACE`) the launcher sends SIGTERM to mpirun (which kills
  its job), and `KILL_AFTER` seconds later SIGKILL to every process of the session. A second
  signal skips to SIGTERM; a third to SIGKILL.
* *Nothing outlives the launcher.* Whether the job ended by itself or was stopped, the launcher
  then sweeps mpirun's session: what is left gets SIGTERM, then SIGKILL after `KILL_AFTER`
  seconds, and the launcher returns only when the session is empty.
* *Not even when the launcher is killed.* mpirun runs under a small guard process that learns
  of the launcher's death, however it dies (`PR_SET_PDEATHSIG`, Linux), and then ends the
  session ([Note: session guard]).

Since mpirun runs in its own session, a Ctrl-C in the terminal reaches only the launcher, which
relays it as above (mpirun itself would kill the ranks at once, with no chance of a backup).

Pure: imports neither TensorFlow nor mpi4py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from tfsmp.launch.mpirun import fresh_session

__all__ = ["DEFAULT_GRACE", "GRACE_ENV", "KILL_AFTER", "STOP_SIGNALS", "Stopper",
           "grace_seconds", "guard_main", "guarded", "kill_session", "popen_kwargs",
           "session_processes", "sweep"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_ENV = "TFSMP_STOP_GRACE"
DEFAULT_GRACE = 30.0  # s for the ranks to finish their step and write a backup
KILL_AFTER = 5.0      # s between SIGTERM and SIGKILL
_PR_SET_PDEATHSIG = 1


def grace_seconds(given: float | None = None, environ: dict[str, str] | None = None) -> float:
    """The stop grace period: ``given``, else `TFSMP_STOP_GRACE`, else `DEFAULT_GRACE`.

    Raises:
        ValueError: The value is not a number >= 0.
    """
    env = os.environ if environ is None else environ
    value: Any = given if given is not None else env.get(GRACE_ENV, DEFAULT_GRACE)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"the stop grace period must be a number of seconds >= 0. Received: "
                         f"{value!r}. Fix: pass --stop-grace 30 (or set {GRACE_ENV}=30).")
    return seconds


PARENT_GONE = signal.SIGRTMIN + 1 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2


def _die_with_parent(signum: int = signal.SIGTERM) -> None:
    """In the child before exec: ``signum`` when the launcher dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # mpirun's output may lose its reader
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def _guard_parent_death() -> None:
    _die_with_parent(PARENT_GONE)


def popen_kwargs(*, die_with_parent: bool = True) -> dict[str, Any]:
    """`subprocess.Popen` arguments that make a launched job one session of its own.

    ``die_with_parent``: the job is killed when the thread that started it ends; only for a
    launcher whose main thread starts and waits for the job (`tfsmp run`), which must then run
    its command under `guarded` ([Note: session guard]).
    """
    kwargs: dict[str, Any] = {"start_new_session": True}
    if die_with_parent and hasattr(os, "fork"):
        kwargs["preexec_fn"] = _guard_parent_death
    return kwargs


def guarded(argv: list[str], python: str = sys.executable) -> list[str]:
    """``argv`` run under the session guard (`python -m tfsmp.launch.ownjob ARGV`)."""
    return [python, "-m", "tfsmp.launch.ownjob", *argv]


# [Note: session guard] Killing the launcher (SIGKILL, the OOM killer) must end its job too.
# `PR_SET_PDEATHSIG` can tell mpirun, but mpirun does not reliably act on it: in 2 of 5 trials a
# SIGTERM delivered that way ended prterun and left both ranks running. So the launcher starts a
# small guard instead, whose parent-death signal is `PARENT_GONE`; the guard starts mpirun in
# the same session, passes every other signal on to it unchanged, and when the launcher is gone
# ends mpirun's session itself: SIGTERM to mpirun, then SIGKILL to every process left.
def guard_main(argv: list[str]) -> int:
    """The session guard: runs ``argv`` and ends its session if the launcher dies."""
    if not argv:
        sys.stderr.write("tfsmp.launch.ownjob: the command to guard must follow. Received: "
                         "nothing.\n")
        return 2
    sid = os.getsid(0)
    children: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []  # signals that came before mpirun started

    def forward(signum: int, frame: FrameType | None) -> None:
        if not children:
            pending.append(signum)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    def parent_gone(signum: int, frame: FrameType | None) -> None:
        forward(signal.SIGTERM, frame)
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(KILL_AFTER)
        kill_session(sid)
        os._exit(128 + int(signal.SIGTERM))

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, forward)
    signal.signal(PARENT_GONE, parent_gone)
    if os.getppid() == 1:  # the launcher died before the guard could listen
        parent_gone(PARENT_GONE, None)
    children.append(subprocess.Popen(fresh_session(argv)))  # keeps its pid: see there
    for waiting in pending:
        forward(waiting, None)
    code = children[0].wait()
    return code if code >= 0 else 128 - code


def _stat(pid: str) -> tuple[str, int] | None:
    """(state, session id) of a process, from /proc/PID/stat (None: it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the name may hold spaces and parentheses
    return (fields[0], int(fields[3])) if len(fields) > 3 else None


def session_processes(sid: int) -> list[int]:
    """The live processes (not zombies) of session ``sid``, this process excluded."""
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc: nothing to find
        return []
    found = []
    for name in names:
        if name.isdigit() and int(name) != os.getpid():
            stat = _stat(name)
            if stat is not None and stat[1] == sid and stat[0] not in ("Z", "X"):
                found.append(int(name))
    return sorted(found)


def kill_session(sid: int, signum: int = signal.SIGKILL) -> list[int]:
    """Sends ``signum`` to every process of session ``sid``; returns their pids."""
    pids = session_processes(sid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
    return pids


def _wait_empty(sid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while session_processes(sid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def sweep(sid: int, kill_after: float = KILL_AFTER) -> list[int]:
    """Ends what is left of session ``sid``: SIGTERM, then SIGKILL after ``kill_after`` seconds.

    Returns:
        The pids that were left (empty when the job had ended cleanly).
    """
    left = kill_session(sid, signal.SIGTERM)
    if left and not _wait_empty(sid, kill_after):
        kill_session(sid, signal.SIGKILL)
        _wait_empty(sid, kill_after)
    return left


class Stopper:
    """Relays the launcher's stop signals to its job, escalating ([Note: the launcher owns its job]).

    Args:
        grace: Seconds between the preemption signal (SIGUSR1) and SIGTERM to mpirun.
        say: Where the launcher's one line per stop goes.
        on_stop: Called (in the signal handler) at the first stop signal.
        name: The launcher's name in what it says.
    """

    def __init__(self, grace: float = DEFAULT_GRACE, say: Callable[[str], None] | None = None,
                 on_stop: Callable[[], None] | None = None, name: str = "tfsmp run") -> None:
        self.grace, self.say, self.on_stop, self.name = grace, say, on_stop, name
        self.signals: list[int] = []
        self.stopped_at: float | None = None
        self.procs: list[subprocess.Popen[Any]] = []
        self._timers: list[threading.Timer] = []
        self._previous: dict[int, Any] = {}

    def attach(self, proc: subprocess.Popen[Any]) -> None:
        """The job's launcher process (started with `popen_kwargs`)."""
        self.procs.append(proc)
        if self.signals:  # a signal came before the job started: stop it as well
            self._escalate(min(len(self.signals), 3))

    def __enter__(self) -> Stopper:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for timer in self._timers:
            timer.cancel()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)
        level = min(len(self.signals), 3)
        if level == 1:
            self.stopped_at = time.monotonic()
            if self.on_stop is not None:
                self.on_stop()
            if self.say is not None:
                self.say(f"{self.name}: {signal.Signals(signum).name}: stopping the job: ranks "
                         f"that keep a backup write it and exit 75, the rest stop now; in "
                         f"{self.grace:g} s, or at a second signal, the job is killed")
            self._later(self.grace, 2)
            self._later(self.grace + KILL_AFTER, 3)
        self._escalate(level)

    def _later(self, seconds: float, level: int) -> None:
        timer = threading.Timer(seconds, self._escalate, args=(level,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _escalate(self, level: int) -> None:
        """1: SIGUSR1 to mpirun (preemption); 2: SIGTERM to mpirun; 3: SIGKILL to the session."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                if level == 3:
                    kill_session(proc.pid)
                elif proc.poll() is None:
                    proc.send_signal(signal.SIGUSR1 if level == 1 else signal.SIGTERM)

    def report(self, left: list[int]) -> None:
        """The line that closes a stopped job: how long it took, and what had to be killed."""
        if self.stopped_at is None or self.say is None:
            return
        took = time.monotonic() - self.stopped_at
        extra = (f"; {len(left)} process(es) it left behind were killed" if left else "")
        self.say(f"{self.name}: the job stopped {took:.1f} s after "
                 f"{signal.Signals(self.signals[0]).name}{extra}; no process of it is left")


if __name__ == "__main__":
    sys.exit(guard_main(sys.argv[1:]))

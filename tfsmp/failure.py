"""One rank fails, the job ends: a rank-tagged traceback on stderr, then `MPI.COMM_WORLD.Abort`.

Under `mpirun python train.py`, an exception on one rank would otherwise hang the job: the other
ranks wait in a receive or barrier forever, and the failing rank's own atexit `MPI_Finalize` blocks
(measured with the PyPI Open MPI 5 wheel and mpi4py 4). `install()` replaces `sys.excepthook` and `threading.excepthook` so that every
launch path (`tfsmp run`, `mpirun python`, `mpirun python -m mpi4py`, `horovodrun`) behaves like
`python -m mpi4py`: a line naming the host and pid (`[rank 3 | pp_rank 1] failed on host algo-2
(pid 4242); aborting the job`), then the traceback with every line tagged `[rank 3 | pp_rank 1]`, are
printed, stderr is flushed, and all ranks are aborted with exit code 1.

A configuration or launch error that `tfsmp.init` finds is not a crash: it prints as one short
line, once per job, with no traceback ([Note: setup errors]; `TFSMP_DEBUG=1` prints the traceback).
So does every tfsmp error raised later, and any failure prints once per job, from the first rank
that failed ([Note: one message per job]).

Example::

    failure.install(lambda: f"rank {rank} | pp_rank {stage}")
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

from tfsmp import relaunch
from tfsmp.errors import TfsmpError

__all__ = ["DEBUG_ENV", "DIR_ENV", "ECHO_GRACE", "PARTWAY", "REPORT_GRACE", "SETUP_GRACE",
           "abort_job", "alike", "claim_report", "debugging", "default_directory", "echo",
           "echo_of", "end_job", "end_partway", "format_setup_error", "format_short",
           "format_tagged", "install", "installed", "launcher_rank", "mark_setup_error",
           "raised_alike", "remove_generated_sources", "uninstall"]

_previous: tuple[Any, Any] | None = None
_rank_tag: Callable[[], str] = lambda: "rank ?"  # noqa: E731 - replaced by install()
_lock = threading.Lock()


def format_tagged(exc_type: type[BaseException], exc: BaseException,
                  tb: TracebackType | None, tag: str, thread: str | None = None) -> str:
    """The traceback text with every line prefixed by `[tag] `."""
    lines = "".join(traceback.format_exception(exc_type, exc, tb)).splitlines()
    if thread:
        lines.insert(0, f"Exception in thread {thread}:")
    return "".join(f"[{tag}] {line}\n" for line in lines)


def _safe_tag() -> str:
    try:
        return _rank_tag()
    except Exception:  # the tag must never hide the real error
        return "rank ?"


def _mpi_world_size() -> int:
    """COMM_WORLD's size if MPI is up in this process, else 1 (never initializes MPI)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return 1
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized():
            return int(mpi.COMM_WORLD.Get_size())
    except Exception:
        pass
    return 1


def abort_job(code: int = 1) -> None:
    """Aborts every rank when this process is part of a multi-rank MPI job; no-op otherwise."""
    if _mpi_world_size() > 1:
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(code)


def _where(tag: str) -> str:
    """The host and pid line: across hosts, a rank number alone does not say where to look."""
    return f"[{tag}] failed on host {socket.gethostname()} (pid {os.getpid()}); aborting the job\n"


def format_short(exc: BaseException, tag: str) -> str:
    """A tfsmp error as the job shows it: `[tag] StepError: <message>`, every line tagged (and
    the exception's notes after it, as a traceback shows them)."""
    text = "\n".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", ())])
    return "".join(f"[{tag}] {line}\n" for line in text.splitlines())


def _short(exc: BaseException) -> bool:
    """Whether `exc` prints as its message alone ([Note: one message per job])."""
    launched = launcher_rank() is not None or _mpi_world_size() > 1
    return isinstance(exc, TfsmpError) and launched and not debugging()


def _report(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None,
            thread: str | None = None) -> None:
    with _lock:  # two threads failing at once must not interleave their lines
        tag = _safe_tag()
        if echo_of(exc) is not None and not debugging() and not _claimed:
            time.sleep(ECHO_GRACE)  # the rank that failed first claims the report
        if debugging() or claim_report():
            try:
                sys.stderr.write(format_short(exc, tag) if _short(exc) else
                                 _where(tag) + format_tagged(exc_type, exc, tb, tag, thread))
                sys.stderr.flush()
            except Exception:
                pass
        else:  # another rank reports; let its lines out before this exit ends the job
            time.sleep(REPORT_GRACE)
        # for a launcher that relaunches the job ([Note: restart records] in tfsmp/relaunch.py)
        relaunch.record_failure(tag, f"{exc_type.__name__}: {exc}")
        end_job(1)


# [Note: one message per job] A failure that reaches several ranks (an error every rank raises
# alike, a stall every peer notices, an exception whose abort interrupts the others) used to
# print once per rank, each copy with its traceback, then two Open MPI banners: 51-158 lines for
# one sentence. Now the first rank that fails creates ``reported`` in the job's directory
# (`default_directory`, Open MPI's per-job session directory under mpirun) with O_EXCL; only
# that rank prints, the others end silently after REPORT_GRACE. A tfsmp error (`TfsmpError`) is
# the user's to fix, not a crash: under a launcher it prints as its message alone, every line
# tagged ``[rank R | pp_rank S]``; other exceptions keep their traceback. `TFSMP_DEBUG=1`
# prints every traceback, on every rank that fails. The rank then exits with status 1 rather
# than calling MPI_Abort: Open MPI's launcher ends the job just as fast when a rank exits
# non-zero (measured: 2.4 s either way) and prints one banner instead of two, which `tfsmp run`
# drops as redundant (`tfsmp.launch.output`). Where no job directory is known, every failing
# rank prints.
REPORT_GRACE = 0.5  # s a rank that does not report waits before it exits
# [Note: echoes defer] Some errors are one rank's copy of another rank's failure: a rank whose
# dataset raised re-raises its own exception after the per-step batch agreement, and at that
# same moment its peers raise a StepError naming it; the last stage's metric error is raised
# again on the other stages. The first rank to claim used to print, and the copy (no traceback,
# second hand) won the race now and then. `echo` marks the copy; a rank reporting one waits
# ECHO_GRACE before it claims, so the rank whose failure it echoes prints its own traceback.
# If that rank never claims (killed, on another host), the copy still prints, ECHO_GRACE later.
ECHO_GRACE = 1.0
DIR_ENV = "TFSMP_WATCHDOG_DIR"
# Environment variables that name the running job, launcher by launcher.
_JOB_KEYS = ("PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid", "SLURM_JOB_ID", "PBS_JOBID")
_E = TypeVar("_E", bound=BaseException)
_claimed: list[bool] = []  # this process's claim, once decided


def _safe_key(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:80]


def default_directory(environ: Mapping[str, str] | None = None) -> str | None:
    """The directory the ranks of this job on this host share (the watchdog's status files, the
    report claim); see [Note: status files] in tfsmp/comm/watchdog.py.

    Returns:
        A directory path, or None when no job id can be found.
    """
    env = os.environ if environ is None else environ
    job = next((_safe_key(env[k]) for k in _JOB_KEYS if env.get(k)), None)
    if env.get(DIR_ENV):  # shared by jobs, perhaps: one subdirectory per job
        return os.path.join(env[DIR_ENV], f"job-{job}") if job else env[DIR_ENV]
    location = env.get("OMPI_FILE_LOCATION")
    if location:  # Open MPI: <session>/<job>/<rank>; mpirun removes <session> at job end
        return os.path.join(os.path.dirname(location.rstrip(os.sep)), "tfsmp-watchdog")
    if job:
        return os.path.join(tempfile.gettempdir(), f"tfsmp-watchdog-{job}")
    if env.get("PMI_RANK") is not None:  # MPICH's hydra: the ranks of a host share a proxy
        return os.path.join(tempfile.gettempdir(), f"tfsmp-watchdog-ppid{os.getppid()}")
    return None


def claim_report(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this rank reports the job's failure ([Note: one message per job]).

    True for the first rank of the job (on this host) to ask, and wherever no directory names
    the job; the answer is kept for the life of the process.
    """
    if _claimed:
        return _claimed[0]
    env = os.environ if environ is None else environ
    known = any(env.get(k) for k in (*_JOB_KEYS, "OMPI_FILE_LOCATION"))
    directory = default_directory(env) if known else None
    mine = True
    if directory is not None:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            if not _ours(directory):  # [Note: private temp folders] in tfsmp/tempdirs.py
                raise PermissionError(directory)
            fd = os.open(os.path.join(directory, "reported"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
            os.write(fd, f"{launcher_rank(env)} {os.getpid()}\n".encode())
            os.close(fd)
        except FileExistsError:
            mine = False
        except OSError:  # cannot tell: better twice than never
            mine = True
    _claimed.append(mine)
    return mine


def echo(exc: _E, origin: int) -> _E:
    """Marks ``exc`` as this rank's copy of world rank ``origin``'s failure ([Note: echoes
    defer]) and returns it: ``raise failure.echo(StepError(...), origin=r)``."""
    exc.__dict__["_tfsmp_echo_of"] = int(origin)
    return exc


def echo_of(exc: BaseException) -> int | None:
    """The world rank whose failure ``exc`` echoes (`echo`), or None for a failure of its own."""
    origin = getattr(exc, "__dict__", {}).get("_tfsmp_echo_of")
    return origin if isinstance(origin, int) else None


# [Note: a step that fails partway] A pipeline step is one exchange among ranks: each rank posts
# receives, sends its activations and gradients, and meets the others in the step's reductions.
# An exception that leaves a step on one rank partway (a user layer's assertion or py_function on
# one stage, the loss on the last, `smp.step`'s body, an optimizer or a reduction failing on one
# rank) leaves its peers waiting for messages it will never send, and its own posted receives
# matched by nothing. Raised into the script, it was caught there now and then (a retry loop, a
# test runner, `try: fit(...) except Exception: ...`), and the peers then waited out
# `stall_timeout` (600 s by default) before the watchdog ended the job; a script that caught it
# and went on to a second step would have matched the old step's messages. No caller can recover
# such a step, for the reason of [Note: why abort, not raise] in tfsmp/comm/watchdog.py, so the
# rank ends the job at once, as if nothing had caught the exception: its traceback (a tfsmp error:
# its message) with a note saying why, once per job ([Note: one message per job]), then the exit
# that ends every rank. Errors the step raises on every rank alike at a point where every
# message has been matched (a non-finite step under ``nonfinite='raise'``, a peer's failure
# shared in a collective: `echo`) are marked with `alike` and still raise into the script,
# which may catch them and go on. In a single process there are no peers: nothing changes.
PARTWAY = ("tfsmp: this exception left a {what} partway on this rank, while the other ranks wait "
           "for its messages; a step cannot be recovered on one rank, so the job ends here "
           "instead of raising into the script.")


def alike(exc: _E) -> _E:
    """Marks ``exc`` as raised on every rank alike, every message of the step matched, so that a
    script may catch it and go on ([Note: a step that fails partway]); returns it."""
    exc.__dict__["_tfsmp_alike"] = True
    return exc


def raised_alike(exc: BaseException) -> bool:
    """Whether every rank raises ``exc`` alike (`alike`, or a copy of a peer's failure: `echo`)."""
    return bool(getattr(exc, "__dict__", {}).get("_tfsmp_alike")) or echo_of(exc) is not None


def end_partway(exc: BaseException, what: str = "pipeline step") -> None:
    """Ends the job for ``exc``, which left a ``what`` partway on this rank ([Note: a step that
    fails partway]); returns without doing anything outside a multi-rank MPI job, or when
    ``exc`` is raised on every rank alike (`raised_alike`), or is no `Exception`."""
    if (not isinstance(exc, Exception) or raised_alike(exc) or _mpi_world_size() <= 1):
        return
    with contextlib.suppress(Exception):
        exc.add_note(PARTWAY.format(what=what))
    _report(type(exc), exc, _whole_stack(exc.__traceback__))


def _whole_stack(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` extended by the frames that called its first one: the traceback an uncaught
    exception would have shown (down from the script's own line)."""
    if tb is None:
        return None
    frame = tb.tb_frame.f_back
    while frame is not None:
        tb = TracebackType(tb, frame, frame.f_lasti, frame.f_lineno)
        frame = frame.f_back
    return tb


def _ours(directory: str) -> bool:
    """Whether ``directory`` is a real directory of this user's (not a symlink)."""
    info = os.lstat(directory)
    uid = os.geteuid() if hasattr(os, "geteuid") else info.st_uid
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid


def end_job(code: int = 1) -> None:
    """Ends this rank so that the launcher ends the whole job ([Note: one message per job]).

    Under Open MPI the rank exits with `code` (its launcher ends the job on a non-zero exit);
    under another MPI it calls MPI_Abort; outside a multi-rank job it does nothing.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    if _mpi_world_size() <= 1:
        return
    remove_generated_sources()
    if os.environ.get("OMPI_COMM_WORLD_RANK") is not None:
        os._exit(code)
    abort_job(code)


_GENERATED = "__autograph_generated_file"  # TensorFlow's prefix (autograph/pyct/loader.py)


def remove_generated_sources() -> int:
    """Removes the source files TensorFlow's autograph wrote for this process; returns how many.

    [Note: generated sources] Autograph writes each function it converts to a file
    ``<temp>/__autograph_generated_file<random>.py`` and deletes it in an ``atexit`` hook. A
    rank that ends the job skips ``atexit`` (`end_job`: ``os._exit``, or ``MPI_Abort``), so
    every failed job left its failing rank's files behind: about 7,800 in this machine's
    ``/tmp`` after a few days of test runs (2026-12-06). Each converted module stays in
    ``sys.modules`` under its file's name, so the files are known without TensorFlow's help;
    they are removed once the traceback has been printed (nothing reads them after that). The
    other ranks, which their launcher kills, cannot clean up after themselves: `tfsmp run`
    gives every job a temp folder of its own and removes it afterwards (`job_tmpdir` in
    tfsmp/launch/mpirun.py)."""
    removed = 0
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) if name.startswith(_GENERATED) else None
        if path and os.path.basename(path).startswith(_GENERATED):
            with contextlib.suppress(OSError):
                os.remove(path)
                removed += 1
    return removed


def _excepthook(exc_type: type[BaseException], exc: BaseException,
                tb: TracebackType | None) -> None:
    if _report_setup_error(exc):
        end_job(1)  # MPI is up only for an error of a second init() call
        return
    if issubclass(exc_type, KeyboardInterrupt) and _mpi_world_size() == 1 and _previous:
        _previous[0](exc_type, exc, tb)
        return
    _report(exc_type, exc, tb)


def _threading_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else None
    exc = args.exc_value if args.exc_value is not None else args.exc_type()
    _report(args.exc_type, exc, args.exc_traceback, thread=name)


def install(rank_tag: Callable[[], str]) -> None:
    """Installs the hooks (idempotent; a second call only replaces the tag function).

    Args:
        rank_tag: Returns the tag text, e.g. "rank 2 | pp_rank 1"; called when an error is reported.
    """
    global _previous, _rank_tag
    _rank_tag = rank_tag
    if _previous is None:
        _previous = (sys.excepthook, threading.excepthook)
        sys.excepthook = _excepthook
        threading.excepthook = _threading_excepthook


def installed() -> bool:
    """True while the hooks are installed."""
    return _previous is not None


def uninstall() -> None:
    """Restores the hooks that were in place before `install` (and `mark_setup_error`)."""
    global _previous, _setup_previous
    if _previous is not None:
        sys.excepthook, threading.excepthook = _previous
        _previous = None
    if sys.excepthook is _setup_excepthook:
        sys.excepthook, _setup_previous = _setup_previous or sys.__excepthook__, None


# [Note: setup errors] A configuration or launch error that `tfsmp.init` finds (an unknown key,
# partitions that do not divide the world size, no launcher, `horovod: True` without Horovod) is
# the same on every rank and is the user's to fix, not a crash: a traceback of ~25 frames on
# every rank buries the one line that matters. So `init` marks such an error, and if nothing
# catches it, the process ends with that line alone, tagged `[rank R | init]`, exit code 1.
# Once per job: rank 0 prints at once; any other rank first waits SETUP_GRACE seconds. When every
# rank failed alike, rank 0's exit ends the job (every MPI launcher kills the other ranks when one
# exits non-zero) before the others print; when only some ranks failed (a file missing on one
# host), they still say why. `TFSMP_DEBUG=1` restores the traceback on every rank, at once.
DEBUG_ENV = "TFSMP_DEBUG"
SETUP_GRACE = 10.0  # s; a few seconds of start-up skew between ranks on a loaded machine, and more
_RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_MARK = "_tfsmp_setup_error"
_setup_previous: Any = None


def debugging(environ: Mapping[str, str] | None = None) -> bool:
    """True when `TFSMP_DEBUG` asks for tracebacks (any value but empty, 0, false, no)."""
    value = (os.environ if environ is None else environ).get(DEBUG_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def launcher_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as its MPI launcher set it (None without a launcher)."""
    env = os.environ if environ is None else environ
    for key in _RANK_ENV:
        if env.get(key, "").isdigit():
            return int(env[key])
    return None


def format_setup_error(exc: BaseException, rank: int) -> str:
    """The one line a setup error prints: `[rank R | init] ConfigError: <message>`."""
    return f"[rank {rank} | init] {type(exc).__name__}: {exc}\n"


def mark_setup_error(exc: BaseException) -> None:
    """Makes `exc`, if nothing catches it, end the process as one line. [Note: setup errors]

    Callers re-raise `exc` afterwards: code that catches it (tests, notebooks) sees the exception
    with its traceback as usual.
    """
    global _setup_previous
    setattr(exc, _MARK, True)
    if sys.excepthook not in (_excepthook, _setup_excepthook):
        _setup_previous = sys.excepthook
        sys.excepthook = _setup_excepthook


def _report_setup_error(exc: BaseException) -> bool:
    """Prints a marked setup error as its one line (after the grace on ranks but 0); False for
    any other exception, or when TFSMP_DEBUG asks for the traceback."""
    if not getattr(exc, _MARK, False) or debugging():
        return False
    rank = launcher_rank() or 0
    if rank != 0 and _mpi_world_size() == 1:  # (with MPI up, an abort follows at once)
        time.sleep(SETUP_GRACE)
    sys.stderr.write(format_setup_error(exc, rank))
    sys.stderr.flush()
    relaunch.record_failure(f"rank {rank}", f"{type(exc).__name__}: {exc}")  # [Note: restart records]
    return True


def _setup_excepthook(exc_type: type[BaseException], exc: BaseException,
                      tb: TracebackType | None) -> None:
    """The hook `mark_setup_error` puts in place before `install` has run."""
    if not _report_setup_error(exc):
        (_setup_previous or sys.__excepthook__)(exc_type, exc, tb)

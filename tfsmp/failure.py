"""One rank fails, the job ends: a rank-tagged traceback on stderr, then `MPI.COMM_WORLD.Abort`.

Under `mpirun python train.py`, an exception on one rank would otherwise hang the job: the other
ranks wait in a receive or barrier forever, and the failing rank's own atexit `MPI_Finalize` blocks
(measured with the PyPI Open MPI 5 wheel and mpi4py 4). `install()` replaces `sys.excepthook` and `threading.excepthook` so that every
launch path (`tfsmp run`, `mpirun python`, `mpirun python -m mpi4py`, `horovodrun`) behaves like
`python -m mpi4py`: a line naming the host and pid (`[rank 3 | pp_rank 1] failed on host algo-2
(pid 4242); aborting the job`), then the traceback with every line tagged `[rank 3 | pp_rank 1]`, are
printed, stderr is flushed, and all ranks are aborted with exit code 1.

Example::

    failure.install(lambda: f"rank {rank} | pp_rank {stage}")
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["abort_job", "format_tagged", "install", "installed", "uninstall"]

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


def _report(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None,
            thread: str | None = None) -> None:
    with _lock:  # two threads failing at once must not interleave their lines
        try:
            tag = _safe_tag()
            sys.stderr.write(_where(tag) + format_tagged(exc_type, exc, tb, tag, thread))
            sys.stderr.flush()
        except Exception:
            pass
        sys.stdout.flush()
        abort_job(1)


def _excepthook(exc_type: type[BaseException], exc: BaseException,
                tb: TracebackType | None) -> None:
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
    """Restores the hooks that were in place before `install`."""
    global _previous
    if _previous is not None:
        sys.excepthook, threading.excepthook = _previous
        _previous = None

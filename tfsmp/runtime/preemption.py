"""Preemption: a SIGTERM ends training after the current step, with a checkpoint, for a relaunch.

Example::

    preemption.install()                   # fit does this; a custom loop may too
    for step, (x, y) in enumerate(data):
        train_step(x, y)
        if preemption.agreed(world):       # a collective: every rank calls it after every step
            manager.save()
            preemption.exit_for_relaunch()

[Note: preemption] A spot instance that is about to be reclaimed gets SIGTERM (SageMaker's
managed spot training, Kubernetes); so does a job whose launcher is stopped. The signal may reach
only some ranks (one host's), and at any point of a step, where saving would deadlock the
pipeline. So the handler only sets a flag; after each step every rank learns whether any rank was
signalled (one small allreduce over the world, about as costly as a barrier) and, if so, all of
them write the configured checkpoint together and exit with `RELAUNCH_EXIT_CODE` (75), which the
launcher reads as "relaunch" ([Note: restart records] in tfsmp/relaunch.py). `tfsmp run` itself
relays a SIGTERM it receives to the ranks as SIGUSR1 (Open MPI's mpirun kills the job on
SIGTERM but forwards SIGUSR1), so the handler listens to both. Handlers are installed only where
no other handler was set, and only from the main thread.
"""

from __future__ import annotations

import signal
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np

from tfsmp import relaunch
from tfsmp.comm import collective_label

__all__ = ["SIGNALS", "agreed", "exit_for_relaunch", "install", "register_saver", "requested",
           "savers", "uninstall"]

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received: list[int] = []        # signal numbers, in arrival order
_previous: dict[int, Any] = {}   # signal -> the handler installed before ours
_depth = [0]                     # install() calls not yet undone
_savers: weakref.WeakSet[Any] = weakref.WeakSet()


def _handler(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)


def install() -> bool:
    """Listens to SIGTERM and SIGUSR1 (where nothing else does); nested calls count.

    Returns:
        Whether this process now turns a preemption signal into a flag (False off the main
        thread, or when the script handles both signals itself).
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    _depth[0] += 1
    if _depth[0] > 1:
        return bool(_previous)
    for signum in SIGNALS:
        current = signal.getsignal(signum)
        if current in (signal.SIG_DFL, None):
            _previous[signum] = current
            signal.signal(signum, _handler)
    return bool(_previous)


def uninstall() -> None:
    """Undoes one `install` (the last one restores the previous handlers)."""
    if threading.current_thread() is not threading.main_thread() or _depth[0] == 0:
        return
    _depth[0] -= 1
    if _depth[0] > 0:
        return
    for signum, previous in _previous.items():
        if signal.getsignal(signum) is _handler:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    _previous.clear()


def requested() -> bool:
    """Whether this rank received a preemption signal (local: see `agreed`)."""
    return bool(_received)


def signal_name() -> str | None:
    """The first preemption signal this rank received, e.g. "SIGTERM" (None: none)."""
    return signal.Signals(_received[0]).name if _received else None


def agreed(group: Any) -> bool:
    """Whether any rank of ``group`` received a preemption signal: a collective call.

    Watched like every collective ([Note: watched collectives] in tfsmp/comm/watchdog.py): a
    rank that stops between steps ends the job within stall_timeout, instead of leaving its
    peers here for ever.
    """
    flag = np.array([1.0 if _received else 0.0])
    with collective_label("the per-step preemption check", api=False):
        group.allreduce_(flag)
    return bool(flag[0] > 0)


def register_saver(saver: Any) -> None:
    """Remembers a checkpoint writer (e.g. a `CheckpointManager`) for a preemption in ``fit``;
    kept weakly, so it lives as long as the script holds it."""
    _savers.add(saver)


def savers(where: Callable[[Any], bool] = lambda s: True) -> list[Any]:
    """The registered savers that are alive and satisfy ``where``, oldest first."""
    return [s for s in list(_savers) if where(s)]


def exit_for_relaunch(message: str | None = None) -> None:
    """Ends this rank with `RELAUNCH_EXIT_CODE` (raises SystemExit; call it on every rank).

    A second copy of the relayed stop signal may still be on its way (mpirun signals a rank's
    process group, and a rank guard forwards what it gets), and Python resets its handlers to
    the default while it shuts down: that copy would end the rank by SIGUSR1 (exit 138) instead
    of 75. The stop is agreed by now, so SIGUSR1 is ignored from here on (seen under load in
    tests/mpi/test_launcher_signals.py).
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if message:
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stderr.flush()
    sys.stdout.flush()
    raise SystemExit(relaunch.RELAUNCH_EXIT_CODE)

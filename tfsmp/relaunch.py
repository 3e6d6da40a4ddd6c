"""What one attempt of a job leaves for the launcher that relaunches it: failures, progress, exit code.

Example::

    # in a rank (tfsmp.failure, tfsmp.launch.rankguard, the fit loop):
    record_failure("rank 1 | pp_rank 1", "killed by signal 9 (SIGKILL)")
    publish_progress({"epoch": 0, "step": 5})
    # in the launcher, after mpirun ended:
    attempt = read_attempt(directory)
    attempt.first_failure()          # Failure(rank=1, host='algo-2', cause='killed by ...')
    attempt.position()               # {"epoch": 0, "step": 5}: the furthest any rank got
    format_position(attempt.position())  # "after 5 steps of epoch 0"

[Note: restart records] A launcher that relaunches a failed job (`tfsmp run --max-restarts`, the
estimator's `max_retry_attempts`) sets `RESTART_DIR_ENV` to a directory of its own for each
attempt. There, a rank that fails writes ``failure-<rank>-<pid>.json`` (`tfsmp.failure` for an
exception, `tfsmp.launch.rankguard` for a death by signal) and every rank that trains keeps
``progress-<rank>.json`` up to date (its position, rewritten after every step, a few
microseconds). The launcher reads them after mpirun ends: the earliest failure is the one that
ended the job (the others are its consequences), and the furthest position is where it ended,
which tells a failure that repeats at the same step from a transient one. Ranks of other hosts
write there too when the directory is on storage every host sees; otherwise the launcher reports
what it knows (mpirun's exit code). Nothing is written when the variable is unset.

A rank that stops on purpose so that the job is relaunched (a preemption notice, SIGTERM, was
honoured and a checkpoint written) exits with `RELAUNCH_EXIT_CODE` (75, ``EX_TEMPFAIL`` of
sysexits.h: "temporary failure, the user is invited to retry"); mpirun passes it on.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["ATTEMPT_ENV", "RELAUNCH_EXIT_CODE", "RESTART_DIR_ENV", "Attempt", "Failure",
           "enabled", "format_position", "publish_progress", "read_attempt", "record_failure",
           "record_rank_event"]

RELAUNCH_EXIT_CODE = 75
RESTART_DIR_ENV = "TFSMP_RESTART_DIR"
# How many times the job was relaunched before this attempt (torchrun: TORCHELASTIC_RESTART_COUNT).
ATTEMPT_ENV = "TFSMP_RESTART_COUNT"

_PROGRESS_WIDTH = 256  # bytes: every update overwrites the whole record in place
_progress_fd: int | None = None
_progress_path: str | None = None


_seen_dirs: set[str] = set()


def _directory() -> str | None:
    path = os.environ.get(RESTART_DIR_ENV)
    if not path:
        return None
    if path not in _seen_dirs:  # checked once: this runs after every training step
        if not os.path.isdir(path):
            return None
        _seen_dirs.add(path)
    return path


def enabled() -> bool:
    """Whether a launcher that relaunches the job asked this process for records."""
    return _directory() is not None


def _rank() -> str:
    return os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "?"))


def record_failure(tag: str, cause: str, host: str | None = None, pid: int | None = None,
                   rank: str | None = None) -> None:
    """Writes this rank's failure record (no-op when no launcher asked for records).

    Never raises: a failure report must not hide the failure itself.

    Args:
        tag: The rank's tag, e.g. "rank 3 | pp_rank 1".
        cause: One line, e.g. "RuntimeError: boom" or "killed by signal 9 (SIGKILL)".
        host, pid, rank: Default to this process's.
    """
    directory = _directory()
    if directory is None:
        return
    try:
        rank = rank if rank is not None else _rank()
        pid = pid if pid is not None else os.getpid()
        record = {"rank": rank, "tag": tag, "host": host or socket.gethostname(), "pid": pid,
                  "cause": cause.splitlines()[0] if cause else "", "time": time.time()}
        path = os.path.join(directory, f"failure-{rank}-{pid}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except Exception:
        pass


def record_rank_event(kind: str, rank: str, code: int | None = None) -> None:
    """Records that rank ``rank`` started (``kind="start"``) or exited with ``code``
    (``kind="exit"``); written by its guard (tfsmp.launch.rankguard), no-op without a launcher.

    [Note: lost daemons] Open MPI 5's mpirun exits with status 0 when a whole remote host dies
    (its daemon and ranks killed together): it prints "A daemon failed to report back after
    being spawned ... Daemon exit status: 0" and nothing else (measured on emulated hosts). So
    the launcher does not take mpirun's 0 alone as success: when every rank's guard recorded its
    start, every rank must also have recorded an exit with status 0; when not (the records are
    not on storage every host sees), the launcher probes the hosts (tfsmp/launch/restart.py).
    """
    directory = _directory()
    if directory is None:
        return
    try:
        path = os.path.join(directory, f"{kind}-{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": rank, "code": code, "time": time.time()}, f)
        os.replace(path + ".tmp", path)
    except Exception:
        pass


def publish_progress(position: dict[str, Any]) -> None:
    """Records how far this rank got (e.g. ``{"epoch": 1, "step": 4}``); no-op without a launcher.

    The record is rewritten in place (one ``pwrite``), so a rank killed at any moment leaves
    either the previous position or the new one.
    """
    global _progress_fd, _progress_path
    directory = _directory()
    if directory is None:
        return
    path = os.path.join(directory, f"progress-{_rank()}.json")
    try:
        if _progress_fd is None or _progress_path != path:
            _progress_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            _progress_path = path
        text = json.dumps(position, sort_keys=True).encode()
        if len(text) >= _PROGRESS_WIDTH:
            return
        os.pwrite(_progress_fd, text.ljust(_PROGRESS_WIDTH), 0)
    except OSError:
        pass


def format_position(position: dict[str, Any] | None) -> str:
    """Where training was: ``"after 4 steps of epoch 1"`` for ``{"epoch": 1, "step": 4}`` (steps
    of that epoch done); "before its first step" when no rank got that far."""
    if not position:
        return "before its first step"
    if set(position) == {"epoch", "step"}:
        steps = int(position["step"])
        return f"after {steps} step{'' if steps == 1 else 's'} of epoch {int(position['epoch'])}"
    return "at " + ", ".join(f"{k} {v}" for k, v in position.items())


@dataclass(frozen=True)
class Failure:
    """One failure record: which rank, where, why, when."""

    rank: int | None
    host: str
    cause: str
    time: float = 0.0
    pid: int | None = None

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        return f"{who} on host {self.host}: {self.cause}"


@dataclass(frozen=True)
class Attempt:
    """What the ranks of one attempt left behind."""

    failures: tuple[Failure, ...]
    positions: tuple[dict[str, Any], ...]
    started: frozenset[int] = frozenset()
    exits: tuple[tuple[int, int], ...] = ()  # (rank, exit status)

    def unfinished(self, np: int) -> list[int] | None:
        """Ranks that started but did not exit with status 0; None when not every rank's start
        was recorded (the records are then not shared by every host, and cannot tell).
        See [Note: lost daemons]."""
        if self.started != frozenset(range(np)):
            return None
        ok = {rank for rank, code in self.exits if code == 0}
        return sorted(self.started - ok)

    def first_failure(self) -> Failure | None:
        """The earliest failure: the one that ended the job (later ones follow from it)."""
        return min(self.failures, key=lambda f: f.time) if self.failures else None

    def position(self) -> dict[str, Any] | None:
        """The furthest position any rank published (None: none did)."""
        if not self.positions:
            return None
        return max(self.positions, key=_position_key)


def _position_key(position: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(position.get(k, 0)) for k in ("epoch", "step"))


def _rank_number(text: Any) -> int | None:
    return int(text) if re.fullmatch(r"\d+", str(text)) else None


def read_attempt(directory: str) -> Attempt:
    """Reads the records of one attempt (unreadable records are skipped)."""
    failures: list[Failure] = []
    positions: list[dict[str, Any]] = []
    started: set[int] = set()
    exits: list[tuple[int, int]] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        names = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                data = json.loads(f.read().strip() or "null")
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        if name.startswith("failure-") and name.endswith(".json"):
            failures.append(Failure(_rank_number(data.get("rank")), str(data.get("host", "?")),
                                    str(data.get("cause", "")), float(data.get("time", 0.0)),
                                    data.get("pid")))
        elif name.startswith("progress-"):
            positions.append(data)
        elif name.startswith(("start-", "exit-")) and name.endswith(".json"):
            rank = _rank_number(data.get("rank"))
            if rank is not None and name.startswith("start-"):
                started.add(rank)
            elif rank is not None:
                exits.append((rank, int(data.get("code") or 0)))
    return Attempt(tuple(failures), tuple(positions), frozenset(started), tuple(exits))

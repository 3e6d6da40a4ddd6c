"""Failure reports: the failing rank, its error line and traceback, found in a job's log."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from tfsmp.launch.mpirun import TAG_OUTPUT_PATTERN

__all__ = ["Failure", "find_failure"]

_TAGGED = re.compile(TAG_OUTPUT_PATTERN)
_PRTE_PROC = re.compile(r"Process name:\s+\[[^\]]*,(\d+)\]")
_RANK_TAG = re.compile(r"^\[rank \d+[^\]]*\] ?")
# A setup error at init, and any tfsmp error later, prints its message alone, no traceback
# ([Note: setup errors], [Note: one message per job] in tfsmp/failure.py).
_SETUP_ERROR = re.compile(r"^\[rank (\d+) \| (?:init|pp_rank \d+)\] (\w+Error: .*)$")


@dataclass(frozen=True)
class Failure:
    """What failed: the rank (None when unknown), its error line and traceback."""

    rank: int | None
    error: str
    traceback: str


def find_failure(lines: Iterable[str]) -> Failure:
    """Finds the failing rank and its error in a job log (`--tag-output` lines, or untagged).

    The first rank that printed a traceback wins (it is where the error began: the others were
    aborted); failing that, the first setup error's one line (`[rank R | init] ConfigError: …`);
    failing that, the rank Open MPI names as the first to exit non-zero.
    """
    stderr: dict[int | None, list[str]] = {}
    first_traceback: list[int | None] = []
    exited: int | None = None
    setup: Failure | None = None
    for line in lines:
        m = _TAGGED.match(line)
        rank: int | None = int(m.group(1)) if m else None
        if m and m.group(2) != "stderr":
            continue
        raw = m.group(3) if m else line.rstrip("\n")
        s = _SETUP_ERROR.match(raw)
        if s and setup is None:
            setup = Failure(int(s.group(1)), s.group(2), "")
        text = _RANK_TAG.sub("", raw)
        stderr.setdefault(rank, []).append(text)
        if text.startswith("Traceback (most recent call last)") and rank not in first_traceback:
            first_traceback.append(rank)
        proc = _PRTE_PROC.search(text) if m is None else None
        if proc and exited is None:
            exited = int(proc.group(1))
    if not first_traceback:
        return setup or Failure(exited, "", "")
    rank = first_traceback[0]
    error, tb = _last_exception(stderr[rank])
    return Failure(rank if rank is not None else exited, error, tb)


def _last_exception(lines: list[str]) -> tuple[str, str]:
    """(the exception line, the traceback text) of the last traceback in `lines`."""
    start = max(i for i, t in enumerate(lines) if t.startswith("Traceback (most recent call last)"))
    for end in range(start + 1, len(lines)):
        if lines[end] and not lines[end][0].isspace():
            return lines[end], "\n".join(lines[start:end + 1])
    return "", "\n".join(lines[start:])

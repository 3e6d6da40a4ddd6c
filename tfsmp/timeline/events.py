"""Per-rank event timeline (``trace_dir`` / ``TFSMP_TRACE``): what ran when, as JSON lines.

Example::

    tracer = Tracer("/tmp/trace", rank=0)
    with tracer.event("0F3", "F"):
        ...
    tracer.flush()          # /tmp/trace/rank0.jsonl: {"name": "0F3", "kind": "F", "start": ..., "end": ...}

Timestamps are wall-clock seconds (``time.time``) so ranks on one host share a time base; the
`tfsmp timeline` command turns the files into a Gantt chart and a Chrome trace. When tracing is
off the executor holds no tracer and pays nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
from collections.abc import Iterator

__all__ = ["Tracer", "load_events"]


class Tracer:
    """Collects events in memory; appends them to ``<dir>/rank<R>.jsonl`` on `flush`."""

    def __init__(self, directory: str, rank: int, flush_every: int = 4096) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"rank{rank}.jsonl")
        self.rank = rank
        self.events: list[dict[str, object]] = []
        self.flush_every = flush_every
        with open(self.path, "w"):
            pass
        atexit.register(self.flush)

    @contextlib.contextmanager
    def event(self, name: str, kind: str) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.events.append({"name": name, "kind": kind, "start": start, "end": time.time(),
                                "rank": self.rank})
            if len(self.events) >= self.flush_every:
                self.flush()

    def mark(self, name: str, kind: str, start: float, end: float) -> None:
        self.events.append({"name": name, "kind": kind, "start": start, "end": end, "rank": self.rank})

    def flush(self) -> None:
        if not self.events:
            return
        with open(self.path, "a") as f:
            for e in self.events:
                f.write(json.dumps(e) + "\n")
        self.events.clear()


def load_events(directory: str) -> list[dict[str, object]]:
    """All events of all ranks in ``directory``, sorted by start time."""
    events: list[dict[str, object]] = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                events.extend(json.loads(line) for line in f if line.strip())
    return sorted(events, key=lambda e: float(e["start"]))  # type: ignore[arg-type]

"""Runs named case functions of a module on every rank; prints one JSON line per case and rank.

Usage (normally through `mpihelp.run_cases`)::

    mpirun -np 4 python -m mpi4py tests/mpi/cases_runner.py CASE_MODULE.py case_a case_b
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from mpi4py import MPI


@dataclass
class CaseContext:
    """What a case function gets: this rank, COMM_WORLD, and a per-rank store kept across cases."""

    rank: int
    size: int
    world: Any
    store: dict[str, Any] = field(default_factory=dict)
    case: str = ""


def load_module(path: str) -> ModuleType:
    """Imports a case module from its file path (its directory goes on sys.path)."""
    file = Path(path).resolve()
    sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(file.stem, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import case module {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module
    spec.loader.exec_module(module)
    return module


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def run_case(module: ModuleType, name: str, ctx: CaseContext) -> dict[str, Any]:
    """Runs one case and returns its report (never raises)."""
    ctx.case = name
    start = time.monotonic()
    record: dict[str, Any] = {"case": name, "rank": ctx.rank, "ok": True, "result": None,
                              "error": None}
    try:
        fn = getattr(module, name)
        record["result"] = _jsonable(fn(ctx))
    except Exception:
        record.update(ok=False, error=traceback.format_exc())
    record["seconds"] = round(time.monotonic() - start, 4)
    return record


PEER_GRACE = float(os.environ.get("TFSMP_CASE_GRACE", "240"))  # s; see `leave_together`


def leave_together(world: Any, name: str, ok: bool) -> None:
    """Waits for every rank to end case ``name``; ends the job when one has not within
    `PEER_GRACE` seconds. A case that raised on some ranks only leaves the others waiting in its
    messages or collectives (until stall_timeout, 600 s by default, beyond most launches' limit),
    and the ranks that go on would mismatch every later case: so the job ends here, with this
    line and the failing rank's report (its JSON line, printed before) instead of a launch
    timeout."""
    request = world.Ibarrier()
    deadline = time.monotonic() + PEER_GRACE
    while not request.Test():
        if time.monotonic() > deadline:
            here = "passed" if ok else "failed"
            sys.stderr.write(
                f"cases_runner: rank {world.Get_rank()} waited {PEER_GRACE:.0f} s for the other "
                f"ranks to end case {name} (which {here} here); a rank is stuck in it, most "
                f"likely because the case failed on another rank only: ending the job\n")
            sys.stderr.flush()
            world.Abort(3)
        time.sleep(0.005)


def main(argv: list[str]) -> None:
    world = MPI.COMM_WORLD
    ctx = CaseContext(rank=world.Get_rank(), size=world.Get_size(), world=world)
    module = load_module(argv[1])
    if hasattr(module, "setup"):
        module.setup(ctx)
    for name in argv[2:]:
        record = run_case(module, name, ctx)
        print(json.dumps(record), flush=True)
        leave_together(world, name, record["ok"])  # cases never overlap
    if hasattr(module, "teardown"):
        module.teardown(ctx)


if __name__ == "__main__":
    main(sys.argv)

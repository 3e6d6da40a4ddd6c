"""`tfsmp run` on an emulated host from pytest: bounded, retried on launcher start-up failures,
output split per rank (as tests/mpihelp.py does for one-host jobs)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tests.mpihelp import REPO_ROOT, Result, _split_ranks, base_env
from tests.multihost.netns import Cluster
from tfsmp.launch.mpirun import launcher_never_started

# Skip Open MPI's OFI/UCX probing: 4.1 s -> 2.4 s per launch (measured on emulated hosts).
FAST_TRANSPORT = "--mca pml ob1 --mca btl self,sm,tcp"
LAUNCH_ATTEMPTS = 3  # [Note: launcher start-up failures] in tfsmp/launch/mpirun.py


def tfsmp_run(cluster: Cluster, args: Sequence[str], *, timeout: float, host: str = "algo-1",
              env: Mapping[str, str] | None = None) -> Result:
    """Runs `tfsmp run ARGS` on `host` (the launcher host, like SageMaker's algo-1).

    The job is killed (SIGTERM, SIGKILL 5 s later) after `timeout` seconds; its returncode is
    then 124 or 137.
    """
    cmd = [sys.executable, "-m", "tfsmp", "run", *args]
    for attempt in range(LAUNCH_ATTEMPTS):
        start = time.monotonic()
        proc = cluster.run(host, cmd, timeout=timeout, env=base_env(env), cwd=REPO_ROOT)
        if not launcher_never_started(proc.returncode, proc.stderr, proc.stdout):
            break
        time.sleep(0.5 * (attempt + 1))
    if proc.returncode != 0:  # a timed-out job may leave ranks on the other hosts
        cluster.kill_all()
    stdout: dict[int, list[str]] = {}
    stderr: dict[int, list[str]] = {}
    _split_ranks(proc.stdout, stdout, prefixed=False)
    _split_ranks(proc.stderr, stderr, prefixed=True)
    return Result(cmd, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start,
                  ranks={r: "\n".join(v) + "\n" for r, v in sorted(stdout.items())},
                  rank_stderr={r: "\n".join(v) + "\n" for r, v in sorted(stderr.items())})


def cases(result: Result) -> dict[str, dict[int, dict[str, Any]]]:
    """The `CASE {...}` lines of every rank (tests/mpi/scripts/runtime_cases.py's format)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for line in result.stdout.splitlines():
        if "CASE {" in line:
            d = json.loads(line[line.index("CASE {") + 5:])
            out.setdefault(d["case"], {})[d["rank"]] = d
    return out

"""Cases for emulated hosts: `hostinfo` (where each rank runs, what it received), then the
reference-equality cases of tests/mpi/scripts/runtime_cases.py, all in one launch.

Usage (under `tfsmp run`): host_cases.py hostinfo [SPEC ...] — SPEC as in runtime_cases.py.
Every rank prints one `CASE {...}` JSON line per case.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "mpi" / "scripts"))

import runtime_cases

import tfsmp
from tfsmp.topology import select_gpu

PROBES = ("PATH", "PYTHONPATH", "TFSMP_PROBE", "SM_PROBE", "TF_NUM_INTRAOP_THREADS",
          "OMPI_ALLOW_RUN_AS_ROOT", "TMPDIR")


def hostinfo() -> dict[str, object]:
    """Host, local rank (tfsmp's and Open MPI's), GPU pick, stage, and the environment seen."""
    from mpi4py import MPI

    tfsmp.init()  # the launch's --config
    state = tfsmp.state()
    env = os.environ
    return {
        "ok": True, "hostname": socket.gethostname(), "processor": MPI.Get_processor_name(),
        "local_rank": tfsmp.local_rank(), "local_size": tfsmp.local_size(),
        "ompi_local_rank": int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", -1)),
        "ompi_local_size": int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", -1)),
        "ompi_node_rank": int(env.get("OMPI_COMM_WORLD_NODE_RANK", -1)),
        # What _pin_gpu would make visible with two GPUs per host.
        "gpu_of_two": select_gpu(tfsmp.local_rank(), 2, tfsmp.local_size()),
        "stage": state.pipeline_rank, "data_rank": state.data_rank,
        "placement": state.config.placement_strategy,
        "env": {name: env.get(name) for name in PROBES}, "python": sys.executable,
    }


def main(names: list[str]) -> None:
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if names[:1] == ["hostinfo"]:
        out = hostinfo()
        out.update(case="hostinfo", rank=rank, error=None)
        print("CASE " + json.dumps(out), flush=True)
        names = names[1:]
    runtime_cases.main(names)


if __name__ == "__main__":
    main(sys.argv[1:])

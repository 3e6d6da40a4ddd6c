"""`tfsmp doctor`: report the stack (TF, Keras, MPI, Horovod, cores) and check a 2-rank MPI job."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MPI_CHECK_SCRIPT", "mpi_check", "register", "run"]

# Runs on 2 ranks: a buffer send/recv both ways and an allreduce; rank 0 prints the verdict.
MPI_CHECK_SCRIPT = """\
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
out = np.full(1024, rank, dtype=np.float32)
got = np.empty_like(out)
comm.Sendrecv(out, dest=(rank + 1) % size, recvbuf=got, source=(rank - 1) % size)
total = np.array([rank + 1.0])
comm.Allreduce(MPI.IN_PLACE, total)
ok = got[0] == (rank - 1) % size and total[0] == size * (size + 1) / 2
oks = comm.gather(bool(ok), root=0)
if rank == 0:
    print("TFSMP_DOCTOR", "OK" if size == 2 and all(oks) else f"BAD size={size} oks={oks}")
"""


def _version(import_name: str, dist_name: str | None = None) -> str:
    try:
        module = __import__(import_name, fromlist=["_"])
    except Exception as e:
        return f"not importable ({type(e).__name__}: {e})"
    version = getattr(module, "__version__", None)
    if version is None:  # pymetis has no __version__; its distribution metadata does
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version(dist_name or import_name)
        except PackageNotFoundError:
            version = "unknown version"
    return str(version)


def _mpi_library() -> str:
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # the library version may be asked before MPI_Init
        from mpi4py import MPI

        return str(MPI.Get_library_version().splitlines()[0].split(",")[0].strip())
    except Exception as e:
        return f"not available ({type(e).__name__}: {e})"


def _tensorflow() -> tuple[str, str]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
    except Exception as e:
        return f"not importable ({type(e).__name__}: {e})", "unknown"
    gpus = tf.config.list_physical_devices("GPU")
    return str(tf.__version__), f"{len(gpus)} GPU(s)" if gpus else "none (CPU only)"


def _cores() -> str:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return f"{os.cpu_count()} (usable by this process: {affinity})"


def mpi_check(timeout: float = 60.0) -> tuple[bool, str]:
    """Launches a 2-rank send/recv + allreduce job under mpirun.

    Args:
        timeout: Seconds before the job counts as hung (its process group is killed).

    Returns:
        (passed, one-line detail).
    """
    from tfsmp.launch.mpirun import build_mpirun_command, find_mpirun, fresh_session

    try:
        mpirun = find_mpirun()
    except FileNotFoundError as e:
        return False, str(e)
    with tempfile.TemporaryDirectory(prefix="tfsmp-doctor-") as tmp:
        script = Path(tmp) / "mpi_check.py"
        script.write_text(MPI_CHECK_SCRIPT)
        argv = build_mpirun_command(2, [str(script)], mpirun=mpirun, tag_output=False)
        start = time.monotonic()
        proc = subprocess.Popen(fresh_session(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            return False, f"2-rank job hung for {timeout:.0f} s (killed): {' '.join(argv)}"
    elapsed = time.monotonic() - start
    if proc.returncode == 0 and "TFSMP_DOCTOR OK" in out:
        return True, f"2 ranks, send/recv + allreduce in {elapsed:.1f} s"
    tail = " | ".join(out.strip().splitlines()[-5:])
    return False, f"exit code {proc.returncode}: {tail}"


def _line(name: str, value: str) -> None:
    print(f"  {name:<12} {value}", flush=True)


def run(args: argparse.Namespace) -> int:
    """Entry point of `tfsmp doctor`; exit code 1 when the MPI check fails."""
    from tfsmp import __version__
    from tfsmp.launch.cmd_horovod import horovod_status
    from tfsmp.launch.mpirun import find_mpirun

    print(f"tfsmp {__version__} on Python {sys.version.split()[0]} ({sys.executable})")
    tf_version, gpus = _tensorflow()
    rows: list[tuple[str, Callable[[], str]]] = [
        ("TensorFlow", lambda: tf_version),
        ("Keras", lambda: _version("keras")),
        ("mpi4py", lambda: _version("mpi4py")),
        ("MPI library", _mpi_library),
        ("mpirun", lambda: _safe(find_mpirun)),
        ("pymetis", lambda: _version("pymetis")),
        ("Horovod", lambda: horovod_status().describe()),
        ("cores", _cores),
        ("GPUs", lambda: gpus),
    ]
    for name, value in rows:
        _line(name, value())
    if args.skip_mpi_check:
        return 0
    passed, detail = mpi_check(args.timeout)
    _line("MPI check", f"{'PASS' if passed else 'FAIL'}: {detail}")
    return 0 if passed else 1


def _safe(fn: Callable[[], Any]) -> str:
    try:
        return str(fn())
    except Exception as e:
        return f"not found ({e})"


def register(subparsers: Any) -> None:
    """Adds the `doctor` sub-command."""
    p = subparsers.add_parser("doctor", help="report versions and check that MPI works",
                              description=__doc__)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the 2-rank check")
    p.add_argument("--skip-mpi-check", action="store_true", help="only print versions")
    p.set_defaults(func=run)

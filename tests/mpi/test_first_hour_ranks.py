"""A new user's first hour under real launchers: one line per setup error, quiet ranks, the
estimator saying where the model went. Scripts without TensorFlow take a second or two a launch.
"""

from __future__ import annotations

import re
import tarfile
import warnings
from pathlib import Path
from typing import Any

import pytest
from mpihelp import SCRIPTS, run_mpi

from tfsmp import failure
from tfsmp.estimator import LOCAL_ROLE, TensorFlow
from tfsmp.launch.output import TF_STARTUP

pytestmark = pytest.mark.mpi

SCRIPT = SCRIPTS / "first_hour.py"
TYPO = ("ConfigError: Unknown parameter 'partitons' (did you mean 'partitions'?). Fix the name; "
        "every parameter is in docs/parameters.md.")


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_a_config_typo_under_tfsmp_run_prints_one_line_and_ends_promptly() -> None:
    res = run_mpi(2, [SCRIPT, "typo"], launcher="tfsmp", timeout=120)
    assert res.returncode != 0
    assert _lines(res.stdout + res.stderr) == [f"[1,0]<stderr>: [rank 0 | init] {TYPO}"], \
        res.describe()
    assert res.elapsed < failure.SETUP_GRACE, res.describe()  # rank 1 never had to speak


def test_a_config_typo_under_plain_mpirun_prints_one_tagged_line_without_traceback() -> None:
    res = run_mpi(2, [SCRIPT, "typo"], launcher="mpirun", mpi4py_module=False, timeout=120)
    assert res.returncode != 0
    assert [line for line in _lines(res.stderr) if "ConfigError" in line] == [
        f"[1,0]<stderr>: [rank 0 | init] {TYPO}"], res.describe()
    assert "Traceback" not in res.stdout + res.stderr


def test_an_error_of_one_rank_only_is_still_reported_by_that_rank() -> None:
    res = run_mpi(2, [SCRIPT, "rank1"], launcher="tfsmp", timeout=120)
    assert res.returncode != 0
    errors = [line for line in _lines(res.stderr) if "ConfigError" in line]
    assert errors == [f"[1,1]<stderr>: [rank 1 | init] {TYPO}"], res.describe()
    assert res.elapsed >= failure.SETUP_GRACE and "Traceback" not in res.stderr


def test_tensorflow_start_up_lines_show_only_when_asked_for() -> None:
    """Without --tf-logs the lines are gone (the README's main job checks that on the example,
    tests/mpi/test_keras_api.py); here they are asked for, and are there."""
    # oneDNN's notice is one of those lines; the test environment turns oneDNN off elsewhere.
    res = run_mpi(2, ["--tf-logs", SCRIPT, "tf"], launcher="tfsmp", timeout=180,
                  env={"TF_ENABLE_ONEDNN_OPTS": "1"})
    assert res.returncode == 0, res.describe()
    shown = [t for r in (0, 1) for t in res.rank_stderr.get(r, "").splitlines()
             if any(p.match(t) for p in TF_STARTUP)]
    assert len(shown) >= 2, res.describe()


# -- the estimator -----------------------------------------------------------------------------

JOB = '''
import os, sys
from mpi4py import MPI
rank = MPI.COMM_WORLD.rank
# what TensorFlow prints while it loads (the real lines; this script does not load TF)
print("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
      file=sys.stderr, flush=True)
where = os.environ["SM_MODEL_DIR"] if os.environ.get("SAVE_IN_MODEL_DIR") else "."
if rank == 0:
    with open(os.path.join(where, "model.txt"), "w") as f:
        f.write("weights")
print(f"rank {rank} trained", flush=True)
MPI.COMM_WORLD.Barrier()
'''


def _fit(tmp_path: Path, capsys: pytest.CaptureFixture[str], logs: Any,
         **env: str) -> tuple[TensorFlow, str, list[str]]:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text(JOB)
    est = TensorFlow(entry_point="train.py", source_dir=str(src), role=LOCAL_ROLE,
                     instance_count=1, instance_type="local", output_path=str(tmp_path / "jobs"),
                     distribution={"mpi": {"enabled": True, "processes_per_host": 2}},
                     environment={"OMPI_MCA_mpi_yield_when_idle": "1", **env})
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(logs=logs)
    return est, capsys.readouterr().out, [str(w.message) for w in caught]


def test_a_job_that_saves_elsewhere_warns_and_names_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    est, out, warned = _fit(tmp_path, capsys, logs=True)
    job = est.latest_training_job
    assert job is not None and job.status == "Completed"
    assert [w for w in warned if "SM_MODEL_DIR" in w] == [
        next(w for w in warned if w.startswith("The model directory must hold the model"))]
    assert f"The script wrote, under {job.job_dir}: code/model.txt." in warned[-1]
    assert out.rstrip().splitlines()[-3:] == [
        *[line for line in out.splitlines() if re.match(
            rf"tfsmp: training job {job.job_name} Completed in \d+\.\d s$", line)],
        f"tfsmp: model archive (estimator.model_data): {est.model_data} (empty)",
        f"tfsmp: every rank's output: {job.log_path}"]
    log = Path(job.log_path).read_text()
    assert "JOB MAP" in log and "absl::InitializeLog" in log   # the log keeps everything
    assert "JOB MAP" not in out and "absl::InitializeLog" not in out, out
    assert "rank 0 trained" in out and "rank 1 trained" in out


def test_a_job_that_saves_its_model_says_where_and_logs_all_shows_everything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    est, out, warned = _fit(tmp_path, capsys, logs="All", SAVE_IN_MODEL_DIR="1")
    assert not [w for w in warned if "SM_MODEL_DIR" in w], warned
    assert f"tfsmp: model archive (estimator.model_data): {est.model_data} (1 file: model.txt; " \
           "7 B)" in out
    with tarfile.open(est.model_data.removeprefix("file://")) as tar:
        assert tar.getnames() == ["model.txt"]
    assert "JOB MAP" in out and "absl::InitializeLog" in out

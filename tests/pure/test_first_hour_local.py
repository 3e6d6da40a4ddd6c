"""A new user's first hour, without MPI: one line per setup error, the output filter, the job's end.

Multi-rank launches of the same behaviour are in tests/mpi/test_first_hour_ranks.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfsmp import core, failure
from tfsmp.errors import ConfigError
from tfsmp.estimator import Failure, find_failure
from tfsmp.estimator.artifacts import (
    empty_model_message,
    end_lines,
    model_report,
    size_text,
    snapshot,
)
from tfsmp.launch.output import OutputFilter, tf_logs_wanted

REPO = Path(__file__).resolve().parents[2]
TAG0, TAG1 = "[1,0]<stderr>: ", "[1,1]<stderr>: "
TF_LINES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    "I0000 00:00:1796324574.838422   17310 port.cc:153] oneDNN custom operations are on. You may "
    "see slightly different numerical results due to floating-point round-off errors from "
    "different computation orders. To turn them off, set the environment variable "
    "`TF_ENABLE_ONEDNN_OPTS=0`.\n",
    "I0000 00:00:1796324574.888995   17310 cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.\n",
    "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.\n",
]
BOX = ["--------------------------------------------------------------------------\n",
       "prterun detected that one or more processes exited with non-zero status,\n",
       "thus causing the job to be terminated. The first process to do so was:\n", "\n",
       "   Process name: [prterun-vm-12257@1,0]\n", "   Exit code:    1\n",
       "--------------------------------------------------------------------------\n"]


def _through(keep: OutputFilter, lines: list[str]) -> list[str]:
    out = [shown for line in lines for shown in keep.feed(line)]
    return out + keep.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX", "HOROVOD_", "SM_HP", "TFSMP_"))}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


# -- setup errors ------------------------------------------------------------------------------

def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text("import sys\n" + body + "\nprint('not reached')\n")
    return path


def test_plain_python_with_partitions_says_how_to_launch_in_one_line(tmp_path: Path) -> None:
    script = _script(tmp_path, "import tfsmp as smp\nsmp.init({'partitions': 2})")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), "--epochs", "3"], capture_output=True,
                          text=True, env=_env(), timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "[rank 0 | init] ConfigError: world size must be a multiple of partitions (world size = "
        "partitions x data-parallel degree). Received: world_size=1, partitions=2: one process, "
        "started without an MPI launcher. Fix: launch 2 processes, e.g. "
        f"`tfsmp run -np 2 {script} --epochs 3` (or `mpirun -np 2 python {script} --epochs 3`)."]
    assert time.monotonic() - start < failure.SETUP_GRACE  # rank 0 does not wait


def test_tfsmp_debug_restores_the_traceback(tmp_path: Path) -> None:
    script = _script(tmp_path, "import tfsmp as smp\nsmp.init({'partitons': 2})")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=_env(TFSMP_DEBUG="1"), timeout=120, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Traceback (most recent call last):")
    assert proc.stderr.rstrip().endswith("ConfigError: Unknown parameter 'partitons' (did you "
                                         "mean 'partitions'?). Fix the name; every parameter "
                                         "is in docs/parameters.md.")


def test_horovod_true_without_a_build_names_the_command(tmp_path: Path) -> None:
    # sys.modules[name] = None is how Python spells "this module cannot be imported".
    script = _script(tmp_path, "sys.modules['horovod'] = None\nimport tfsmp as smp\n"
                               "smp.init({'horovod': True})")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=_env(), timeout=120, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "[rank 0 | init] ConfigError: horovod: True needs Horovod built with TensorFlow and MPI. "
        "Received: horovod=True, but `import horovod` fails. Fix: run `tfsmp install-horovod` "
        "(see docs/horovod.md), or set horovod: False."]


def test_a_caught_setup_error_is_an_ordinary_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SM_HP_MP_PARAMETERS", "TFSMP_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    core.shutdown()
    with pytest.raises(ConfigError, match=r"Fix: launch 2 processes, e\.g\. `tfsmp run -np 2 ") as info:
        core.init({"partitions": 2})
    assert info.value.__traceback__ is not None and not core.is_initialized()
    assert sys.excepthook is not sys.__excepthook__  # uncaught, it would print one line
    failure.uninstall()
    assert sys.excepthook is sys.__excepthook__


def test_debugging_and_launcher_rank_read_the_environment() -> None:
    assert not failure.debugging({}) and not failure.debugging({"TFSMP_DEBUG": "0"})
    assert failure.debugging({"TFSMP_DEBUG": "1"}) and failure.debugging({"TFSMP_DEBUG": "yes"})
    assert failure.launcher_rank({}) is None
    assert failure.launcher_rank({"OMPI_COMM_WORLD_RANK": "3"}) == 3
    assert failure.launcher_rank({"PMI_RANK": "2"}) == 2


# -- the output filter -----------------------------------------------------------------------------

def test_tensorflow_start_up_lines_are_dropped_tagged_or_not() -> None:
    user = [TAG0 + "epoch 1 done\n", TAG1 + "W0000 00:00:1.2 1 other.cc:1] a real warning\n"]
    lines = [TAG0 + t for t in TF_LINES] + user + TF_LINES
    keep = OutputFilter()
    assert _through(keep, lines) == user
    assert keep.dropped == 2 * len(TF_LINES)
    assert _through(OutputFilter(tf_logs=True), lines) == lines
    assert tf_logs_wanted({"TFSMP_TF_LOGS": "1"}) and not tf_logs_wanted({})


ABORT_BOXES = [
    BOX[0], "MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\n",
    "  Proc: [[8248,1],1]\n", "  Errorcode: 1\n", "\n",
    "NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.\n", BOX[0],
    BOX[0], "prterun has exited due to process rank 1 with PID 0 on node vm calling\n",
    "\"abort\". This may have caused other processes in the application to be\n", BOX[0]]
UNREACH = "[vm:17434] PMIX ERROR: PMIX_ERR_UNREACH in file /openmpi-5.0.11/3rd-party/x.c at 3\n"


def test_the_exit_box_is_dropped_only_after_a_rank_reported() -> None:
    error = TAG0 + "[rank 0 | init] ConfigError: Unknown parameter 'partitons'.\n"
    assert _through(OutputFilter(), [error, *BOX]) == [error]
    crash = TAG0 + "[rank 0 | pp_rank 0] StepError: waited more than stall_timeout=5.0s\n"
    assert _through(OutputFilter(), [crash, UNREACH, *BOX]) == [crash]
    assert _through(OutputFilter(), [crash, *ABORT_BOXES]) == [crash]
    untagged = TAG0 + "ValueError: boom\n"  # a script's own output: nothing said it yet
    assert _through(OutputFilter(), [untagged, UNREACH, *BOX]) == [untagged, UNREACH, *BOX]
    other_box = [BOX[0], "Some other Open MPI message\n", BOX[0]]
    assert _through(OutputFilter(), [error, *other_box]) == [error, *other_box]


def test_the_job_map_is_dropped_unless_asked_for() -> None:
    job_map = ["\n", "=================================   JOB MAP   =================================\n",
               "Data for JOB prterun-vm-13955@1 offset 0 Total slots allocated 2\n",
               "        Data for proc: [prterun-vm-13955@1,0]\n",
               "=============================================================\n"]
    after = [TAG0 + "rank 0 done\n"]
    assert _through(OutputFilter(job_map=False), job_map + after) == ["\n", *after]
    assert _through(OutputFilter(), job_map + after) == job_map + after


# -- the end of an estimator job -----------------------------------------------------------------

def test_an_empty_model_directory_names_what_the_script_wrote(tmp_path: Path) -> None:
    job = tmp_path / "job"
    for d in ("model", "code", "input/data/training", "output/data"):
        (job / d).mkdir(parents=True)
    (job / "code" / "train.py").write_text("print()\n")
    (job / "code" / "notes.txt").write_text("a")
    before = snapshot(str(job))  # when the job starts
    (job / "job.log").write_text("log\n")
    (job / "code" / "model.keras").write_bytes(b"k" * 10)
    (job / "code" / "notes.txt").write_text("ab")
    (job / "output" / "success").touch()
    report = model_report(str(job), str(job / "model"), before)
    assert report.empty and report.elsewhere == ["code/model.keras", "code/notes.txt"]
    text = empty_model_message(report, str(job), str(job / "model"))
    assert text.startswith("The model directory must hold the model: SageMaker archives only "
                           f"SM_MODEL_DIR. Received: {job}/model is empty, so model.tar.gz holds "
                           f"nothing. The script wrote, under {job}: code/model.keras, code/notes.txt. Fix: save "
                           "the model under os.environ['SM_MODEL_DIR']")


def test_end_lines_say_where_the_model_archive_is(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.keras").write_bytes(b"x" * 3000)
    report = model_report(str(tmp_path), str(tmp_path / "model"), {})
    assert not report.empty and report.elsewhere == []
    lines = end_lines("job-1", "Completed", 12.34, "file:///j/model.tar.gz", report, "/j/job.log")
    assert lines == ["tfsmp: training job job-1 Completed in 12.3 s",
                     "tfsmp: model archive (estimator.model_data): file:///j/model.tar.gz "
                     "(1 file: model.keras; 2.9 KB)",
                     "tfsmp: every rank's output: /j/job.log"]
    assert (size_text(10), size_text(5 << 20)) == ("10 B", "5.0 MB")


def test_a_jobs_failure_reason_is_its_setup_error_line() -> None:
    log = [f"{TAG0}[rank 0 | init] ConfigError: Unknown parameter 'partitons'.\n", *BOX]
    assert find_failure(log) == Failure(0, "ConfigError: Unknown parameter 'partitons'.", "")

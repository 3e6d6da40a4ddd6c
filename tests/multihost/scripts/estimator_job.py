"""Runs the estimator's `instance_count=2` job from the host this runs on (algo-1 in the tests).

Usage: estimator_job.py OUTPUT_DIR DATA_DIR SPECS — prints `JOB {...}` (status, job dir, log,
command) whatever the outcome.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tfsmp.estimator import TensorFlow, UnexpectedStatusException

HERE = Path(__file__).resolve().parent


def main(output: str, data: str, specs: str) -> None:
    est = TensorFlow(
        entry_point="sm_entry.py", source_dir=str(HERE / "estimator_src"), role="local",
        instance_count=2, instance_type="local", framework_version="2.21", py_version="py311",
        hyperparameters={"epochs": 3}, output_path=output,
        environment={"TFSMP_TEST_SCRIPTS": str(HERE.parents[1] / "mpi" / "scripts"),
                     "TFSMP_TEST_SPECS": specs, "TF_NUM_INTRAOP_THREADS": "1",
                     "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"},
        distribution={"smdistributed": {"modelparallel": {
                          "enabled": True, "parameters": {"partitions": 2}}},
                      "mpi": {"enabled": True, "processes_per_host": 1,
                              "custom_mpi_options": "--mca btl self,sm,tcp"}})
    error = None
    try:
        est.fit({"training": data}, logs=False, job_name="two-hosts")
    except UnexpectedStatusException as e:
        error = str(e)
    job = est.latest_training_job
    assert job is not None
    print("JOB " + json.dumps({"status": job.status, "error": error, "job_dir": job.job_dir,
                               "command": job.command, "model_data": job.model_data,
                               "log": Path(job.log_path).read_text()}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

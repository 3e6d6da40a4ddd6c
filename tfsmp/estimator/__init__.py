"""`TensorFlow` and `Estimator`: the SageMaker SDK's estimators, running the training job on this machine.

Example::

    from tfsmp.estimator import TensorFlow, get_execution_role

    est = TensorFlow(entry_point="train.py", source_dir="src", role=get_execution_role(),
                     instance_count=1, instance_type="local", framework_version="2.21",
                     py_version="py311",
                     distribution={"smdistributed": {"modelparallel": {
                                       "enabled": True, "parameters": {"partitions": 2}}},
                                   "mpi": {"enabled": True, "processes_per_host": 2}})
    est.fit({"training": "data/"})       # or "data/", or "file:///abs/data"
    est.model_data                       # 'file:///tmp/tfsmp-jobs/<job>/model.tar.gz'

The launcher code of the AWS model-parallel page runs with its imports changed to these. A job
directory mirrors a training container's /opt/ml (`input/config/*.json`, `input/data/<channel>`,
`model/`, `output/`, `checkpoints/`, `code/`) and stays for inspection, beside `job.log` (every
rank's output, tagged), `mpi_command.txt`, `hostfile`, `job.json` and, after the job, the
artifacts `model.tar.gz` and `output.tar.gz`. See docs/estimator.md.

One concept per module: `estimators.py` (the `Estimator` and `TensorFlow` classes),
`arguments.py` (which SDK arguments run here), `inputs.py` (local paths and channels), `plan.py`
(what a job runs, decided up front), `environment.py` (the variables its processes get),
`layout.py` (its /opt/ml on disk), `job.py` (running it: processes, relaunch, status, artifacts)
and `failure_report.py` (the failing rank in its log). The SageMaker contract they share, pure,
is `tfsmp.launch.sagemaker`.
"""

from tfsmp.estimator.estimators import LOCAL_ROLE, Estimator, TensorFlow, get_execution_role
from tfsmp.estimator.failure_report import Failure, find_failure
from tfsmp.estimator.inputs import resolve_channels
from tfsmp.estimator.job import LocalTrainingJob, UnexpectedStatusException

__all__ = ["LOCAL_ROLE", "Estimator", "Failure", "LocalTrainingJob", "TensorFlow",
           "UnexpectedStatusException", "find_failure", "get_execution_role", "resolve_channels"]

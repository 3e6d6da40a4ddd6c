"""The environment a job's processes get: the container's `SM_*` variables, paths and checkpoints."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfsmp.estimator.inputs import local_path
from tfsmp.launch import sagemaker as sm

if TYPE_CHECKING:
    from tfsmp.estimator.estimators import Estimator

__all__ = ["checkpoint_dir", "job_environment"]


def _tfsmp_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def job_environment(est: Estimator, paths: sm.JobPaths, hosts: list[str], hps: dict[str, Any],
                    channels: Mapping[str, Path], entry: str, submit: str, name: str, *,
                    current_host: str | None = None,
                    network_interface: str = "lo") -> dict[str, str]:
    """The variables of one host's processes: the launcher's, less its SageMaker ones, then the job's."""
    # The job's SageMaker variables and config are its own, never the launcher's.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SM_") and k != "TFSMP_CONFIG"}
    env.update(est.environment)
    env.update(sm.job_env(paths=paths, hosts=hosts, current_host=current_host or hosts[0],
                          hyperparameters=hps, channels=list(channels),
                          resources=est.resources, entry_point=entry, module_dir=submit,
                          job_name=name, network_interface=network_interface))
    env.update({
        "SAGEMAKER_BASE_DIR": paths.base,
        "TFSMP_CHECKPOINT_DIR": checkpoint_dir(est, paths),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (paths.code, _tfsmp_root(),
                                                  env.get("PYTHONPATH", "")) if p),
    })
    return env


def checkpoint_dir(est: Estimator, paths: sm.JobPaths) -> str:
    """Where the job's checkpoints go (`TFSMP_CHECKPOINT_DIR`), from checkpoint_s3_uri/local_path."""
    if est.checkpoint_s3_uri is not None:  # a local "S3" location: use it in place
        return str(local_path(est.checkpoint_s3_uri, "checkpoint_s3_uri"))
    path = est.checkpoint_local_path
    if path is None or path.rstrip("/") == "/opt/ml/checkpoints":
        return paths.checkpoints
    if path.startswith("/opt/ml/"):
        return os.path.join(paths.base, path[len("/opt/ml/"):])
    return str(Path(path).expanduser().resolve())

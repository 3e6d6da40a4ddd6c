"""The SDK's `Estimator` and `TensorFlow` classes, running the training job on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tfsmp.errors import ConfigError
from tfsmp.estimator import retry
from tfsmp.estimator.arguments import (
    check_kwargs,
    checked_instance_count,
    output_root,
    resolve_entry_point,
)
from tfsmp.estimator.inputs import existing_path, local_path
from tfsmp.estimator.job import LocalTrainingJob
from tfsmp.estimator.layout import materialize
from tfsmp.estimator.plan import plan_job
from tfsmp.launch import sagemaker as sm

__all__ = ["LOCAL_ROLE", "Estimator", "TensorFlow", "get_execution_role"]

LOCAL_ROLE = "arn:aws:iam::000000000000:role/tfsmp-local"


def get_execution_role(sagemaker_session: Any = None, use_default: bool = False) -> str:
    """A placeholder IAM role ARN: a local job assumes no role. Accepts the SDK's arguments."""
    return LOCAL_ROLE


def _local_gpus() -> int:
    """GPUs as the training toolkit counts them (`nvidia-smi --list-gpus`)."""
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


class Estimator:
    """The SDK's generic `Estimator` (script mode), running the job on this machine.

    Example::

        est = Estimator(entry_point="train.py", role=get_execution_role(),
                        instance_type="ml.p3.16xlarge", instance_count=1,
                        image_uri="123.dkr.ecr.us-west-2.amazonaws.com/tf:latest",
                        distribution={"smdistributed": {"modelparallel": smp_options},
                                      "mpi": mpi_options})
        est.fit("file:///data/train")
    """

    default_base_name = "training-job"

    def __init__(self, image_uri: str | None = None, role: str | None = None,
                 instance_count: int | None = None, instance_type: str | None = None, *,
                 entry_point: str | os.PathLike[str] | None = None,
                 source_dir: str | os.PathLike[str] | None = None,
                 hyperparameters: Mapping[str, Any] | None = None,
                 distribution: Mapping[str, Any] | None = None,
                 base_job_name: str | None = None, sagemaker_session: Any = None,
                 output_path: str | None = None, checkpoint_local_path: str | None = None,
                 checkpoint_s3_uri: str | None = None,
                 environment: Mapping[str, str] | None = None,
                 dependencies: Sequence[str | os.PathLike[str]] | None = None,
                 max_run: float = 24 * 60 * 60, model_uri: str | None = None,
                 model_channel_name: str = "model", input_mode: str = "File",
                 disable_output_compression: bool = False,
                 max_retry_attempts: int | None = None, **kwargs: Any) -> None:
        kwargs = check_kwargs(kwargs)
        instance_count = kwargs.pop("instance_count", instance_count)
        instance_type = kwargs.pop("instance_type", instance_type)
        image_uri = kwargs.pop("image_uri", image_uri)
        distribution = kwargs.pop("distribution", distribution)
        max_run = kwargs.pop("max_run", max_run)
        self.image_uri, self.role, self.sagemaker_session = image_uri, role, sagemaker_session
        self.instance_count = checked_instance_count(instance_count)
        self.instance_type = instance_type
        self.resources = sm.instance_resources(instance_type, local_gpus=_local_gpus(),
                                               local_cpus=os.cpu_count() or 1)
        self.entry_point, self.source_dir = resolve_entry_point(entry_point, source_dir)
        self.dependencies = [existing_path(d, "dependencies") for d in dependencies or ()]
        self._hyperparameters = dict(hyperparameters or {})
        self.distribution = sm.resolve_distribution(distribution, instance_count=self.instance_count,
                                                    resources=self.resources)
        for text in self.distribution.warnings:
            warnings.warn(text, UserWarning, stacklevel=2)
        self.base_job_name = base_job_name
        self.output_path = output_root(output_path)
        self.checkpoint_local_path = checkpoint_local_path
        if checkpoint_s3_uri is not None:
            local_path(checkpoint_s3_uri, "checkpoint_s3_uri")  # s3:// is refused
        self.checkpoint_s3_uri = checkpoint_s3_uri
        self.environment = {str(k): str(v) for k, v in (environment or {}).items()}
        self.max_run = float(max_run)
        self.model_uri, self.model_channel_name = model_uri, model_channel_name
        if input_mode == "Pipe":
            raise ConfigError("input_mode='Pipe' streams S3 data through named pipes, which a "
                              "local job cannot emulate. Received: input_mode='Pipe'. Use 'File'.")
        self.disable_output_compression = disable_output_compression
        # [Note: retry strategy] in tfsmp/estimator/retry.py
        self.max_retry_attempts = retry.check_retry_attempts(max_retry_attempts)
        if image_uri is not None:
            warnings.warn(f"image_uri={image_uri!r} is not pulled: the job runs in this Python "
                          f"environment ({sys.executable}). examples/docker/Dockerfile builds an "
                          "image with tfsmp.", UserWarning, stacklevel=2)
        self.latest_training_job: LocalTrainingJob | None = None
        self._current_job_name: str | None = None

    def hyperparameters(self) -> dict[str, Any]:
        """The hyperparameters the job gets, decoded (the SDK returns them JSON-encoded)."""
        hps = dict(self._hyperparameters)
        hps.update(sm.distribution_hyperparameters(self.distribution, self.instance_type))
        return hps

    def framework_hyperparameters(self, paths: sm.JobPaths) -> dict[str, Any]:
        """The hyperparameters the framework adds to every job (`plan_job` asks for them)."""
        return {}

    # -- running -----------------------------------------------------------------------------

    def mpi_command(self, inputs: Any = None, job_name: str | None = None) -> list[str]:
        """The mpirun argv of the latest job, or of a job `fit(inputs, job_name=...)` would run.

        Raises:
            ConfigError: MPI is not enabled in `distribution` (the job runs `python script`).
        """
        if not self.distribution.mpi_enabled:
            raise ConfigError("mpi_command() needs distribution={'mpi': {'enabled': True, ...}}. "
                              f"Received: distribution={dict(self.distribution.raw)!r}: the job "
                              "runs the entry point with plain python, once per host.")
        if inputs is None and job_name is None and self.latest_training_job is not None:
            return list(self.latest_training_job.command)
        return plan_job(self, inputs, job_name).commands[0]

    def fit(self, inputs: Any = None, wait: bool = True, logs: bool | str = True,
            job_name: str | None = None, experiment_config: Any = None) -> None:
        """Runs the training job on this machine (the SDK's `fit`).

        Args:
            inputs: A local path or file:// URI (the channel "training"), a dict of channel name
                to path/URI, or None. S3 URIs are errors.
            wait: Block until the job ends (else see `latest_training_job.wait()`).
            logs: Print the job's output as it runs (True), and at the end where the model
                archive is. "All" (the SDK's value) also shows mpirun's job map and TensorFlow's
                start-up lines, which job.log always has.
            job_name: The job name (default: base_job_name plus a timestamp).
            experiment_config: Accepted and ignored (SageMaker Experiments).

        Raises:
            ConfigError: An input or argument cannot be used on this machine.
            UnexpectedStatusException: The job failed (after `wait`).
        """
        plan = plan_job(self, inputs, job_name)
        materialize(self, plan)
        echo = logs not in (False, "None") and wait
        job = LocalTrainingJob(plan, self.max_run, self.output_path,
                               compress=not self.disable_output_compression,
                               max_retry_attempts=self.max_retry_attempts)
        self.latest_training_job, self._current_job_name = job, plan.name
        job.show_all = logs == "All"
        if echo:
            print(f"tfsmp: training job {plan.name} in {plan.paths.base}", flush=True)
        job.start(echo)
        if wait:
            job.wait(logs=echo)

    # -- results -----------------------------------------------------------------------------

    @property
    def model_data(self) -> str | None:
        """`file://…/model.tar.gz` of the latest job (None before a job has finished)."""
        job = self.latest_training_job
        return job.model_data if job is not None else None

    @property
    def job_dir(self) -> str | None:
        """The latest job's directory (its /opt/ml)."""
        job = self.latest_training_job
        return job.job_dir if job is not None else None

    def logs(self) -> str:
        """The latest job's whole log."""
        if self.latest_training_job is None:
            raise ConfigError("logs() needs a job: call fit() first.")
        return Path(self.latest_training_job.log_path).read_text(encoding="utf-8")


class TensorFlow(Estimator):
    """The SDK's `sagemaker.tensorflow.TensorFlow` estimator, running the job on this machine.

    Example::

        est = TensorFlow(entry_point="train.py", source_dir="src", role=get_execution_role(),
                         instance_count=1, instance_type="ml.p3.16xlarge",
                         framework_version="2.6.3", py_version="py38",
                         distribution={"smdistributed": {"modelparallel": smp_options},
                                       "mpi": mpi_options},
                         base_job_name="SMD-MP-demo")
        est.fit({"training": "data/"})
    """

    default_base_name = "tensorflow-training"

    def __init__(self, py_version: str | None = None, framework_version: str | None = None,
                 model_dir: str | bool | None = None, image_uri: str | None = None,
                 distribution: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if "entry_point" not in kwargs:
            raise TypeError("TensorFlow() needs entry_point: the training script.")
        super().__init__(image_uri=image_uri, distribution=distribution, **kwargs)
        # [Note: versions] The SDK needs framework_version and py_version (or image_uri) to pick
        # the image a job runs in, as its local mode does to pick the container it starts. Here
        # the job runs in this Python environment, so that is what they default to; values that
        # name another image get one warning, since the job cannot run them.
        have_tf, have_py = local_versions()
        self.framework_version = framework_version or have_tf
        self.py_version = py_version or have_py
        if model_dir is not None and model_dir is not False:
            local_path(model_dir, "model_dir")  # s3:// is refused
        self.model_dir = model_dir
        if image_uri is None:
            _warn_versions(framework_version, py_version, have_tf, have_py)

    def framework_hyperparameters(self, paths: sm.JobPaths) -> dict[str, Any]:
        # The SDK passes model_dir=/opt/ml/model for MPI jobs; here /opt/ml is the job directory.
        if self.model_dir is False:
            return {}
        return {"model_dir": str(self.model_dir) if self.model_dir else paths.model}


def local_versions() -> tuple[str, str]:
    """(TensorFlow's major.minor, `pyXY`) of this Python environment: the job's "image"."""
    from importlib import metadata

    tf = next((metadata.version(d) for d in ("tensorflow", "tensorflow-cpu") if _installed(d)),
              "none")
    return ".".join(tf.split(".")[:2]), f"py{sys.version_info.major}{sys.version_info.minor}"


def _warn_versions(framework_version: str | None, py_version: str | None, have_tf: str,
                   have_py: str) -> None:
    """One warning when the given versions name another image than this environment."""
    other = []
    if framework_version and not (have_tf + ".").startswith(
            ".".join(framework_version.split(".")[:2]) + "."):
        other.append(f"framework_version={framework_version!r} (here: {have_tf})")
    if py_version and py_version not in (have_py, "py3"):
        other.append(f"py_version={py_version!r} (here: {have_py})")
    if other:
        warnings.warn(f"The job runs in this Python environment: {', '.join(other)}. Omit "
                      "framework_version and py_version to use this environment's, as tfsmp "
                      "does by default.", UserWarning, stacklevel=3)


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True

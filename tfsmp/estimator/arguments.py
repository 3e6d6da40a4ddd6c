"""The SDK's estimator arguments: which run here, which are ignored or refused, and their checks."""

from __future__ import annotations

import datetime
import os
import re
import tempfile
import warnings
from typing import Any

from tfsmp.errors import ConfigError, did_you_mean
from tfsmp.estimator.inputs import existing_path, local_path

__all__ = ["check_kwargs"]

# SDK arguments that only shape the cloud job (cost, network, encryption, monitoring, where code is
# uploaded); locally they change nothing about the result, so they are accepted and ignored.
_IGNORED = frozenset({
    "keep_alive_period_in_seconds", "volume_size", "volume_kms_key", "output_kms_key", "tags",
    "subnets", "security_group_ids", "metric_definitions", "encrypt_inter_container_traffic",
    "use_spot_instances", "max_wait", "rules", "debugger_hook_config",
    "tensorboard_output_config", "enable_sagemaker_metrics", "profiler_config",
    "disable_profiler", "container_log_level", "code_location",
    "enable_network_isolation", "enable_infra_check", "enable_remote_debug",
    "enable_session_tag_chaining", "training_plan", "compiler_config", "script_mode",
    "training_repository_credentials_provider_arn",
})
# SDK arguments whose cloud behaviour would change what runs or what it reads.
_REJECTED = {
    "git_config": "clones the training code from a Git repository; clone it yourself and pass "
                  "source_dir",
    "instance_groups": "describes a heterogeneous cluster; use instance_count and instance_type",
    "container_entry_point": "replaces the image's entry point; put the command in entry_point",
    "container_arguments": "passes arguments to the image's entry point; use hyperparameters",
    "training_repository_access_mode": "pulls the image from a private registry; the job runs "
                                       "in this Python environment",
}
# Names the SDK v1 used, which SDK v2 still maps with a warning.
_RENAMED = {"train_instance_count": "instance_count", "train_instance_type": "instance_type",
            "train_max_run": "max_run", "image_name": "image_uri",
            "distributions": "distribution", "train_volume_size": "volume_size",
            "train_use_spot_instances": "use_spot_instances", "train_max_wait": "max_wait"}
_JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")


def check_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with SDK v1 names renamed; refused and unknown arguments are errors."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in _RENAMED:
            warnings.warn(f"{key} was renamed {_RENAMED[key]} in SageMaker SDK v2.",
                          DeprecationWarning, stacklevel=3)
            out[_RENAMED[key]] = value
        elif key in _REJECTED:
            raise ConfigError(f"{key} cannot run on this machine: it {_REJECTED[key]}. "
                              f"Received: {key}={value!r}.")
        elif key not in _IGNORED:
            hint = did_you_mean(key, [*_IGNORED, *_REJECTED, *_RENAMED])
            raise TypeError(f"Estimator got an unexpected keyword argument {key!r}.{hint}")
    return out


def resolve_job_name(base: str, job_name: str | None) -> str:
    if job_name is None:
        now = datetime.datetime.now()
        stamp = now.strftime("%Y-%m-%d-%H-%M-%S-") + f"{now.microsecond // 1000:03d}"
        job_name = f"{base[:63 - len(stamp) - 1]}-{stamp}"
    if not _JOB_NAME.match(job_name):
        raise ConfigError(
            "job_name must be 1-63 letters, digits or hyphens, starting and ending with a letter "
            f"or digit (SageMaker's rule). Received: job_name={job_name!r}.")
    return job_name


def checked_instance_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"instance_count must be a positive integer. Received: "
                          f"instance_count={value!r}. Pass e.g. instance_count=1.")
    return value


def resolve_entry_point(entry_point: Any, source_dir: Any) -> tuple[str, str | None]:
    """(entry point, source dir): relative to the source dir if given, else an absolute path."""
    if entry_point is None:
        raise ConfigError("entry_point must name the training script: a local job cannot run an "
                          "image's own entry point. Received: entry_point=None.")
    entry = os.fspath(entry_point)
    if source_dir is None:
        return str(existing_path(entry, "entry_point")), None
    src = existing_path(source_dir, "source_dir")
    if not src.is_dir():
        raise ConfigError(f"source_dir must be a local directory. Received: source_dir={source_dir!r}.")
    if not (src / entry).is_file():
        raise ConfigError(f'No file named "{entry}" was found in directory "{source_dir}".')
    return entry, str(src)


def output_root(output_path: str | None) -> str:
    if output_path is None:  # [Note: private temp folders] in tfsmp/tempdirs.py
        from tfsmp.tempdirs import private_dir

        return private_dir(os.path.join(tempfile.gettempdir(), "tfsmp-jobs"))
    return str(local_path(output_path, "output_path"))

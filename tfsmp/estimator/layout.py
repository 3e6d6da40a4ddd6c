"""The job directory on disk: a container's /opt/ml per host, code, channels, config, artifacts."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfsmp.errors import ConfigError
from tfsmp.estimator.environment import checkpoint_dir
from tfsmp.estimator.plan import JobPlan
from tfsmp.launch import sagemaker as sm

if TYPE_CHECKING:
    from tfsmp.estimator.estimators import Estimator

__all__ = ["materialize"]


def materialize(est: Estimator, plan: JobPlan) -> None:
    """Writes the job directory of `plan`: every host's /opt/ml, the code, mpi_command.txt, hostfile."""
    paths = plan.paths
    try:
        os.makedirs(paths.base)
    except FileExistsError:
        raise ConfigError(f"job names must be unique: {paths.base} already exists. Received: "
                          f"job_name={plan.name!r}. Pick another job_name, or remove that "
                          "directory.") from None
    for d in (paths.input_config, paths.input_data, paths.model, paths.output_data,
              paths.output_intermediate, checkpoint_dir(est, paths)):
        os.makedirs(d, exist_ok=True)
    _copy_code(est, paths)
    for host, host_paths in zip(plan.hosts, plan.host_paths or [paths]):
        _materialize_host(est, plan, host, host_paths)
    Path(paths.base, "mpi_command.txt").write_text(
        "".join(sm.format_command(c) for c in plan.commands))
    if plan.mpi and not plan.host_paths:
        Path(paths.hostfile).write_text(
            sm.hostfile_text(plan.hosts, est.distribution.processes_per_host))

def _materialize_host(est: Estimator, plan: JobPlan, host: str, paths: sm.JobPaths) -> None:
    """One host's /opt/ml: config files, channels, model/ and output/ (code is shared)."""
    if paths != plan.paths:
        for d in (paths.input_config, paths.input_data, paths.model, paths.output_data,
                  paths.output_intermediate):
            os.makedirs(d, exist_ok=True)
        os.symlink(plan.paths.code, paths.code)
    for name, src in plan.channels.items():
        _link_channel(src, paths.channel(name))
    write_json(os.path.join(paths.input_config, "hyperparameters.json"),
                sm.encode_hyperparameters(plan.hyperparameters))
    write_json(os.path.join(paths.input_config, "inputdataconfig.json"),
                sm.input_data_config(list(plan.channels)))
    write_json(os.path.join(paths.input_config, "resourceconfig.json"),
                sm.resource_config(plan.hosts, host, est.resources.instance_type,
                                   plan.network_interface))

def _copy_code(est: Estimator, paths: sm.JobPaths) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".git")
    if est.source_dir:
        shutil.copytree(est.source_dir, paths.code, ignore=ignore)
    else:
        os.makedirs(paths.code)
        shutil.copy2(est.entry_point, paths.code)
    for dep in est.dependencies:
        target = os.path.join(paths.code, dep.name)
        if dep.is_dir():
            shutil.copytree(dep, target, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copy2(dep, target)


def _link_channel(src: Path, dest: str) -> None:
    """Mounts a channel as SageMaker local mode does: the directory itself, or a file inside one."""
    if src.is_dir():
        os.symlink(src, dest, target_is_directory=True)
    else:
        os.makedirs(dest)
        os.symlink(src, os.path.join(dest, src.name))


def archive_dir(src: str, dest: str) -> None:
    """A .tar.gz of the contents of `src` at the archive root (SageMaker's model.tar.gz layout)."""
    with tarfile.open(dest, "w:gz") as tar:
        for child in sorted(os.listdir(src)):
            tar.add(os.path.join(src, child), arcname=child)


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")

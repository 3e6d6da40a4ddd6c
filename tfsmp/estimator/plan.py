"""A job's plan: its name, hosts, channels, hyperparameters, environment and commands, decided up front."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfsmp.errors import ConfigError
from tfsmp.estimator.arguments import resolve_job_name
from tfsmp.estimator.environment import job_environment
from tfsmp.estimator.inputs import resolve_channels
from tfsmp.launch import sagemaker as sm
from tfsmp.launch.hosts import default_interface, parse_hosts
from tfsmp.launch.mpirun import find_mpirun, is_root

if TYPE_CHECKING:
    from tfsmp.estimator.estimators import Estimator

__all__ = ["plan_job"]


@dataclass
class JobPlan:
    """Everything a job needs, decided before anything is written."""

    name: str
    paths: sm.JobPaths
    hosts: list[str]
    channels: dict[str, Path]
    hyperparameters: dict[str, Any]
    env: dict[str, str]
    commands: list[list[str]]        # one mpirun, or one plain command per host
    host_env: list[dict[str, str]]   # per command: what differs (SM_CURRENT_HOST)
    mpi: bool
    # Across machines: every host's /opt/ml (the first is `paths`). [Note: hosts across machines]
    host_paths: list[sm.JobPaths] = field(default_factory=list)
    network_interface: str = "lo"


def plan_job(est: Estimator, inputs: Any, job_name: str | None) -> JobPlan:
    """The plan of the job `fit(inputs, job_name=...)` runs; nothing is written yet."""
    name = resolve_job_name(est.base_job_name or est.default_base_name, job_name)
    paths = sm.JobPaths(os.path.join(est.output_path, name))
    channels = resolve_channels(inputs, est.model_uri, est.model_channel_name)
    entry = est.entry_point if est.source_dir else os.path.basename(est.entry_point)
    submit = f"file://{est.source_dir or os.path.dirname(est.entry_point)}"
    hps = {**est.hyperparameters(), **est.framework_hyperparameters(paths),
           "sagemaker_program": entry, "sagemaker_submit_directory": submit,
           "sagemaker_container_log_level": 20, "sagemaker_job_name": name}
    hosts = sm.host_names(est.instance_count)
    if _across_hosts(est, hosts):
        return _plan_across_hosts(est, name, paths, hosts, channels, hps, entry, submit)
    env = job_environment(est, paths, hosts, hps, channels, entry, submit, name)
    user, _ = sm.split_hyperparameters(hps)
    entry_argv = [entry, *sm.to_cmd_args(user)]
    python = sys.executable if entry.endswith(".py") else "/bin/sh"
    if est.distribution.mpi_enabled:
        commands = [_mpirun(est, paths, hosts, env, entry_argv, python)]
        host_env: list[dict[str, str]] = [{}]
    else:
        prefix = [python] if python == "/bin/sh" else [python, "-u"]
        commands = [[*prefix, *entry_argv] for _ in hosts]
        host_env = [{"SM_CURRENT_HOST": host} for host in hosts]
    return JobPlan(name, paths, hosts, channels, hps, env, commands, host_env,
                 est.distribution.mpi_enabled)

def _across_hosts(est: Estimator, hosts: list[str]) -> bool:
    across = sm.runs_across_hosts(hosts, setting=os.environ.get(sm.HOSTS_SETTING),
                                  hostname=socket.gethostname(), resolve=_resolve)
    if across and not est.distribution.mpi_enabled:
        raise ConfigError(
            f"a job across hosts runs under mpirun from {hosts[0]}. Received: "
            f"instance_count={len(hosts)} without distribution={{'mpi': {{'enabled': True}}}}."
            f" Fix: enable mpi (or smdistributed modelparallel), or set "
            f"{sm.HOSTS_SETTING}=local to run every host's process on this machine.")
    return across

def _plan_across_hosts(est: Estimator, name: str, paths: sm.JobPaths, hosts: list[str],
                       channels: dict[str, Path], hps: dict[str, Any], entry: str,
                       submit: str) -> JobPlan:
    """One mpirun from algo-1 over `--host algo-1:N,...`. [Note: hosts across machines]"""
    ppn = est.distribution.processes_per_host
    iface = os.environ.get("SM_NETWORK_INTERFACE_NAME") or default_interface(
        parse_hosts(hosts)) or "eth0"
    host_paths = [paths, *(sm.JobPaths(os.path.join(paths.base, "hosts", h))
                           for h in hosts[1:])]
    envs = [job_environment(est, p, hosts, hps, channels, entry, submit, name, current_host=h,
                            network_interface=iface) for h, p in zip(hosts, host_paths)]
    env = envs[0]
    for e in envs[1:]:  # one checkpoint directory for the job, which every rank writes to
        e["TFSMP_CHECKPOINT_DIR"] = env["TFSMP_CHECKPOINT_DIR"]
    # The names whose values differ between hosts; every host's app context sets all of them.
    names = {"SM_CURRENT_HOST", *(k for e in envs for k, v in e.items() if env.get(k) != v)}
    per_host = [{k: e[k] for k in sorted(names) if k in e} for e in envs]
    exported = sm.exported_names(env, [*sm.JOB_VARIABLES, *sorted(est.environment)],
                                 per_host=names)
    user, _ = sm.split_hyperparameters(hps)
    python = sys.executable if entry.endswith(".py") else "/bin/sh"
    command = sm.toolkit_mpirun_command(
        hosts=hosts, processes_per_host=ppn, entry_argv=[entry, *sm.to_cmd_args(user)],
        exported=exported, custom_mpi_options=est.distribution.custom_mpi_options,
        instance_type=est.resources.instance_type, hostfile=paths.hostfile, python=python,
        mpirun=find_mpirun(), as_root=is_root(),
        has_ld_library_path=bool(env.get("LD_LIBRARY_PATH")), network_interface=iface,
        use_mpi4py_module=python != "/bin/sh", host_env=per_host,
        host_list=",".join(f"{h}:{ppn}" for h in hosts), tcp_interface=iface)
    return JobPlan(name, paths, hosts, channels, hps, env, [command], [{}], True,
                 host_paths, iface)


def _mpirun(est: Estimator, paths: sm.JobPaths, hosts: list[str], env: Mapping[str, str],
            entry_argv: list[str], python: str) -> list[str]:
    exported = sm.exported_names(env, [*sm.JOB_VARIABLES, *sorted(est.environment)])
    return sm.toolkit_mpirun_command(
        hosts=hosts, processes_per_host=est.distribution.processes_per_host,
        entry_argv=entry_argv, exported=exported,
        custom_mpi_options=est.distribution.custom_mpi_options,
        instance_type=est.resources.instance_type, hostfile=paths.hostfile, python=python,
        mpirun=find_mpirun(), as_root=is_root(),
        has_ld_library_path=bool(env.get("LD_LIBRARY_PATH")),
        use_mpi4py_module=python != "/bin/sh")


def _resolve(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None

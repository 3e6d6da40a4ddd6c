"""What a training container gives the script: resourceconfig.json, inputdataconfig.json, `SM_*`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tfsmp.launch.sagemaker.hyperparameters import split_hyperparameters, to_cmd_args, to_env_vars
from tfsmp.launch.sagemaker.instances import Resources
from tfsmp.launch.sagemaker.layout import JobPaths

__all__ = ["input_data_config", "job_env", "resource_config"]


def resource_config(hosts: Sequence[str], current_host: str, instance_type: str,
                    network_interface: str) -> dict[str, Any]:
    """resourceconfig.json of one host (SageMaker's format, one homogeneous instance group)."""
    return {
        "current_host": current_host,
        "current_instance_type": instance_type,
        "current_group_name": "homogeneousCluster",
        "hosts": list(hosts),
        "instance_groups": [{"instance_group_name": "homogeneousCluster",
                             "instance_type": instance_type, "hosts": list(hosts)}],
        "network_interface_name": network_interface,
    }


def input_data_config(channels: Sequence[str]) -> dict[str, Any]:
    """inputdataconfig.json: every channel in File mode, fully replicated."""
    return {name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
                   "RecordWrapperType": "None"} for name in channels}


def _training_env(paths: JobPaths, hosts: Sequence[str], current_host: str, hps: Mapping[str, Any],
                  channels: Sequence[str], resources: Resources, entry_point: str,
                  module_dir: str, job_name: str, network_interface: str,
                  log_level: int) -> dict[str, Any]:
    """The toolkit's `Environment` as a dict (SM_TRAINING_ENV), less the Python-only entries."""
    user, framework = split_hyperparameters(hps)
    distributed = [] if not (framework.get("sagemaker_mpi_enabled") or
                             "mp_parameters" in user) else ["homogeneousCluster"]
    group = {"instance_group_name": "homogeneousCluster",
             "instance_type": resources.instance_type, "hosts": list(hosts)}
    return {
        "additional_framework_parameters": framework,
        "channel_input_dirs": {name: paths.channel(name) for name in channels},
        "current_host": current_host,
        "current_instance_group": "homogeneousCluster",
        "current_instance_group_hosts": list(hosts),
        "current_instance_type": resources.instance_type,
        "distribution_hosts": list(hosts) if distributed else [],
        "distribution_instance_groups": distributed,
        "framework_module": None,
        "hosts": list(hosts),
        "hyperparameters": user,
        "input_config_dir": paths.input_config,
        "input_data_config": input_data_config(channels),
        "input_dir": paths.input,
        "instance_groups": ["homogeneousCluster"],
        "instance_groups_dict": {"homogeneousCluster": group},
        "is_hetero": False,
        "is_master": current_host == hosts[0],
        "is_modelparallel_enabled": "mp_parameters" in user,
        "job_name": job_name,
        "log_level": log_level,
        "master_hostname": hosts[0],
        "model_dir": paths.model,
        "module_dir": module_dir,
        "module_name": entry_point[:-3] if entry_point.endswith(".py") else entry_point,
        "network_interface_name": network_interface,
        "num_cpus": resources.num_cpus,
        "num_gpus": resources.num_gpus,
        "num_neurons": 0,
        "output_data_dir": paths.output_data,
        "output_dir": paths.output,
        "output_intermediate_dir": paths.output_intermediate,
        "resource_config": resource_config(hosts, current_host, resources.instance_type,
                                           network_interface),
        "user_entry_point": entry_point,
    }


def job_env(*, paths: JobPaths, hosts: Sequence[str], current_host: str,
            hyperparameters: Mapping[str, Any], channels: Sequence[str], resources: Resources,
            entry_point: str, module_dir: str, job_name: str, network_interface: str = "lo",
            log_level: int = 20) -> dict[str, str]:
    """The `SM_*` variables the toolkit gives the script (`Environment.to_env_vars`) on one host.

    Args:
        paths: The job directory.
        hosts: All host names (algo-1 ...).
        current_host: This host.
        hyperparameters: Decoded hyperparameters, `sagemaker_*` ones included.
        channels: Input channel names.
        resources: What the host reports.
        entry_point: The script, relative to the code directory.
        module_dir: Where the code came from (`sagemaker_submit_directory`).
        job_name: The training job name.
        network_interface: `SM_NETWORK_INTERFACE_NAME` ("lo": every emulated host is this machine).
        log_level: `SM_LOG_LEVEL`.

    Returns:
        Variable name -> value.
    """
    env = _training_env(paths, hosts, current_host, hyperparameters, channels, resources,
                        entry_point, module_dir, job_name, network_interface, log_level)
    user = env["hyperparameters"]
    mapping: dict[str, Any] = {
        key: env[key] for key in (
            "hosts", "network_interface_name", "user_entry_point", "resource_config",
            "input_data_config", "output_data_dir", "current_host", "current_instance_type",
            "current_instance_group", "current_instance_group_hosts", "instance_groups",
            "instance_groups_dict", "distribution_instance_groups", "is_hetero", "module_name",
            "log_level", "framework_module", "input_dir", "input_config_dir", "output_dir",
            "num_cpus", "num_gpus", "num_neurons", "model_dir", "module_dir",
            "output_intermediate_dir")}
    mapping.update({
        "hps": user,
        "framework_params": env["additional_framework_parameters"],
        "channels": sorted(channels),
        "training_env": env,
        "user_args": to_cmd_args(user),
    })
    mapping.update({f"channel_{name}": paths.channel(name) for name in channels})
    mapping.update({f"hp_{key}": value for key, value in user.items()})
    return to_env_vars(mapping)

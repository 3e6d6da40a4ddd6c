"""Hyperparameters: the SDK encodes them, the toolkit decodes and splits them and maps them to argv/env."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tfsmp.launch.sagemaker.distribution import Distribution

__all__ = ["distribution_hyperparameters", "encode_hyperparameters", "split_hyperparameters",
           "to_cmd_args", "to_env_vars"]


def distribution_hyperparameters(dist: Distribution, instance_type: str) -> dict[str, Any]:
    """The SDK's `Framework._distribution_configuration`: the hyperparameters `distribution` adds."""
    hps: dict[str, Any] = {}
    if "mpi" in dist.raw:
        hps["sagemaker_mpi_enabled"] = dist.mpi_enabled
        if dist.processes_per_host_given:
            hps["sagemaker_mpi_num_of_processes_per_host"] = dist.processes_per_host_given
        hps["sagemaker_mpi_custom_mpi_options"] = dist.custom_mpi_options
    if "smdistributed" in dist.raw:
        hps["sagemaker_distributed_dataparallel_enabled"] = False
        hps["sagemaker_instance_type"] = instance_type
        if dist.mp_parameters is not None:
            hps["mp_parameters"] = dist.mp_parameters
    return hps


def encode_hyperparameters(hps: Mapping[str, Any]) -> dict[str, str]:
    """`EstimatorBase._json_encode_hyperparameters`: each value JSON-encoded (hyperparameters.json)."""
    return {str(k): json.dumps(v) for k, v in hps.items()}


def split_hyperparameters(hps: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The toolkit's split: (user hyperparameters, `sagemaker_*` framework parameters)."""
    user = {k: v for k, v in hps.items() if not k.startswith("sagemaker_")}
    framework = {k: v for k, v in hps.items() if k.startswith("sagemaker_")}
    return user, framework


def _decode(value: Any) -> str:
    return "" if value is None else str(value)


def to_cmd_args(hps: Mapping[str, Any]) -> list[str]:
    """The toolkit's `mapping.to_cmd_args`: sorted `--key value`; a dict becomes `k=v,k=v`."""
    args: list[str] = []
    for key in sorted(hps):
        name = _decode(key)
        value = hps[key]
        if isinstance(value, Mapping):
            text = ",".join(f"{k}={v}" for k, v in sorted(value.items()))
        else:
            text = _decode(value)
        args += [f"--{name}" if len(name) > 1 else f"-{name}", text]
    return args


def to_env_vars(mapping: Mapping[str, Any]) -> dict[str, str]:
    """The toolkit's `mapping.to_env_vars`: `SM_<KEY>`; str as is, else compact sorted JSON."""
    def value(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, str):
            return v
        return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    return {f"SM_{str(k).upper()}": value(v) for k, v in mapping.items()}

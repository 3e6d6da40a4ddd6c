"""What an instance type reports: GPUs and CPUs of `ml.*` types, `local`, and EFA support."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tfsmp.errors import ConfigError, short_repr

__all__ = ["EFA_NCCL_INSTANCES", "EFA_RDMA_INSTANCES", "INSTANCE_RESOURCES", "Resources",
           "instance_resources"]

# The training toolkit's lists (sagemaker_training/__init__.py) and the SDK's container drivers.
EFA_NCCL_INSTANCES = (
    "ml.g4dn.8xlarge", "ml.g4dn.12xlarge", "ml.g5.48xlarge", "ml.p3dn.24xlarge",
    "ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.p5.48xlarge", "ml.trn1.32xlarge",
)
EFA_RDMA_INSTANCES = ("ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.trn1.32xlarge")

# instance type -> (GPUs, vCPUs): what SM_NUM_GPUS / SM_NUM_CPUS report for an emulated `ml.*` host.
INSTANCE_RESOURCES: dict[str, tuple[int, int]] = {
    "ml.p2.xlarge": (1, 4), "ml.p2.8xlarge": (8, 32), "ml.p2.16xlarge": (16, 64),
    "ml.p3.2xlarge": (1, 8), "ml.p3.8xlarge": (4, 32), "ml.p3.16xlarge": (8, 64),
    "ml.p3dn.24xlarge": (8, 96), "ml.p4d.24xlarge": (8, 96), "ml.p4de.24xlarge": (8, 96),
    "ml.p5.48xlarge": (8, 192),
    "ml.g4dn.xlarge": (1, 4), "ml.g4dn.2xlarge": (1, 8), "ml.g4dn.4xlarge": (1, 16),
    "ml.g4dn.8xlarge": (1, 32), "ml.g4dn.12xlarge": (4, 48), "ml.g4dn.16xlarge": (1, 64),
    "ml.g5.xlarge": (1, 4), "ml.g5.2xlarge": (1, 8), "ml.g5.4xlarge": (1, 16),
    "ml.g5.8xlarge": (1, 32), "ml.g5.12xlarge": (4, 48), "ml.g5.16xlarge": (1, 64),
    "ml.g5.24xlarge": (4, 96), "ml.g5.48xlarge": (8, 192),
    "ml.m5.large": (0, 2), "ml.m5.xlarge": (0, 4), "ml.m5.2xlarge": (0, 8),
    "ml.m5.4xlarge": (0, 16), "ml.m5.12xlarge": (0, 48), "ml.m5.24xlarge": (0, 96),
    "ml.c5.xlarge": (0, 4), "ml.c5.2xlarge": (0, 8), "ml.c5.4xlarge": (0, 16),
    "ml.c5.9xlarge": (0, 36), "ml.c5.18xlarge": (0, 72), "ml.t3.medium": (0, 2),
}
_ML_TYPE = re.compile(r"^ml\.[a-z0-9-]+\.[a-z0-9]+$")
_LOCAL_TYPES = ("local", "local_gpu")

@dataclass(frozen=True)
class Resources:
    """What one (emulated) host reports: `SM_CURRENT_INSTANCE_TYPE`, `SM_NUM_GPUS`, `SM_NUM_CPUS`.

    Example::

        instance_resources("ml.p3.16xlarge", local_gpus=0, local_cpus=2).num_gpus   # 8
    """

    instance_type: str
    num_gpus: int
    num_cpus: int
    known: bool = True


def instance_resources(instance_type: Any, *, local_gpus: int, local_cpus: int) -> Resources:
    """The resources an instance type reports; `local` types report this machine's.

    Args:
        instance_type: "local", "local_gpu", or an `ml.*` type.
        local_gpus: GPUs of this machine (`nvidia-smi --list-gpus`).
        local_cpus: CPUs of this machine.

    Returns:
        The `Resources`; `known=False` for an `ml.*` type missing from `INSTANCE_RESOURCES`,
        which then reports this machine's counts.

    Raises:
        ConfigError: the type is neither local nor `ml.*`, or `local_gpu` on a machine without GPUs.
    """
    if instance_type in _LOCAL_TYPES:
        if instance_type == "local_gpu" and local_gpus == 0:
            raise ConfigError(
                "instance_type='local_gpu' needs an NVIDIA GPU on this machine. Received: "
                "instance_type='local_gpu', 0 GPUs (nvidia-smi --list-gpus). Use "
                "instance_type='local'.")
        return Resources(str(instance_type), local_gpus, local_cpus)
    if not isinstance(instance_type, str) or not _ML_TYPE.match(instance_type):
        raise ConfigError(
            "instance_type must be 'local', 'local_gpu' or a SageMaker type such as "
            f"'ml.p3.16xlarge'. Received: instance_type={short_repr(instance_type, 200)}. The job runs on this "
            "machine either way; an ml.* type sets what the job's environment reports.")
    if instance_type in INSTANCE_RESOURCES:
        gpus, cpus = INSTANCE_RESOURCES[instance_type]
        return Resources(instance_type, gpus, cpus)
    return Resources(instance_type, local_gpus, local_cpus, known=False)

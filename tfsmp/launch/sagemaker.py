"""SageMaker's launch contract, pure: SDK validation, hyperparameters, job environment, mpirun command.

Example::

    dist = resolve_distribution(
        {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 2}}},
         "mpi": {"enabled": True, "processes_per_host": 4}},
        instance_count=1, resources=instance_resources("local", local_gpus=0, local_cpus=8))
    dist.processes_per_host, dist.config.partitions          # (4, 2)

Three sources are mirrored here (see docs/estimator.md): the SageMaker Python SDK's
`validate_smdistributed` / `get_mp_parameters` / `_distribution_configuration` (what an estimator
checks and turns into hyperparameters), the training toolkit's `Environment.to_env_vars` and
`mapping.to_cmd_args` (what the script sees), and the toolkit's `MasterRunner._create_command`
(the mpirun line), adapted to Open MPI 5 and to hosts emulated on one machine. Nothing here imports
TensorFlow or MPI, reads the environment or touches files: `tfsmp.estimator` gathers those facts.

[Note: emulated hosts] A job of `instance_count` hosts runs as one mpirun with one app context per
host (`-np ppn ... : -np ppn ...`), all mapped by slot onto the hostfile's slots. Each context sets
its own `SM_CURRENT_HOST=algo-<i>`; every other `SM_*` variable is the master's, exported with
`-x` as the toolkit does. On SageMaker even `SM_CURRENT_HOST` is the master's on every rank
(toolkit issue #158); here it names the rank's host.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tfsmp.config import Config, parse_mp_parameters, validate
from tfsmp.errors import ConfigError
from tfsmp.launch.mpirun import build_mpirun_command

__all__ = [
    "EFA_NCCL_INSTANCES",
    "EFA_RDMA_INSTANCES",
    "INSTANCE_RESOURCES",
    "JOB_VARIABLES",
    "SMDISTRIBUTED_SUPPORTED_STRATEGIES",
    "Distribution",
    "JobPaths",
    "Resources",
    "RunOptions",
    "distribution_hyperparameters",
    "encode_hyperparameters",
    "exported_names",
    "format_command",
    "get_mp_parameters",
    "host_names",
    "hostfile_text",
    "input_data_config",
    "instance_resources",
    "job_env",
    "merge_mpi_options",
    "resolve_distribution",
    "resource_config",
    "run_options",
    "split_hyperparameters",
    "to_cmd_args",
    "to_env_vars",
    "toolkit_mpirun_command",
    "validate_smdistributed",
]

SMDISTRIBUTED_SUPPORTED_STRATEGIES = ["dataparallel", "modelparallel"]
_MPI_KEYS = ("enabled", "processes_per_host", "custom_mpi_options")
_MODELPARALLEL_KEYS = ("enabled", "parameters")
# Keys the SDK knows in `distribution`, and why tfsmp runs only two of them.
_FOREIGN_STRATEGIES = {
    "parameter_server": "TensorFlow parameter-server training",
    "multi_worker_mirrored_strategy": "tf.distribute.MultiWorkerMirroredStrategy",
    "torch_distributed": "PyTorch torchrun",
    "pytorchddp": "PyTorch DDP",
    "instance_groups": "heterogeneous clusters",
}
_DISTRIBUTION_KEYS = ("mpi", "smdistributed", *_FOREIGN_STRATEGIES)

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


def _r(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _did_you_mean(key: Any, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(key), list(valid), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


# ---------------------------------------------------------------------------------------------
# What the job runs on.


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
            f"'ml.p3.16xlarge'. Received: instance_type={_r(instance_type)}. The job runs on this "
            "machine either way; an ml.* type sets what the job's environment reports.")
    if instance_type in INSTANCE_RESOURCES:
        gpus, cpus = INSTANCE_RESOURCES[instance_type]
        return Resources(instance_type, gpus, cpus)
    return Resources(instance_type, local_gpus, local_cpus, known=False)


def host_names(instance_count: int) -> list[str]:
    """SageMaker's host names: algo-1 .. algo-N."""
    return [f"algo-{i}" for i in range(1, instance_count + 1)]


# ---------------------------------------------------------------------------------------------
# The SDK's validation of `distribution`, then tfsmp's.


def validate_smdistributed(distribution: Mapping[str, Any]) -> None:
    """The SDK's `validate_smdistributed`, with its messages, plus fixes where they help.

    Raises:
        ConfigError: `smdistributed` is not a dict, names more than one strategy, or an
            unknown one.
    """
    if "smdistributed" not in distribution:
        return
    smd = distribution["smdistributed"]
    if not isinstance(smd, Mapping):
        raise ConfigError("smdistributed strategy requires a dictionary."
                          f" Received: smdistributed={_r(smd)}. Pass "
                          "{'modelparallel': {'enabled': True, 'parameters': {...}}}.")
    if len(smd) > 1:
        hint = ""
        if set(smd) <= set(_MODELPARALLEL_KEYS):
            hint = (" The keys look like the modelparallel options themselves: nest them, "
                    "{'smdistributed': {'modelparallel': smp_options}}.")
        elif set(SMDISTRIBUTED_SUPPORTED_STRATEGIES) <= set(smd):
            hint = " modelparallel and dataparallel cannot be combined in one job."
        raise ConfigError("Cannot use more than 1 smdistributed strategy. \nChoose one of the "
                          f"following supported strategies:{SMDISTRIBUTED_SUPPORTED_STRATEGIES}"
                          f" Received: smdistributed keys {sorted(map(str, smd))}.{hint}")
    for strategy in smd:
        if strategy not in SMDISTRIBUTED_SUPPORTED_STRATEGIES:
            raise ConfigError(f"Invalid smdistributed strategy provided: {strategy} \nSupported "
                              f"strategies: {SMDISTRIBUTED_SUPPORTED_STRATEGIES}"
                              + _did_you_mean(strategy, SMDISTRIBUTED_SUPPORTED_STRATEGIES))


def get_mp_parameters(distribution: Mapping[str, Any]) -> dict[str, Any] | None:
    """The SDK's `get_mp_parameters`: the parameters when modelparallel is enabled, else None.

    `parameters` may be a dict or the path of a JSON file. The SDK then requires `partitions`;
    the per-key checks are `tfsmp.config.validate`'s (which start with the SDK's sentences).

    Raises:
        ConfigError: the parameters cannot be read, or `partitions` is missing.
    """
    smd = distribution.get("smdistributed")
    mp = smd.get("modelparallel", {}) if isinstance(smd, Mapping) else {}
    if not isinstance(mp, Mapping):
        raise ConfigError(f"smdistributed.modelparallel must be a dict. Received: modelparallel="
                          f"{_r(mp)}. Pass {{'enabled': True, 'parameters': {{...}}}}.")
    if mp.get("enabled", False) is not True:
        return None
    params = parse_mp_parameters(mp.get("parameters", {}))
    if "partitions" not in params and "pipeline_parallel_degree" not in params:
        raise ConfigError("'partitions' is a required parameter. Received: parameters="
                          f"{_r(params)}. Add e.g. 'partitions': 2 (the number of pipeline stages).")
    return params


@dataclass(frozen=True)
class Distribution:
    """A validated `distribution=` dict and what it means for the job.

    `processes_per_host` is resolved as the toolkit does (the given value, else one per GPU, else
    one); `processes_per_host_given` is the value as written (None if absent).
    """

    raw: Mapping[str, Any]
    mp_parameters: dict[str, Any] | None
    config: Config | None
    mpi_enabled: bool
    processes_per_host: int
    processes_per_host_given: int | None
    custom_mpi_options: str
    warnings: tuple[str, ...] = ()


def _check_top_level(distribution: Mapping[str, Any]) -> None:
    for key in distribution:
        if key in _FOREIGN_STRATEGIES:
            raise ConfigError(
                f"distribution[{key!r}] ({_FOREIGN_STRATEGIES[key]}) is not something tfsmp runs. "
                f"Received: distribution keys {sorted(map(str, distribution))}. tfsmp runs "
                "'smdistributed' (modelparallel) with 'mpi'; remove the other keys.")
        if key not in _DISTRIBUTION_KEYS:
            raise ConfigError(f"Unknown distribution key {key!r}. Received: distribution keys "
                              f"{sorted(map(str, distribution))}.{_did_you_mean(key, _DISTRIBUTION_KEYS)}"
                              " tfsmp reads 'smdistributed' and 'mpi'.")


def _check_modelparallel_keys(distribution: Mapping[str, Any]) -> None:
    smd = distribution.get("smdistributed", {})
    dp = smd.get("dataparallel")
    if isinstance(dp, Mapping) and dp.get("enabled", False) is True:
        raise ConfigError(
            "smdistributed dataparallel (SMDDP) is not available in tfsmp. Received: "
            "smdistributed={'dataparallel': ...}. For data parallelism use modelparallel with "
            "partitions=1 and horovod=True (or False for MPI allreduce): every rank is a replica.")
    mp = smd.get("modelparallel", {})
    if not isinstance(mp, Mapping):
        return  # get_mp_parameters says what is wrong
    for key in mp:
        if key not in _MODELPARALLEL_KEYS:
            raise ConfigError(f"Unknown key {key!r} in smdistributed.modelparallel. Received: "
                              f"{sorted(map(str, mp))}.{_did_you_mean(key, _MODELPARALLEL_KEYS)} "
                              "It takes 'enabled' and 'parameters'; parameters go inside "
                              "'parameters'.")


def _mpi_options(distribution: Mapping[str, Any]) -> tuple[bool, int | None, str]:
    """(enabled, processes_per_host, custom_mpi_options) of `distribution['mpi']`."""
    mpi = distribution.get("mpi", {})
    if not isinstance(mpi, Mapping):
        raise ConfigError(f"distribution['mpi'] must be a dict. Received: mpi={_r(mpi)}. Pass "
                          "{'enabled': True, 'processes_per_host': N}.")
    for key in mpi:
        if key not in _MPI_KEYS:
            # The SDK ignores unknown keys, so a typo silently launches one process per host
            # (amazon-sagemaker-examples#1872).
            raise ConfigError(f"Unknown key {key!r} in distribution['mpi']. Received: mpi keys "
                              f"{sorted(map(str, mpi))}.{_did_you_mean(key, _MPI_KEYS)} Valid "
                              f"keys: {list(_MPI_KEYS)}.")
    enabled = mpi.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"mpi enabled must be a value in: [True, False]. Received: "
                          f"enabled={_r(enabled)}.")
    ppn = mpi.get("processes_per_host")
    if ppn is not None and (isinstance(ppn, bool) or not isinstance(ppn, int) or ppn < 1):
        raise ConfigError(f"processes_per_host must be a positive integer. Received: "
                          f"processes_per_host={_r(ppn)}. Pass e.g. 'processes_per_host': 8 "
                          "(one per GPU).")
    custom = mpi.get("custom_mpi_options", "")
    if not isinstance(custom, str):
        raise ConfigError(f"custom_mpi_options must be a str of mpirun flags. Received: "
                          f"custom_mpi_options={_r(custom)}. Pass e.g. '-x NCCL_DEBUG=WARN'.")
    return enabled, ppn, custom


def _check_world(config: Config, ppn: int, instance_count: int) -> None:
    world = ppn * instance_count
    p = config.partitions
    if world % p == 0:
        return
    raise ConfigError(
        "processes_per_host × instance_count must be a multiple of partitions (each model replica "
        f"spans `partitions` processes). Received: processes_per_host={ppn}, instance_count="
        f"{instance_count} ({world} processes), partitions={p}. Set processes_per_host to a "
        f"multiple of {p} (e.g. {p}), or partitions to a divisor of {world}.")


def _check_devices(ppn: int, resources: Resources) -> str | None:
    """Error on GPU hosts with more processes than GPUs; a warning text on CPU hosts."""
    if resources.num_gpus > 0 and ppn > resources.num_gpus:
        raise ConfigError(
            "processes_per_host must not exceed the GPUs of one host (SMP's runtime fails with "
            f"'The number of node-local MPI processes {ppn} cannot be larger than the device count "
            f"{resources.num_gpus}'). Received: processes_per_host={ppn}, "
            f"instance_type={resources.instance_type!r} with {resources.num_gpus} GPUs. Set "
            f"processes_per_host={resources.num_gpus}, or pick an instance type with more GPUs.")
    if resources.num_gpus == 0 and ppn > resources.num_cpus:
        return (f"processes_per_host={ppn} exceeds the {resources.num_cpus} CPUs of "
                f"instance_type={resources.instance_type!r}: ranks share cores (oversubscribed), "
                "which is slow but works.")
    return None


def resolve_distribution(distribution: Mapping[str, Any] | None, *, instance_count: int,
                         resources: Resources) -> Distribution:
    """Validates `distribution=` as the SDK does, then as tfsmp does.

    SDK checks (its messages): `smdistributed` is a dict with one known strategy; `parameters`
    is a dict or a JSON file path; `partitions` is present; the per-key checks. tfsmp adds: unknown
    keys in `distribution`, `mpi` and `modelparallel` are errors with a did-you-mean; modelparallel
    needs MPI; `processes_per_host × instance_count` is a multiple of `partitions`; more processes
    per host than GPUs is an error (on a CPU host, more than CPUs is a warning).

    Args:
        distribution: The estimator's `distribution` (None: no distribution).
        instance_count: Number of hosts.
        resources: What one host reports (`instance_resources`).

    Returns:
        The `Distribution`.

    Raises:
        ConfigError: Any rule above is broken.
    """
    dist: Mapping[str, Any] = {} if distribution is None else distribution
    if not isinstance(dist, Mapping):
        raise ConfigError(f"distribution must be a dict. Received: distribution={_r(dist)}.")
    _check_top_level(dist)
    validate_smdistributed(dist)
    _check_modelparallel_keys(dist)
    params = get_mp_parameters(dist)
    config = validate(params) if params is not None else None
    enabled, ppn_given, custom = _mpi_options(dist)
    if config is not None and not enabled:
        raise ConfigError(
            "modelparallel needs MPI: the library runs one process per pipeline stage under "
            "mpirun. Received: distribution['mpi'] = "
            f"{_r(dist.get('mpi'))}. Add 'mpi': {{'enabled': True, 'processes_per_host': N}}.")
    ppn = (ppn_given or max(resources.num_gpus, 1)) if enabled else 1
    warnings = []
    if config is not None:
        _check_world(config, ppn, instance_count)
    warning = _check_devices(ppn, resources) if enabled else None
    if warning:
        warnings.append(warning)
    if not resources.known:
        warnings.append(f"instance_type={resources.instance_type!r} is not in tfsmp's table: the job "
                        f"reports this machine's {resources.num_gpus} GPUs and {resources.num_cpus} "
                        "CPUs.")
    return Distribution(dist, params, config, enabled, ppn, ppn_given, custom, tuple(warnings))


# ---------------------------------------------------------------------------------------------
# Hyperparameters: the SDK encodes them, the toolkit decodes and splits them.


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


# ---------------------------------------------------------------------------------------------
# The job's directory and environment (what /opt/ml holds on SageMaker).


@dataclass(frozen=True)
class JobPaths:
    """A job directory laid out like a training container's /opt/ml (`SAGEMAKER_BASE_DIR`).

    Example::

        JobPaths("/tmp/tfsmp-jobs/my-job").channel("training")
        # '/tmp/tfsmp-jobs/my-job/input/data/training'
    """

    base: str

    def _join(self, *parts: str) -> str:
        return "/".join([self.base.rstrip("/"), *parts])

    @property
    def code(self) -> str:
        return self._join("code")

    @property
    def model(self) -> str:
        return self._join("model")

    @property
    def input(self) -> str:
        return self._join("input")

    @property
    def input_config(self) -> str:
        return self._join("input", "config")

    @property
    def input_data(self) -> str:
        return self._join("input", "data")

    @property
    def output(self) -> str:
        return self._join("output")

    @property
    def output_data(self) -> str:
        return self._join("output", "data")

    @property
    def output_intermediate(self) -> str:
        return self._join("output", "intermediate")

    @property
    def checkpoints(self) -> str:
        return self._join("checkpoints")

    @property
    def hostfile(self) -> str:
        return self._join("hostfile")

    def channel(self, name: str) -> str:
        return self._join("input", "data", name)


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


# ---------------------------------------------------------------------------------------------
# The mpirun command.


# Variables tfsmp adds to a job: the container's /opt/ml (the toolkit's own convention outside
# SageMaker), the checkpoint directory, and how the ranks import the code and tfsmp.
JOB_VARIABLES = ("SAGEMAKER_BASE_DIR", "TFSMP_CHECKPOINT_DIR", "PYTHONPATH", "PYTHONUNBUFFERED")


def exported_names(env: Mapping[str, str], extra: Sequence[str] = JOB_VARIABLES,
                   per_host: Collection[str] = ("SM_CURRENT_HOST",)) -> list[str]:
    """What mpirun exports with `-x NAME`: the job's `SM_*` variables (the toolkit exports them all)
    then `extra`, except the `per_host` ones (each host's app context sets its own)."""
    names = [*sorted(k for k in env if k.startswith("SM_")), *extra]
    return [name for name in names if name not in per_host]


# [Note: hosts across machines] With `instance_count` > 1 a job runs either on this machine alone
# ([Note: emulated hosts]) or across the machines named algo-1 .. algo-N, launched from algo-1 as
# the toolkit does (`--host algo-1:N,algo-2:N`, TCP on the interface towards the others). The
# hosts share the job directory (a shared filesystem, or one machine's emulated hosts), so each
# host's /opt/ml is its own directory inside it: algo-1's is the job directory itself (its
# `model/` is the artifact, as the master's is on SageMaker), algo-<i>'s is `hosts/algo-<i>/`
# with its own `input/config/resourceconfig.json`, `model/` and `output/`. Every variable whose
# value differs between hosts (`SM_CURRENT_HOST`, `SAGEMAKER_BASE_DIR`, `SM_MODEL_DIR`,
# `SM_TRAINING_ENV` ...) is set per host in that host's app context.
HOSTS_SETTING = "TFSMP_SAGEMAKER_HOSTS"
_HOSTS_VALUES = ("auto", "local", "ssh")


def runs_across_hosts(hosts: Sequence[str], *, setting: str | None, hostname: str,
                      resolve: Callable[[str], str | None]) -> bool:
    """Whether a job of `hosts` runs across machines (True) or on this one (False).

    `setting` is `TFSMP_SAGEMAKER_HOSTS`: "local", "ssh", or "auto"/unset, which means "ssh" when
    this machine is named like the first host (a SageMaker container, an emulated host) and
    "local" otherwise. [Note: hosts across machines]

    Raises:
        ConfigError: The setting is unknown, or "ssh" where this machine is not the first host or
            cannot resolve another host's name.
    """
    value = (setting or "auto").strip().lower()
    if value not in _HOSTS_VALUES:
        raise ConfigError(f"{HOSTS_SETTING} must be one of {', '.join(_HOSTS_VALUES)}. Received: "
                          f"{HOSTS_SETTING}={setting!r}.")
    if len(hosts) < 2 or value == "local" or (value == "auto" and hostname != hosts[0]):
        return False
    if hostname != hosts[0]:
        raise ConfigError(
            f"a job across hosts is launched from the first host, as the toolkit does. Received: "
            f"{HOSTS_SETTING}={setting!r} on host {hostname!r}, hosts={list(hosts)}. Fix: run it "
            f"on {hosts[0]}, or set {HOSTS_SETTING}=local to emulate the hosts on this machine.")
    missing = [host for host in hosts[1:] if resolve(host) is None]
    if missing:
        raise ConfigError(
            f"instance_count={len(hosts)} runs across hosts {', '.join(hosts)}, so {hosts[0]} "
            f"must reach each of them by name. Received: {', '.join(missing)} cannot be resolved "
            f"on {hostname}. Fix: add them to /etc/hosts (with passwordless ssh from "
            f"{hosts[0]}), or set {HOSTS_SETTING}=local to emulate the hosts on this machine.")
    return True


def hostfile_text(hosts: Sequence[str], processes_per_host: int,
                  addresses: Sequence[str] | None = None) -> str:
    """An Open MPI hostfile; every emulated host is `localhost` unless `addresses` says otherwise.

    Slots of hosts that share an address are summed on one line, since Open MPI merges them.
    """
    addrs = list(addresses) if addresses is not None else ["localhost"] * len(hosts)
    slots: dict[str, int] = {}
    for addr in addrs:
        slots[addr] = slots.get(addr, 0) + processes_per_host
    lines = [f"# tfsmp: SageMaker hosts {', '.join(hosts)} ({processes_per_host} slots each)"]
    lines += [f"{addr} slots={n}" for addr, n in slots.items()]
    return "\n".join(lines) + "\n"


# (kind, name) identifies one setting: the same MCA parameter or -x variable given twice is one
# setting, and the later one wins. The duplicate-MCA failure of Open MPI 4 cannot happen.
_Key = tuple[str, str]
_MCA_FLAGS = ("-mca", "--mca", "-prtemca", "--prtemca", "-pmixmca", "--pmixmca", "-gmca", "--gmca")
_ONE_VALUE = {"-bind-to": "bind-to", "--bind-to": "bind-to", "-map-by": "map-by",
              "--map-by": "map-by"}


def _mca_name(name: str) -> str:
    # Open MPI 5 renamed btl vader to btl sm and keeps btl_vader_* as synonyms.
    return "btl_sm_" + name[len("btl_vader_"):] if name.startswith("btl_vader_") else name


def _groups(tokens: Sequence[str]) -> list[tuple[_Key | None, list[str]]]:
    """Splits mpirun flags into settings: (key or None for an opaque token, its tokens)."""
    out: list[tuple[_Key | None, list[str]]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok in _MCA_FLAGS and i + 2 < len(tokens):
            out.append((("mca", _mca_name(tokens[i + 1])), list(tokens[i:i + 3])))
            i += 3
        elif tok in ("-x", "--x") and i + 1 < len(tokens):
            out.append((("x", tokens[i + 1].split("=", 1)[0]), list(tokens[i:i + 2])))
            i += 2
        elif tok in _ONE_VALUE and i + 1 < len(tokens):
            # Open MPI 5 reads the toolkit's single-dash `-bind-to` as other flags: respell it.
            out.append((("opt", _ONE_VALUE[tok]), [f"--{_ONE_VALUE[tok]}", tokens[i + 1]]))
            i += 2
        else:
            out.append((None, [tok]))
            i += 1
    return out


def merge_mpi_options(builtin: Sequence[str], custom: Sequence[str]) -> list[str]:
    """Built-in flags, then custom ones; a setting given twice appears once, with the later value.

    A setting is an MCA parameter (`--mca`/`--prtemca`/..., `btl_vader_*` counted as the
    `btl_sm_*` it is in Open MPI 5), an `-x` variable, `--bind-to` or `--map-by`. Other tokens are
    kept verbatim. So a custom `--mca btl_vader_single_copy_mechanism none` (which the AWS page
    once advised) cannot produce Open MPI 4's "listed multiple times" failure, and a custom
    `-x NCCL_DEBUG=WARN` replaces the built-in one (Open MPI keeps the first `-x` of a name).
    """
    groups = [*_groups(builtin), *_groups(custom)]
    last = {key: i for i, (key, _) in enumerate(groups) if key is not None}
    merged: list[str] = []
    for i, (key, toks) in enumerate(groups):
        if key is None or last[key] == i:
            merged += toks
    return merged


def _parse_custom(custom: str) -> tuple[str, list[str]]:
    """The toolkit's `_parse_custom_mpi_options`: --NCCL_DEBUG replaces its default, rest verbatim."""
    tokens = shlex.split(custom)
    nccl_debug, rest, i = "INFO", [], 0
    while i < len(tokens):
        if tokens[i] == "--NCCL_DEBUG" and i + 1 < len(tokens):
            nccl_debug, i = tokens[i + 1], i + 2
        elif tokens[i].startswith("--NCCL_DEBUG="):
            nccl_debug, i = tokens[i].split("=", 1)[1], i + 1
        else:
            rest.append(tokens[i])
            i += 1
    return nccl_debug, rest


def _efa_flags(instance_type: str) -> list[str]:
    flags: list[str] = []
    if instance_type in EFA_NCCL_INSTANCES:
        flags += ["-x", "FI_PROVIDER=efa", "-x", "NCCL_PROTO=simple"]
    if instance_type in EFA_RDMA_INSTANCES:
        flags += ["-x", "FI_EFA_USE_DEVICE_RDMA=1", "-x", "RDMAV_FORK_SAFE=1"]
    return flags


def _toolkit_flags(nccl_debug: str, network_interface: str, has_ld_library_path: bool) -> list[str]:
    """MasterRunner's built-in flags, in Open MPI 5 spelling (see docs/estimator.md)."""
    flags = [
        "--display-map",
        "--prtemca", "plm_ssh_no_tree_spawn", "1",
        "--mca", "pml", "ob1",
        "--mca", "btl", "^openib",
        # Open MPI 4's orte_abort_on_non_zero_status: one rank's non-zero exit ends the job.
        "--prtemca", "state_base_error_non_zero_exit", "1",
        # Kept for parity with the toolkit (it matters on Open MPI 4 images); Open MPI 5 moved
        # single-copy to the smsc framework and ignores this name.
        "--mca", "btl_vader_single_copy_mechanism", "none",
        "-x", "NCCL_MIN_NRINGS=4",
        "-x", f"NCCL_SOCKET_IFNAME={network_interface}",
        "-x", f"NCCL_DEBUG={nccl_debug}",
    ]
    # Open MPI 5 warns about `-x NAME` for an unset NAME.
    flags += ["-x", "LD_LIBRARY_PATH"] if has_ld_library_path else []
    return [*flags, "-x", "PATH"]


def _drop_pair(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


def toolkit_mpirun_command(*, hosts: Sequence[str], processes_per_host: int,
                           entry_argv: Sequence[str], exported: Sequence[str],
                           custom_mpi_options: str, instance_type: str, hostfile: str,
                           python: str, mpirun: str = "mpirun", as_root: bool = False,
                           has_ld_library_path: bool = False, network_interface: str = "lo",
                           use_mpi4py_module: bool = True,
                           host_env: Sequence[Mapping[str, str]] | None = None,
                           host_list: str | None = None,
                           tcp_interface: str | None = None) -> list[str]:
    """The toolkit's mpirun line for `hosts`, as Open MPI 5 takes it, one app context per host.

    Args:
        hosts: Host names (algo-1 ...); each gets `processes_per_host` ranks and its own
            `SM_CURRENT_HOST`. [Note: emulated hosts]
        processes_per_host: Ranks per host.
        entry_argv: The script (relative to the working directory) and its arguments.
        exported: Variable names to export with `-x NAME` (the job's `SM_*`, PYTHONPATH ...).
        custom_mpi_options: `mpi.custom_mpi_options`, appended after the built-in flags.
        instance_type: For the EFA flags.
        hostfile: Path of the hostfile (`hostfile_text`); unused with `host_list`.
        python: The ranks' interpreter (or `/bin/sh` for a shell entry point).
        mpirun: The mpirun executable.
        as_root: Add `--allow-run-as-root`.
        has_ld_library_path: Whether LD_LIBRARY_PATH is set (then it is exported).
        network_interface: For NCCL_SOCKET_IFNAME.
        use_mpi4py_module: `python -m mpi4py script` (abort every rank on an uncaught exception).
        host_env: Per host, the variables whose values are that host's own (exported in its app
            context); default `SM_CURRENT_HOST` alone. [Note: hosts across machines]
        host_list: Across machines: `--host` text ("algo-1:2,algo-2:2") instead of the hostfile.
        tcp_interface: `btl_tcp_if_include` and `oob_tcp_if_include`, as the toolkit sets them
            (None: Open MPI's choice).

    Returns:
        The argv.
    """
    per_host = list(host_env) if host_env is not None else [
        {"SM_CURRENT_HOST": host} for host in hosts]
    nccl_debug, custom = _parse_custom(custom_mpi_options)
    builtin = _toolkit_flags(nccl_debug, network_interface, has_ld_library_path)
    builtin += _efa_flags(instance_type)
    builtin += [tok for name in exported for tok in ("-x", name)]
    argv = build_mpirun_command(
        processes_per_host, list(entry_argv),
        hostfile=None if host_list else hostfile, hosts=host_list,
        network_interface=tcp_interface,
        extra_mpi_args=[*merge_mpi_options(builtin, custom), *_env_pairs(per_host[0])],
        python=python, use_mpi4py_module=use_mpi4py_module, oversubscribe=False,
        as_root=as_root, tag_output=True, mpirun=mpirun)
    custom_keys = {key for key, _ in _groups(custom)}
    for flag in ("--bind-to", "--map-by"):
        if ("opt", flag[2:]) in custom_keys:  # Open MPI 5 refuses these flags twice
            argv = _drop_pair(argv, flag)
    program = [python, "-m", "mpi4py"] if use_mpi4py_module else [python]
    for env in per_host[1:]:
        argv += [":", "-np", str(processes_per_host), *_env_pairs(env), *program, *entry_argv]
    return argv


def _env_pairs(env: Mapping[str, str]) -> list[str]:
    return [tok for name, value in env.items() for tok in ("-x", f"{name}={value}")]


# mpirun flags this module emits -> number of values they take (for `format_command`).
_ARITY = {"-np": 1, "-x": 1, "--hostfile": 1, "--host": 1, "--bind-to": 1, "--map-by": 1,
          "--mca": 2, "-mca": 2, "--prtemca": 2, "--pmixmca": 2, "--allow-run-as-root": 0,
          "--oversubscribe": 0, "--tag-output": 0, "--display-map": 0}


def format_command(argv: Sequence[str]) -> str:
    """The argv as shell text for logs and golden files: one mpirun flag, app context or script
    argument per line (other tokens, e.g. custom flags, stay on the line before them)."""
    lines: list[list[str]] = []
    in_script, i = False, 0
    while i < len(argv):
        tok = argv[i]
        if tok == ":":
            in_script, take = False, 1
        elif list(argv[i + 1:i + 3]) == ["-m", "mpi4py"]:
            in_script, take = True, 4      # python -m mpi4py script
        elif not lines or (tok.startswith("-") if in_script else tok in _ARITY):
            take = 1 + (0 if in_script else _ARITY[tok]) if lines else 1
        else:
            lines[-1].append(tok)
            i += 1
            continue
        lines.append(list(argv[i:i + take]))
        i += take
    text = " \\\n    ".join(" ".join(shlex.quote(t) for t in line) for line in lines)
    return text + "\n"


# ---------------------------------------------------------------------------------------------
# `tfsmp run --distribution`.


@dataclass(frozen=True)
class RunOptions:
    """What `tfsmp run --distribution` needs from a `distribution=` dict."""

    np: int
    parameters: dict[str, Any] | None
    mpi_args: list[str]
    warnings: tuple[str, ...]


def run_options(distribution: Mapping[str, Any] | str, *, np: int | None = None,
                resources: Resources | None = None) -> RunOptions:
    """Validates a `distribution=` dict (or JSON text / file path) for one host of this machine.

    Args:
        distribution: The dict, or JSON text, or the path of a JSON file.
        np: Processes (default: `mpi.processes_per_host`).
        resources: What the host reports (default: a CPU host with `np` CPUs, so no warning).

    Returns:
        The `RunOptions`: -np, the parameters (for SM_HP_MP_PARAMETERS), and the custom
        mpirun flags (`--NCCL_DEBUG` removed).

    Raises:
        ConfigError: The distribution is invalid, or -np is not a multiple of `partitions`.
    """
    dist = parse_mp_parameters(distribution)
    _, ppn_given, _ = _mpi_options(dist)
    ppn = np or ppn_given
    if ppn is None:
        raise ConfigError("the number of processes must be given. Received: no -np and no "
                          "mpi.processes_per_host. Fix: pass `-np N`.")
    # `tfsmp run` always launches under mpirun, with -np ranks on this host.
    dist["mpi"] = {**dist.get("mpi", {}), "enabled": True, "processes_per_host": ppn}
    resolved = resolve_distribution(dist, instance_count=1,
                                    resources=resources or Resources("local", 0, ppn))
    _, custom = _parse_custom(resolved.custom_mpi_options)
    return RunOptions(resolved.processes_per_host, resolved.mp_parameters, custom,
                      resolved.warnings)

"""The SDK's validation of an estimator's `distribution=` dict, then tfsmp's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tfsmp.config import Config, parse_mp_parameters, validate
from tfsmp.errors import ConfigError, did_you_mean, short_repr
from tfsmp.launch.sagemaker.instances import Resources

__all__ = ["SMDISTRIBUTED_SUPPORTED_STRATEGIES", "Distribution", "get_mp_parameters",
           "resolve_distribution", "validate_smdistributed"]

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
                          f" Received: smdistributed={short_repr(smd, 200)}. Pass "
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
                              + did_you_mean(strategy, SMDISTRIBUTED_SUPPORTED_STRATEGIES))


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
                          f"{short_repr(mp, 200)}. Pass {{'enabled': True, 'parameters': {{...}}}}.")
    if mp.get("enabled", False) is not True:
        return None
    params = parse_mp_parameters(mp.get("parameters", {}))
    if "partitions" not in params and "pipeline_parallel_degree" not in params:
        raise ConfigError("'partitions' is a required parameter. Received: parameters="
                          f"{short_repr(params, 200)}. Add e.g. 'partitions': 2 (the number of pipeline stages).")
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
                              f"{sorted(map(str, distribution))}.{did_you_mean(key, _DISTRIBUTION_KEYS)}"
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
                              f"{sorted(map(str, mp))}.{did_you_mean(key, _MODELPARALLEL_KEYS)} "
                              "It takes 'enabled' and 'parameters'; parameters go inside "
                              "'parameters'.")


def mpi_options_of(distribution: Mapping[str, Any]) -> tuple[bool, int | None, str]:
    """(enabled, processes_per_host, custom_mpi_options) of `distribution['mpi']`."""
    mpi = distribution.get("mpi", {})
    if not isinstance(mpi, Mapping):
        raise ConfigError(f"distribution['mpi'] must be a dict. Received: mpi={short_repr(mpi, 200)}. Pass "
                          "{'enabled': True, 'processes_per_host': N}.")
    for key in mpi:
        if key not in _MPI_KEYS:
            # The SDK ignores unknown keys, so a typo silently launches one process per host
            # (amazon-sagemaker-examples#1872).
            raise ConfigError(f"Unknown key {key!r} in distribution['mpi']. Received: mpi keys "
                              f"{sorted(map(str, mpi))}.{did_you_mean(key, _MPI_KEYS)} Valid "
                              f"keys: {list(_MPI_KEYS)}.")
    enabled = mpi.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"mpi enabled must be a value in: [True, False]. Received: "
                          f"enabled={short_repr(enabled, 200)}.")
    ppn = mpi.get("processes_per_host")
    if ppn is not None and (isinstance(ppn, bool) or not isinstance(ppn, int) or ppn < 1):
        raise ConfigError(f"processes_per_host must be a positive integer. Received: "
                          f"processes_per_host={short_repr(ppn, 200)}. Pass e.g. 'processes_per_host': 8 "
                          "(one per GPU).")
    custom = mpi.get("custom_mpi_options", "")
    if not isinstance(custom, str):
        raise ConfigError(f"custom_mpi_options must be a str of mpirun flags. Received: "
                          f"custom_mpi_options={short_repr(custom, 200)}. Pass e.g. '-x NCCL_DEBUG=WARN'.")
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
        raise ConfigError(f"distribution must be a dict. Received: distribution={short_repr(dist, 200)}.")
    _check_top_level(dist)
    validate_smdistributed(dist)
    _check_modelparallel_keys(dist)
    params = get_mp_parameters(dist)
    config = validate(params) if params is not None else None
    enabled, ppn_given, custom = mpi_options_of(dist)
    if config is not None and not enabled:
        raise ConfigError(
            "modelparallel needs MPI: the library runs one process per pipeline stage under "
            "mpirun. Received: distribution['mpi'] = "
            f"{short_repr(dist.get('mpi'), 200)}. Add 'mpi': {{'enabled': True, 'processes_per_host': N}}.")
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

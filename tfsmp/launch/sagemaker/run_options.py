"""`tfsmp run --distribution`: a `distribution=` dict validated for one host of this machine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tfsmp.config import parse_mp_parameters
from tfsmp.errors import ConfigError
from tfsmp.launch.sagemaker.distribution import mpi_options_of, resolve_distribution
from tfsmp.launch.sagemaker.instances import Resources
from tfsmp.launch.sagemaker.mpi_options import parse_custom_options

__all__ = ["RunOptions", "run_options"]


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
    _, ppn_given, _ = mpi_options_of(dist)
    ppn = np or ppn_given
    if ppn is None:
        raise ConfigError("the number of processes must be given. Received: no -np and no "
                          "mpi.processes_per_host. Fix: pass `-np N`.")
    # `tfsmp run` always launches under mpirun, with -np ranks on this host.
    dist["mpi"] = {**dist.get("mpi", {}), "enabled": True, "processes_per_host": ppn}
    resolved = resolve_distribution(dist, instance_count=1,
                                    resources=resources or Resources("local", 0, ppn))
    _, custom = parse_custom_options(resolved.custom_mpi_options)
    return RunOptions(resolved.processes_per_host, resolved.mp_parameters, custom,
                      resolved.warnings)

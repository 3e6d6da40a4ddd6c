"""The toolkit's mpirun command (`MasterRunner._create_command`) in Open MPI 5, one app context per host."""

from __future__ import annotations

import shlex
from collections.abc import Collection, Mapping, Sequence

from tfsmp.launch.mpirun import build_mpirun_command
from tfsmp.launch.sagemaker.instances import EFA_NCCL_INSTANCES, EFA_RDMA_INSTANCES
from tfsmp.launch.sagemaker.mpi_options import (
    merge_mpi_options,
    option_groups,
    parse_custom_options,
)

__all__ = ["JOB_VARIABLES", "exported_names", "format_command", "toolkit_mpirun_command"]

# Variables tfsmp adds to a job: the container's /opt/ml (the toolkit's own convention outside
# SageMaker), the checkpoint directory, and how the ranks import the code and tfsmp.
JOB_VARIABLES = ("SAGEMAKER_BASE_DIR", "TFSMP_CHECKPOINT_DIR", "PYTHONPATH", "PYTHONUNBUFFERED")


def exported_names(env: Mapping[str, str], extra: Sequence[str] = JOB_VARIABLES,
                   per_host: Collection[str] = ("SM_CURRENT_HOST",)) -> list[str]:
    """What mpirun exports with `-x NAME`: the job's `SM_*` variables (the toolkit exports them all)
    then `extra`, except the `per_host` ones (each host's app context sets its own)."""
    names = [*sorted(k for k in env if k.startswith("SM_")), *extra]
    return [name for name in names if name not in per_host]


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


# [Note: emulated hosts] A job of `instance_count` hosts runs as one mpirun with one app context per
# host (`-np ppn ... : -np ppn ...`), all mapped by slot onto the hostfile's slots. Each context sets
# its own `SM_CURRENT_HOST=algo-<i>`; every other `SM_*` variable is the master's, exported with
# `-x` as the toolkit does. On SageMaker even `SM_CURRENT_HOST` is the master's on every rank
# (toolkit issue #158); here it names the rank's host.
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
            context); default `SM_CURRENT_HOST` alone. [Note: hosts across machines] in
            hosts.py
        host_list: Across machines: `--host` text ("algo-1:2,algo-2:2") instead of the hostfile.
        tcp_interface: `btl_tcp_if_include` and `oob_tcp_if_include`, as the toolkit sets them
            (None: Open MPI's choice).

    Returns:
        The argv.
    """
    per_host = list(host_env) if host_env is not None else [
        {"SM_CURRENT_HOST": host} for host in hosts]
    nccl_debug, custom = parse_custom_options(custom_mpi_options)
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
    custom_keys = {key for key, _ in option_groups(custom)}
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

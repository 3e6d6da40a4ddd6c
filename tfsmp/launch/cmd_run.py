"""`tfsmp run`: validate the config for the world size, then launch the script under mpirun.

Example::

    tfsmp run -np 4 --config '{"partitions": 2, "microbatches": 8}' train.py --epochs 3
    tfsmp run --distribution '{"smdistributed": {"modelparallel": {"enabled": true,
        "parameters": {"partitions": 2}}}, "mpi": {"enabled": true, "processes_per_host": 4}}' train.py
    tfsmp run --hosts algo-1:2,algo-2:2 --config '{"partitions": 2}' train.py   # -np 4

Across hosts, the ranks of other hosts get the environment they need (see [Note: remote
environment] in `tfsmp.launch.hosts`) and Open MPI's TCP traffic goes over one interface, chosen
as the SageMaker toolkit does (`--network-interface`, else `SM_NETWORK_INTERFACE_NAME`, else the
interface of the route to the hosts). Each rank runs under `tfsmp.launch.rankguard`, so a rank
killed by a signal is reported with its host ([Note: who died] there). The ranks' stderr passes
through `tfsmp.launch.output`, which drops TensorFlow's start-up lines ([Note: quiet start-up]).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tfsmp.launch.hosts import HostSlots

__all__ = ["parse_distribution", "register", "resolve_hosts", "resolve_launch", "run"]


def parse_distribution(text: str) -> tuple[dict[str, Any], int | None]:
    """Reads a SageMaker estimator `distribution=` dict (JSON text or file path).

    Only what `tfsmp run` needs: `smdistributed.modelparallel.parameters` (the config) and
    `mpi.processes_per_host` (-np). The full SDK validation lives in `tfsmp.launch.sagemaker`.

    Args:
        text: JSON text, or the path of a JSON file.

    Returns:
        (parameters, processes_per_host or None).

    Raises:
        ConfigError: The text is not a JSON object of that shape.
    """
    from tfsmp.config import parse_mp_parameters
    from tfsmp.errors import ConfigError

    dist = parse_mp_parameters(text)
    mp = dist.get("smdistributed", {}).get("modelparallel", {})
    mpi = dist.get("mpi", {})
    if not isinstance(mp, Mapping) or not isinstance(mpi, Mapping):
        raise ConfigError("distribution must look like {'smdistributed': {'modelparallel': "
                          "{'enabled': True, 'parameters': {...}}}, 'mpi': {'enabled': True, "
                          f"'processes_per_host': N}}. Received: distribution={dist!r}")
    params = mp.get("parameters", {})
    if not isinstance(params, Mapping):
        raise ConfigError("smdistributed.modelparallel.parameters must be a dict. "
                          f"Received: parameters={params!r}")
    ppn = mpi.get("processes_per_host")
    if ppn is not None and (not isinstance(ppn, int) or isinstance(ppn, bool) or ppn < 1):
        raise ConfigError("mpi.processes_per_host must be a positive integer. "
                          f"Received: processes_per_host={ppn!r}")
    return dict(params), ppn


def resolve_launch(args: argparse.Namespace,
                   environ: Mapping[str, str] | None = None) -> tuple[int, str | None]:
    np, config_json, _ = resolve_launch_options(args, environ)
    return np, config_json


def resolve_hosts(args: argparse.Namespace) -> list[HostSlots]:
    """The hosts of `--hostfile` or `--hosts` ([] for a one-host launch).

    Raises:
        ConfigError: Both were given, or either is malformed.
    """
    from tfsmp.errors import ConfigError
    from tfsmp.launch.hosts import parse_hostfile, parse_hosts

    hostfile, hosts = getattr(args, "hostfile", None), getattr(args, "hosts", None)
    if hostfile and hosts:
        raise ConfigError("--hostfile and --hosts are mutually exclusive. Received: "
                          f"hostfile={hostfile!r}, hosts={hosts!r}. Fix: pass one of them.")
    if hostfile:
        return parse_hostfile(hostfile)
    return parse_hosts(hosts) if hosts else []


def _np_for_hosts(np: int | None, hosts: list[HostSlots]) -> int | None:
    """-np of a multi-host launch: the given one (at most the slots), else all slots."""
    from tfsmp.errors import ConfigError
    from tfsmp.launch.hosts import total_slots

    slots = total_slots(hosts)
    if np is None:
        return slots
    if slots is not None and np > slots:
        raise ConfigError(
            f"-np must not exceed the slots of the hosts. Received: np={np}, slots={slots} "
            f"({','.join(map(str, hosts))}). Fix: give the hosts more slots, or lower -np.")
    return np


def resolve_launch_options(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
                           hosts: list[HostSlots] | None = None
                           ) -> tuple[int, str | None, list[str]]:
    """Works out -np and the config JSON, and validates the config for that world size.

    Args:
        args: The parsed `tfsmp run` arguments.
        environ: The environment (default: os.environ).
        hosts: The hosts of a multi-host launch: -np defaults to processes_per_host times
            their number, else to their slots.

    Returns:
        (np, config_json, mpi_args); config_json is None when neither --config nor
        --distribution was given (the ranks then read TFSMP_CONFIG / SM_HP_MP_PARAMETERS from
        the environment).

    Raises:
        ConfigError: The config is invalid, does not fit -np, or -np is missing.
    """
    from tfsmp.config import load_config, parse_mp_parameters
    from tfsmp.errors import ConfigError
    from tfsmp.launch.mpirun import CONFIG_ENV

    params: dict[str, Any] = {}
    np = args.np
    mpi_args: list[str] = []
    if args.distribution:
        # The SDK's own validation (messages, the `process_per_host` did-you-mean, the
        # partitions rule) and the distribution's custom_mpi_options for mpirun.
        from tfsmp.launch.sagemaker import run_options

        options = run_options(args.distribution, np=np)
        for warning in options.warnings:
            print(f"tfsmp run: warning: {warning}", file=sys.stderr)
        params, mpi_args = dict(options.parameters or {}), list(options.mpi_args)
        # SageMaker runs processes_per_host ranks on every host.
        np = options.np if np is not None or not hosts else options.np * len(hosts)
    if args.config:
        params.update(parse_mp_parameters(args.config))
    if hosts:
        np = _np_for_hosts(np, hosts)
    if np is None:
        raise ConfigError("the number of processes must be given. Received: no -np and no "
                          "mpi.processes_per_host. Fix: pass `-np N`.")
    env = dict(os.environ if environ is None else environ)
    if params:  # mpirun's `-x SM_HP_MP_PARAMETERS=...` replaces the launcher's own value
        env.pop(CONFIG_ENV, None)
    load_config(params or None, environ=env, world_size=np)
    return np, (json.dumps(params) if params else None), mpi_args


def _interface(args: argparse.Namespace, hosts: list[HostSlots],
               environ: Mapping[str, str]) -> str | None:
    """`--network-interface`; else SageMaker's SM_NETWORK_INTERFACE_NAME; else the route's."""
    from tfsmp.launch.hosts import check_interface, default_interface

    given = getattr(args, "network_interface", None) or environ.get("SM_NETWORK_INTERFACE_NAME")
    if given:
        return check_interface(given)
    return default_interface(hosts) if hosts else None


def run(args: argparse.Namespace) -> int:
    """Entry point of `tfsmp run`; returns mpirun's exit code (2 for an invalid config)."""
    from tfsmp.errors import ConfigError
    from tfsmp.launch import ownjob
    from tfsmp.launch.hosts import forwarded_env
    from tfsmp.launch.mpirun import build_mpirun_command, find_mpirun, job_tmpdir

    try:
        hosts = resolve_hosts(args)
        np, config_json, dist_mpi_args = resolve_launch_options(args, hosts=hosts)
        interface = _interface(args, hosts, os.environ)
        cap_prefix, cap_env = _memory_cap(args)
        if not args.dry_run:
            _check_script(args.script)
        grace = ownjob.grace_seconds(getattr(args, "stop_grace", None))
        # [Note: the launcher obeys the model] in tfsmp/partitioning/memory_check.py
        from tfsmp.launch.memcap import check_before_launch

        config_json, decided = check_before_launch(args, np, config_json)
    except (ConfigError, ValueError) as e:
        print(f"tfsmp run: error: {e}", file=sys.stderr)
        return 2
    if decided:
        print(f"tfsmp run: {decided}", file=sys.stderr)
    from tfsmp.launch import restart  # --max-restarts (docs/resume.md)

    restart.prepare_environ(args)
    user_env = dict(item.split("=", 1) if "=" in item else (item, None) for item in args.env or [])
    user_env.update(cap_env)
    # Ranks on this host inherit the environment; the other hosts' ranks only get `-x` names.
    env = {**(forwarded_env(os.environ) if hosts else {}), **user_env}
    with contextlib.ExitStack() as job:
        if not hosts and not args.dry_run and "TMPDIR" not in user_env:
            env["TMPDIR"] = job.enter_context(job_tmpdir())  # [Note: a job's temp folder]
        argv = build_mpirun_command(
            np, [args.script, *args.script_args], config_json=config_json,
            hostfile=args.hostfile, hosts=[str(h) for h in hosts] if args.hosts else None,
            env=env, extra_mpi_args=[*dist_mpi_args, *shlex.split(args.mpi_args or "")],
            tag_output=args.tag_output, mpirun=find_mpirun(), network_interface=interface,
            rank_guard=bool(hosts) or bool(getattr(args, "max_restarts", 0)),
            rank_prefix=cap_prefix, local_only=not hosts, huge_pages=True)
        if args.dry_run:
            print(shlex.join(argv))
            return 0
        sys.stdout.flush()
        from tfsmp.launch.output import run_filtered, tf_logs_wanted

        tf_logs = args.tf_logs or tf_logs_wanted()
        if getattr(args, "max_restarts", 0):  # relaunch after a failure (docs/resume.md)
            return restart.run(args, argv, hosts, np, config_json, tf_logs=tf_logs)
        return run_filtered(argv, tf_logs=tf_logs, grace=grace)


def _check_script(script: str) -> None:
    """The script must exist before any process starts (`-m module` is left to Python).

    Raises:
        ConfigError: It does not exist, or is a directory.
    """
    from tfsmp.errors import ConfigError

    if script.startswith("-") or os.path.isfile(script):
        return
    what = "is a directory" if os.path.isdir(script) else "does not exist"
    raise ConfigError(f"the script to run must be a file. Received: {script!r}, which {what} "
                      f"(working directory {os.getcwd()}). Fix: check the path.")


def _memory_cap(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """`--memory-per-rank`: each rank's cgroup, or TF's GPU limit (`tfsmp.launch.memcap`)."""
    size = getattr(args, "memory_per_rank", None)
    if not size:
        return [], {}
    from tfsmp.launch.memcap import launch_setup

    return launch_setup(size)


def register(subparsers: Any) -> None:
    """Adds the `run` sub-command."""
    p = subparsers.add_parser(
        "run", help="launch a training script on N processes under mpirun",
        description="Validate the config for the world size, then run `mpirun ... python -m "
                    "mpi4py SCRIPT ARGS` with the config in SM_HP_MP_PARAMETERS.")
    p.add_argument("-np", "--np", "-n", type=int, default=None, metavar="N",
                   help="number of processes (default: mpi.processes_per_host of --distribution, "
                        "times the hosts; else the hosts' slots)")
    p.add_argument("--config", help="tfsmp/SMP parameters: JSON text or a JSON file path")
    p.add_argument("--distribution", help="a SageMaker estimator distribution= dict (JSON)")
    p.add_argument("--hostfile", help="Open MPI hostfile (`host slots=N` lines); -np defaults "
                   "to the total slots")
    p.add_argument("--hosts", "--host", dest="hosts", metavar="H1:N,H2:N",
                   help="hosts and their slots, e.g. algo-1:2,algo-2:2; -np defaults to the sum")
    p.add_argument("--network-interface", metavar="IFACE",
                   help="interface for Open MPI's TCP traffic across hosts (btl_tcp_if_include "
                        "and oob_tcp_if_include); default: SM_NETWORK_INTERFACE_NAME, else the "
                        "interface of the route to the hosts")
    p.add_argument("-x", "--env", action="append", metavar="NAME[=VALUE]",
                   help="export an environment variable to every rank (repeatable)")
    p.add_argument("--memory-per-rank", metavar="SIZE",
                   help="cap every rank's memory, e.g. 2.5G (K/M/G/T = powers of 1024): one "
                        "memory cgroup per rank on CPU hosts (a rank above it is killed), "
                        "TensorFlow's device memory limit on GPU hosts")
    p.add_argument("--model", metavar="MODULE:FUNCTION",
                   help="with --memory-per-rank: the script's model (a function returning it, "
                        "as for `tfsmp plan`); the memory model then picks a plan that fits, "
                        "or refuses before launching and says what would fit")
    p.add_argument("--batch-size", type=int, default=None,
                   help="with --model: samples per step over all replicas (default: one per "
                        "microbatch and replica)")
    p.add_argument("--input-shape", action="append", metavar="NAME=D1xD2",
                   help="with --model: per-sample shape of an input with unknown dimensions "
                        "(repeatable)")
    p.add_argument("--optimizer", default=None,
                   help="with --model: optimizer name for its state (default: the model's "
                        "compiled optimizer, else adam)")
    p.add_argument("--mpi-args", help="extra mpirun flags, appended verbatim (quote them)")
    p.add_argument("--no-tag-output", dest="tag_output", action="store_false",
                   help="do not prefix output lines with [job,rank]")
    p.add_argument("--dry-run", action="store_true", help="print the mpirun command and exit")
    p.add_argument("--tf-logs", action="store_true",
                   help="show TensorFlow's start-up log lines, which tfsmp run drops (also: env "
                        "TFSMP_TF_LOGS=1); see [Note: quiet start-up] in tfsmp/launch/output.py")
    p.add_argument("--stop-grace", type=float, default=None, metavar="SECONDS",
                   help="after a SIGTERM, SIGINT or SIGHUP to tfsmp run, the seconds the ranks "
                        "get to write a backup before the job is killed (env TFSMP_STOP_GRACE; "
                        "default 30); see [Note: the launcher owns its job] in "
                        "tfsmp/launch/ownjob.py")
    from tfsmp.launch.restart import add_arguments  # --max-restarts and more (docs/resume.md)

    add_arguments(p)
    p.add_argument("script", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)

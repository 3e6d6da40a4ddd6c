"""`tfsmp run`: validate the config for the world size, then launch the script under mpirun.

Example::

    tfsmp run -np 4 --config '{"partitions": 2, "microbatches": 8}' train.py --epochs 3
    tfsmp run --distribution '{"smdistributed": {"modelparallel": {"enabled": true,
        "parameters": {"partitions": 2}}}, "mpi": {"enabled": true, "processes_per_host": 4}}' train.py
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["parse_distribution", "register", "resolve_launch", "run"]


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


def resolve_launch_options(args: argparse.Namespace, environ: Mapping[str, str] | None = None
                           ) -> tuple[int, str | None, list[str]]:
    """Works out -np and the config JSON, and validates the config for that world size.

    Returns:
        (np, config_json); config_json is None when neither --config nor --distribution was given
        (the ranks then read TFSMP_CONFIG / SM_HP_MP_PARAMETERS from the environment).

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
        params, np, mpi_args = dict(options.parameters or {}), options.np, list(options.mpi_args)
    if args.config:
        params.update(parse_mp_parameters(args.config))
    if np is None:
        raise ConfigError("the number of processes must be given. Received: no -np and no "
                          "mpi.processes_per_host. Fix: pass `-np N`.")
    env = dict(os.environ if environ is None else environ)
    if params:  # mpirun's `-x SM_HP_MP_PARAMETERS=...` replaces the launcher's own value
        env.pop(CONFIG_ENV, None)
    load_config(params or None, environ=env, world_size=np)
    return np, (json.dumps(params) if params else None), mpi_args


def run(args: argparse.Namespace) -> int:
    """Entry point of `tfsmp run`; returns mpirun's exit code (2 for an invalid config)."""
    from tfsmp.errors import ConfigError
    from tfsmp.launch.mpirun import build_mpirun_command, find_mpirun

    try:
        np, config_json, dist_mpi_args = resolve_launch_options(args)
    except ConfigError as e:
        print(f"tfsmp run: error: {e}", file=sys.stderr)
        return 2
    env = dict(item.split("=", 1) if "=" in item else (item, None) for item in args.env or [])
    argv = build_mpirun_command(
        np, [args.script, *args.script_args], config_json=config_json, hostfile=args.hostfile,
        hosts=args.host, env=env,
        extra_mpi_args=[*dist_mpi_args, *shlex.split(args.mpi_args or "")],
        tag_output=args.tag_output, mpirun=find_mpirun())
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    sys.stdout.flush()
    return subprocess.call(argv)


def register(subparsers: Any) -> None:
    """Adds the `run` sub-command."""
    p = subparsers.add_parser(
        "run", help="launch a training script on N processes under mpirun",
        description="Validate the config for the world size, then run `mpirun ... python -m "
                    "mpi4py SCRIPT ARGS` with the config in SM_HP_MP_PARAMETERS.")
    p.add_argument("-np", "--np", "-n", type=int, default=None, metavar="N",
                   help="number of processes (default: mpi.processes_per_host of --distribution)")
    p.add_argument("--config", help="tfsmp/SMP parameters: JSON text or a JSON file path")
    p.add_argument("--distribution", help="a SageMaker estimator distribution= dict (JSON)")
    p.add_argument("--hostfile", help="Open MPI hostfile (`host slots=N` lines)")
    p.add_argument("--host", help="hosts as h1:slots,h2:slots")
    p.add_argument("-x", "--env", action="append", metavar="NAME[=VALUE]",
                   help="export an environment variable to every rank (repeatable)")
    p.add_argument("--mpi-args", help="extra mpirun flags, appended verbatim (quote them)")
    p.add_argument("--no-tag-output", dest="tag_output", action="store_false",
                   help="do not prefix output lines with [job,rank]")
    p.add_argument("--dry-run", action="store_true", help="print the mpirun command and exit")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)

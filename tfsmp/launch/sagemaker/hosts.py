"""A job's hosts: their names, whether they run across machines or on this one, the hostfile."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tfsmp.errors import ConfigError

__all__ = ["HOSTS_SETTING", "host_names", "hostfile_text", "runs_across_hosts"]


def host_names(instance_count: int) -> list[str]:
    """SageMaker's host names: algo-1 .. algo-N."""
    return [f"algo-{i}" for i in range(1, instance_count + 1)]


# [Note: hosts across machines] With `instance_count` > 1 a job runs either on this machine alone
# ([Note: emulated hosts] in command.py) or across the machines named algo-1 .. algo-N, launched
# from algo-1 as the toolkit does (`--host algo-1:N,algo-2:N`, TCP on the interface towards the
# others). The hosts share the job directory (a shared filesystem, or one machine's emulated hosts),
# so each host's /opt/ml is its own directory inside it: algo-1's is the job directory itself (its
# `model/` is the artifact, as the master's is on SageMaker), algo-<i>'s is `hosts/algo-<i>/` with
# its own `input/config/resourceconfig.json`, `model/` and `output/`. Every variable whose value
# differs between hosts (`SM_CURRENT_HOST`, `SAGEMAKER_BASE_DIR`, `SM_MODEL_DIR`, `SM_TRAINING_ENV`
# ...) is set per host in that host's app context.
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

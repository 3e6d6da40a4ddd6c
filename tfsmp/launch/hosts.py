"""Hosts of a multi-host launch: `--hosts` and hostfiles, what remote ranks need, the TCP interface.

Example::

    hosts = parse_hosts("algo-1:2,algo-2:2")         # [HostSlots("algo-1", 2), ...]
    total_slots(hosts)                                # 4
    forwarded_env(os.environ)                         # {"PATH": None, "SM_HOSTS": None, ...}
    default_interface(hosts)                          # "eth0": the route to algo-2 goes there

[Note: remote environment] mpirun starts the ranks of another host through ssh, whose shell does
not inherit the launcher's environment (measured on emulated hosts, docs/multihost.md): only `-x NAME` variables
(and Open MPI's own) arrive. So a multi-host `tfsmp run` exports the variables a rank needs:
PATH, PYTHONPATH and LD_LIBRARY_PATH, tfsmp's and SageMaker's (TFSMP_*, SM_*), TensorFlow's
thread and log settings (TF_*), and the root permission of Open MPI. The interpreter is given as
an absolute path (the launcher's `sys.executable`), so it need not be on the remote PATH.

Pure: imports neither TensorFlow nor mpi4py.
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tfsmp.errors import ConfigError

__all__ = ["FORWARD_NAMES", "FORWARD_PREFIXES", "HostSlots", "check_interface",
           "default_interface", "forwarded_env", "parse_hostfile", "parse_hosts", "total_slots"]

FORWARD_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS",
                 "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
FORWARD_PREFIXES = ("TFSMP_", "SM_", "TF_", "HOROVOD_", "NCCL_")
# A hostname or IPv4 address (IPv6 literals would clash with the `host:slots` colon).
_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?$")
_INTERFACE = re.compile(r"^[A-Za-z0-9_.:/@-]+(,[A-Za-z0-9_.:/@-]+)*$")
_HOSTS_EXAMPLE = "algo-1:2,algo-2:2"


@dataclass(frozen=True)
class HostSlots:
    """A host and how many ranks it takes (None: Open MPI's default, its number of cores)."""

    name: str
    slots: int | None = None

    def __str__(self) -> str:
        return self.name if self.slots is None else f"{self.name}:{self.slots}"


def _check_name(name: str, where: str) -> None:
    if not _HOST_NAME.match(name):
        raise ConfigError(f"a host must be a hostname or IPv4 address (letters, digits, '.', '-', "
                          f"'_'). Received: host={name!r} in {where}. Fix: write HOST or "
                          f"HOST:SLOTS, e.g. {_HOSTS_EXAMPLE}.")


def _slots(text: str, name: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"the slots of a host must be a positive integer. Received: "
                          f"slots={text!r} for host {name!r} in {where}. Fix: write "
                          f"{name}:2 (or leave the slots out for one).")
    return int(text)


def parse_hosts(text: str | Sequence[str]) -> list[HostSlots]:
    """Parses `--hosts` (Open MPI's `--host` syntax): `h1:2,h2:2`; a bare `h1` takes 1 slot.

    Raises:
        ConfigError: An item is empty, has more than one ':', a bad name or bad slots, or a
            host repeats.
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    where = f"hosts={text if isinstance(text, str) else ','.join(text)!r}"
    hosts: list[HostSlots] = []
    for item in items:
        parts = item.strip().split(":")
        if not item.strip() or len(parts) > 2:
            raise ConfigError(f"hosts must be HOST[:SLOTS] items separated by commas. Received: "
                              f"item {item!r} in {where}. Fix: e.g. --hosts {_HOSTS_EXAMPLE}.")
        _check_name(parts[0], where)
        hosts.append(HostSlots(parts[0], _slots(parts[1], parts[0], where)
                               if len(parts) == 2 else 1))
    _check_distinct(hosts, where)
    return hosts


def _check_distinct(hosts: Sequence[HostSlots], where: str) -> None:
    names = [h.name for h in hosts]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"each host must be listed once (give it more slots instead). "
                          f"Received: {repeated} repeated in {where}.")


def parse_hostfile(path: str | Path) -> list[HostSlots]:
    """Reads an Open MPI hostfile: `host [slots=N] [max_slots=M]` lines, `#` comments.

    Raises:
        ConfigError: The file is missing, lists no host, or a line is malformed.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"the hostfile must exist. Received: hostfile={str(path)!r}. Fix: "
                          "write one `HOST slots=N` line per host.")
    hosts: list[HostSlots] = []
    for number, raw in enumerate(file.read_text().splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        where = f"line {number} of hostfile {str(path)!r}"
        _check_name(words[0], where)
        slots: int | None = None
        for word in words[1:]:
            key, eq, value = word.partition("=")
            if not eq:
                raise ConfigError(f"hostfile lines must be `HOST slots=N`. Received: {raw.strip()!r}"
                                  f" on {where}. Fix: write `{words[0]} slots=2`.")
            if key == "slots":
                slots = _slots(value, words[0], where)
        hosts.append(HostSlots(words[0], slots))
    if not hosts:
        raise ConfigError(f"the hostfile must list at least one host. Received: no host in "
                          f"{str(path)!r}. Fix: write one `HOST slots=N` line per host.")
    _check_distinct(hosts, f"hostfile {str(path)!r}")
    return hosts


def total_slots(hosts: Iterable[HostSlots]) -> int | None:
    """The ranks the hosts take together; None when a host's slots are not given."""
    slots = [h.slots for h in hosts]
    return None if any(s is None for s in slots) else sum(s for s in slots if s is not None)


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str | None]:
    """The variables to export to remote ranks with `-x NAME` (value None: the launcher's own).

    See [Note: remote environment].
    """
    return {name: None for name in sorted(environ)
            if name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES)}


def check_interface(name: str) -> str:
    """Validates a `--network-interface` value (an interface, a list of them, or a CIDR)."""
    if not _INTERFACE.match(name):
        raise ConfigError(f"the network interface must be an interface name such as eth0 (or a "
                          f"comma-separated list, or a CIDR such as 10.0.0.0/8). Received: "
                          f"network_interface={name!r}. Fix: see `ip -br addr` on the hosts.")
    return name


def _routes(text: str) -> list[tuple[str, int, int]]:
    """(interface, destination, mask) of each IPv4 route in /proc/net/route text."""
    routes = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8:
            try:  # the kernel prints each address as a native-endian 32-bit hex number
                dest, mask = int(fields[1], 16), int(fields[7], 16)
            except ValueError:
                continue
            routes.append((fields[0], dest, mask))
    return routes


def _read_routes() -> str:
    try:
        return Path("/proc/net/route").read_text()
    except OSError:
        return ""


def _resolve(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def default_interface(hosts: Iterable[HostSlots], *, routes: str | None = None,
                      resolve: Callable[[str], str | None] | None = None) -> str | None:
    """The interface this host reaches the other hosts through (None: let Open MPI choose).

    SageMaker passes its `SM_NETWORK_INTERFACE_NAME` as both `btl_tcp_if_include` and
    `oob_tcp_if_include`; without it, the interface of the most specific route to the first
    resolvable non-loopback host is the one its traffic would take.

    Args:
        hosts: The hosts of the launch.
        routes: /proc/net/route text (default: this network namespace's).
        resolve: Name -> IPv4 address, or None (default: the system resolver).
    """
    table = _routes(_read_routes() if routes is None else routes)
    for host in hosts:
        address = (resolve or _resolve)(host.name)
        if not address or address.startswith("127."):
            continue
        ip = struct.unpack("=I", socket.inet_aton(address))[0]
        matches = [(bin(mask).count("1"), iface) for iface, dest, mask in table
                   if ip & mask == dest and iface != "lo"]
        if matches:
            return max(matches)[1]
    return None

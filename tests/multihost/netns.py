"""Emulated hosts on one Linux machine: network + UTS namespaces on a bridge, an ssh stand-in.

Example::

    cluster = up(["hostA", "hostB"])              # removes what a crashed run left first
    res = cluster.run("hostA", ["hostname"], timeout=10)
    down()

Each host is a network namespace `tfsmpmh-<name>` with one interface `eth0` (10.77.0.11, .12, ...)
on a Linux bridge that lives in its own "switch" namespace `tfsmpmh-switch`; nothing is created in
the machine's own network namespace, so the test never touches the real network. Each host also has
a persistent UTS namespace (its hostname), a hosts file (`/etc/netns/<ns>/hosts`, which
`ip netns exec` mounts over /etc/hosts) and its own TMPDIR (Open MPI's session directories).
`agent` is an executable that behaves like `ssh HOST COMMAND` into those hosts (a fresh login-like
environment, not the caller's); Open MPI 5 uses it as its launch agent through
`PRTE_MCA_plm_ssh_agent` (docs/multihost.md). Every command started here is bounded by
`timeout -k 5 N` (SIGKILL after SIGTERM), since a failed remote launch can leave prterun ignoring
SIGTERM. Still shared between hosts: kernel, PIDs, filesystem and cores.

Used by the pytest fixture in tests/multihost/conftest.py and by scripts/emulated_hosts.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PREFIX", "STATE_DIR", "Cluster", "Host", "down", "load", "session",
           "stale_namespaces", "unavailable", "up"]

PREFIX = "tfsmpmh"                       # every namespace, file and link name of ours starts so
SWITCH = f"{PREFIX}-switch"
SUBNET = "10.77.0"                        # only ever assigned inside our own namespaces
STATE_DIR = Path("/tmp/tfsmp-multihost")  # UTS bind-mount files, TMPDIRs, the agent
NETNS_ETC = Path("/etc/netns")
MTU = 65535                               # ~2.5x faster small messages on veths (measured)
# What a non-interactive ssh session on Debian gets: not the caller's PATH or PYTHONPATH.
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_TOOLS = ("ip", "nsenter", "unshare", "timeout", "umount", "bash")
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21


@dataclass(frozen=True)
class Host:
    """One emulated host: its name (= hostname), namespace, address, UTS file and TMPDIR."""

    name: str
    index: int

    @property
    def ns(self) -> str:
        return f"{PREFIX}-{self.name}"

    @property
    def address(self) -> str:
        return f"{SUBNET}.{11 + self.index}"

    @property
    def uts(self) -> Path:
        return STATE_DIR / f"{self.name}.uts"

    @property
    def tmpdir(self) -> Path:
        return STATE_DIR / self.name / "tmp"


def _sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["timeout", "-k", "5", str(int(timeout)), *argv], capture_output=True,
                          text=True, check=check)


def _effective_caps() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def unavailable() -> str | None:
    """Why hosts cannot be emulated here (None when they can): tools, root, rights, a probe."""
    if not sys.platform.startswith("linux"):
        return f"emulated hosts need Linux network namespaces. Received: platform={sys.platform}"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"emulated hosts need iproute2 and util-linux. Received: missing tools {missing}"
    if os.geteuid() != 0:
        return (f"emulated hosts need root (network namespaces, bind mounts). Received: "
                f"euid={os.geteuid()}. CI runs as root and runs these tests.")
    caps = _effective_caps()
    for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"), (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN")):
        if not caps >> bit & 1:
            return f"emulated hosts need {name}. Received: CapEff={caps:#x} (an unprivileged " \
                   "container?)"
    probe = f"{PREFIX}-probe"
    made = _sh("ip", "netns", "add", probe, check=False)
    _sh("ip", "netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` must work. Received: {made.stderr.strip() or made.returncode}"
    return None


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One set-up or tear-down at a time on this machine (two pytest sessions, the script)."""
    with open(f"{STATE_DIR}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def session() -> Iterator[None]:
    """Held by whoever uses the hosts for a while (a pytest session, a benchmark): `up` removes
    every host of ours, so a second user waits here until the first is done."""
    with open(f"{STATE_DIR}.session.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def stale_namespaces() -> list[str]:
    """Our namespaces that exist now (left by a crashed run, or by `up`)."""
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.split() and line.split()[0].startswith(f"{PREFIX}-")]


def _kill_namespace_processes(ns: str) -> None:
    pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:  # by PID: never by name, other people's processes share this machine
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)


def _remove_all() -> None:
    for ns in stale_namespaces():
        _kill_namespace_processes(ns)
        _sh("ip", "netns", "del", ns, check=False)
    if STATE_DIR.exists():
        for uts in STATE_DIR.glob("*.uts"):
            _sh("umount", str(uts), check=False)
        shutil.rmtree(STATE_DIR, ignore_errors=True)
    if NETNS_ETC.exists():
        for d in NETNS_ETC.glob(f"{PREFIX}-*"):
            shutil.rmtree(d, ignore_errors=True)


def down() -> None:
    """Kills every process in our namespaces (by PID), deletes them and our files."""
    with _locked():
        _remove_all()


def _hosts_file(hosts: Sequence[Host]) -> str:
    lines = ["127.0.0.1\tlocalhost", *(f"{h.address}\t{h.name}" for h in hosts)]
    return "\n".join(lines) + "\n"


def _agent_script(hosts: Sequence[Host]) -> str:
    """`ssh [options] HOST COMMAND...` into an emulated host, as sshd would run it."""
    cases = "\n".join(
        f"  {h.name}|{h.address}) ns={h.ns}; uts={h.uts}; tmp={h.tmpdir} ;;" for h in hosts)
    return f"""#!/bin/bash
# ssh stand-in for emulated hosts (generated by tests/multihost/netns.py). Skips ssh options,
# then runs the command in the host's namespaces with a login-like environment, as sshd does.
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
case "$host" in
{cases}
  *) echo "emulated ssh: unknown host '$host'" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" nsenter --uts="$uts" -- env -i HOME="${{HOME:-/root}}" \\
  USER=root LOGNAME=root SHELL=/bin/bash PATH={LOGIN_PATH} TMPDIR="$tmp" /bin/bash -c "$*"
"""


def _add_host(host: Host) -> None:
    _sh("ip", "netns", "add", host.ns)
    _sh("ip", "link", "add", "eth0", "netns", host.ns, "mtu", str(MTU), "type", "veth",
        "peer", "name", f"p{host.index}", "netns", SWITCH, "mtu", str(MTU))
    _sh("ip", "-n", SWITCH, "link", "set", f"p{host.index}", "master", "br0", "up")
    _sh("ip", "-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
    _sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
    _sh("ip", "-n", host.ns, "link", "set", "lo", "up")
    host.uts.touch()
    _sh("unshare", f"--uts={host.uts}", "hostname", host.name)
    host.tmpdir.mkdir(parents=True, exist_ok=True)


def up(names: Sequence[str]) -> Cluster:
    """Brings up one emulated host per name (after removing any left by an earlier run).

    Raises:
        ValueError: A name is not a plain hostname, or names repeat.
        subprocess.CalledProcessError: A set-up command failed (what was made is removed).
    """
    for name in names:
        if not name or not all(c.isalnum() or c == "-" for c in name) or len(name) > 40:
            raise ValueError(f"host names must be letters, digits and '-' (at most 40). "
                             f"Received: name={name!r}")
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"host names must be distinct and at least one. Received: {list(names)}")
    hosts = [Host(name, i) for i, name in enumerate(names)]
    with _locked():
        _remove_all()
        try:
            STATE_DIR.mkdir(parents=True)
            _sh("ip", "netns", "add", SWITCH)
            _sh("ip", "-n", SWITCH, "link", "add", "br0", "mtu", str(MTU), "type", "bridge")
            _sh("ip", "-n", SWITCH, "link", "set", "br0", "up")
            for host in hosts:
                _add_host(host)
                (NETNS_ETC / host.ns).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / host.ns / "hosts").write_text(_hosts_file(hosts))
            agent = STATE_DIR / "ssh"
            agent.write_text(_agent_script(hosts))
            agent.chmod(0o755)
            (STATE_DIR / "hosts.json").write_text(json.dumps(list(names)))
        except BaseException:
            _remove_all()
            raise
    return Cluster(hosts, agent)


def load() -> Cluster:
    """The hosts `up` brought up (in another process, e.g. `scripts/emulated_hosts.py up`).

    Raises:
        RuntimeError: No emulated hosts are up.
    """
    state = STATE_DIR / "hosts.json"
    if not state.is_file() or not stale_namespaces():
        raise RuntimeError("emulated hosts must be up. Received: none found. Fix: "
                           "`python scripts/emulated_hosts.py up 2`.")
    names = json.loads(state.read_text())
    return Cluster([Host(name, i) for i, name in enumerate(names)], STATE_DIR / "ssh")


@dataclass
class Cluster:
    """Hosts that are up, and how to run a command on one of them."""

    hosts: list[Host]
    agent: Path

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no emulated host {name!r}; hosts are {[h.name for h in self.hosts]}")

    def command(self, name: str, argv: Sequence[str], timeout: float) -> list[str]:
        """The argv that runs `argv` on host `name`, killed (SIGKILL) 5 s after `timeout`."""
        h = self.host(name)
        return ["timeout", "-k", "5", str(int(timeout)), "ip", "netns", "exec", h.ns,
                "nsenter", f"--uts={h.uts}", "--", *argv]

    def environment(self, name: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """`env` (default: os.environ) plus the host's TMPDIR and Open MPI's launch agent."""
        out = dict(os.environ if env is None else env)
        out["TMPDIR"] = str(self.host(name).tmpdir)
        out["PRTE_MCA_plm_ssh_agent"] = str(self.agent)
        return out

    def run(self, name: str, argv: Sequence[str], *, timeout: float,
            env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        """Runs `argv` on host `name` as a user logged in there would (with `env`), bounded.

        The result's returncode is 124 (or -9 / 137) when the timeout struck.
        """
        proc = subprocess.Popen(self.command(name, argv, timeout), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=cwd,
                                env=self.environment(name, env), start_new_session=True)
        try:
            # `timeout -k 5` is the bound; this one only guards against `timeout` itself hanging.
            out, err = proc.communicate(timeout=timeout + 15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def kill_all(self) -> None:
        """SIGKILLs every process in the hosts' namespaces (after a test that timed out)."""
        for h in self.hosts:
            _kill_namespace_processes(h.ns)

"""The emulated-host harness itself: hostnames, addresses, the ssh stand-in's login environment,
clean-up after a crashed run, tear-down, and the SIGKILL bound on every command."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multihost import netns
from tests.multihost.netns import Cluster

pytestmark = pytest.mark.multihost


def test_hosts_have_their_names_addresses_and_a_login_shell_over_the_agent(
        hosts: Cluster) -> None:
    res = hosts.run("algo-1", ["bash", "-c", "hostname; echo $TMPDIR; getent hosts algo-2"],
                    timeout=20)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["algo-1", str(hosts.host("algo-1").tmpdir), "10.77.0.12",
                                  "algo-2"]
    # ssh-like: options skipped, the caller's environment not inherited, the host's TMPDIR.
    res = hosts.run("algo-1", [str(hosts.agent), "-x", "-o", "BatchMode=yes", "algo-2",
                               "echo", "$(hostname)", "${PYTHONPATH:-unset}", "$TMPDIR"],
                    timeout=20, env={"PYTHONPATH": "/caller", "PATH": "/usr/bin:/bin"})
    assert res.stdout.split() == ["algo-2", "unset", str(hosts.host("algo-2").tmpdir)], res
    res = hosts.run("algo-1", [str(hosts.agent), "nowhere", "true"], timeout=20)
    assert res.returncode == 255 and "unknown host 'nowhere'" in res.stderr


def test_every_command_is_bounded_by_a_sigkill_timeout(hosts: Cluster) -> None:
    start = time.monotonic()
    # Ignores SIGTERM, as a wedged prterun can: `timeout -k 5` follows with SIGKILL.
    res = hosts.run("algo-2", ["bash", "-c", "trap '' TERM; sleep 60"], timeout=1)
    assert res.returncode in (124, 137, -9) and time.monotonic() - start < 15


def test_up_removes_a_crashed_runs_leftovers_and_down_removes_everything(
        hosts: Cluster) -> None:
    names = [h.name for h in hosts.hosts]
    stale = f"{netns.PREFIX}-stale"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=30)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "300"])
    try:
        for _ in range(100):  # until the sleeper is inside the namespace
            if subprocess.run(["ip", "netns", "pids", stale], capture_output=True, text=True,
                              timeout=30).stdout.strip():
                break
            time.sleep(0.05)
        netns.up(names)  # as the next session would, after a crash left `stale` behind
        assert sleeper.wait(timeout=10) == -9  # killed by PID
        assert sorted(netns.stale_namespaces()) == sorted(
            [f"{netns.PREFIX}-{n}" for n in names] + [f"{netns.PREFIX}-switch"])
        netns.down()
        assert netns.stale_namespaces() == []
        assert not netns.STATE_DIR.exists()
        assert list(Path("/etc/netns").glob(f"{netns.PREFIX}-*")) == []
        assert "tfsmp-multihost" not in Path("/proc/self/mounts").read_text()
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        netns.up(names)  # the session's hosts again, for the tests after this one


def test_the_script_runs_commands_on_the_hosts_the_fixture_brought_up(hosts: Cluster) -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "emulated_hosts.py"
    res = subprocess.run([sys.executable, str(script), "run", "--timeout", "20", "algo-2", "--",
                          "hostname"], capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout) == (0, "algo-2\n"), res.stderr
    res = subprocess.run([sys.executable, str(script), "status"], capture_output=True, text=True,
                         timeout=60)
    assert sorted(res.stdout.split()) == sorted(
        [h.ns for h in hosts.hosts] + [f"{netns.PREFIX}-switch"])

"""Multi-host launches without hosts: `--hosts`/`--hostfile` parsing, the forwarded environment,
the TCP interface, the mpirun line `tfsmp run` builds, and the failing host's name."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tfsmp import failure
from tfsmp.errors import ConfigError
from tfsmp.launch import cli
from tfsmp.launch.hosts import (
    HostSlots,
    check_interface,
    default_interface,
    forwarded_env,
    parse_hostfile,
    parse_hosts,
    total_slots,
)
from tfsmp.launch.mpirun import HUGE_PAGE_TUNABLE, build_mpirun_command
from tfsmp.launch.rankguard import message

# /proc/net/route of a host with a default route on ens5 and 10.77.0.0/24 on eth0.
ROUTES = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
ens5\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t00004D0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
lo\t0000007F\t00000000\t0001\t0\t0\t0\t000000FF\t0\t0\t0
"""
ADDRESSES = {"algo-1": "10.77.0.11", "algo-2": "10.77.0.12", "web": "93.184.216.34",
             "localhost": "127.0.0.1"}


def test_hosts_with_and_without_slots() -> None:
    assert parse_hosts("algo-1:2,algo-2:2") == [HostSlots("algo-1", 2), HostSlots("algo-2", 2)]
    assert parse_hosts("a,10.0.0.2:3") == [HostSlots("a", 1), HostSlots("10.0.0.2", 3)]
    assert parse_hosts(["a:4", "b:4"]) == [HostSlots("a", 4), HostSlots("b", 4)]
    assert total_slots(parse_hosts("a:2,b:3")) == 5
    assert str(HostSlots("a", 2)) == "a:2" and str(HostSlots("a")) == "a"


@pytest.mark.parametrize(("text", "match"), [
    ("a:2:3", r"hosts must be HOST\[:SLOTS\] items separated by commas. Received: item 'a:2:3' "
              r"in hosts='a:2:3'. Fix: e.g. --hosts algo-1:2,algo-2:2"),
    ("a:2,,b:2", r"hosts must be HOST\[:SLOTS\] items.*Received: item ''"),
    ("a:x,b:2", r"the slots of a host must be a positive integer. Received: slots='x' for host "
                r"'a' in hosts='a:x,b:2'. Fix: write a:2"),
    ("a:0", r"slots of a host must be a positive integer. Received: slots='0'"),
    ("a:-1", r"slots of a host must be a positive integer. Received: slots='-1'"),
    ("a b:2", r"a host must be a hostname or IPv4 address.*Received: host='a b'"),
    ("[::1]:2", r"items separated by commas. Received: item '\[::1\]:2'"),  # no IPv6 literals
    ("a:1,b:1,a:2", r"each host must be listed once.*Received: \['a'\] repeated"),
])
def test_bad_hosts_say_what_must_hold_and_what_was_received(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_hosts(text)


def test_hostfile_lines_comments_and_slots(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("# the cluster\nalgo-1 slots=2 max_slots=4\n\nalgo-2 slots=2  # second\nalgo-3\n")
    assert parse_hostfile(f) == [HostSlots("algo-1", 2), HostSlots("algo-2", 2),
                                 HostSlots("algo-3", None)]
    assert total_slots(parse_hostfile(f)) is None


@pytest.mark.parametrize(("text", "match"), [
    ("algo-1 2\n", r"hostfile lines must be `HOST slots=N`. Received: 'algo-1 2' on line 1"),
    ("a slots=two\n", r"slots of a host must be a positive integer. Received: slots='two' for "
                      r"host 'a' in line 1 of hostfile"),
    ("# nothing\n\n", r"the hostfile must list at least one host"),
    ("a slots=1\na slots=2\n", r"each host must be listed once"),
])
def test_bad_hostfiles(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "hosts"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        parse_hostfile(f)


def test_missing_hostfile(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"the hostfile must exist. Received: hostfile='.*nope'"):
        parse_hostfile(tmp_path / "nope")


def test_forwarded_env_names_what_remote_ranks_need() -> None:
    env = {"PATH": "/x", "PYTHONPATH": "/r", "HOME": "/root", "TFSMP_TRACE": "t",
           "SM_HP_MP_PARAMETERS": "{}", "SM_HOSTS": "[]", "TF_NUM_INTRAOP_THREADS": "1",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "LD_LIBRARY_PATH": "/l", "SSH_AUTH_SOCK": "s", "TERM": "xterm", "SMTP": "no"}
    assert forwarded_env(env) == dict.fromkeys(
        ["LD_LIBRARY_PATH", "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "PATH",
         "PYTHONPATH", "SM_HOSTS", "SM_HP_MP_PARAMETERS", "TFSMP_TRACE",
         "TF_NUM_INTRAOP_THREADS"])


def test_default_interface_follows_the_route_to_the_hosts() -> None:
    def resolve(name: str) -> str | None:
        return ADDRESSES.get(name)

    hosts = parse_hosts("algo-1:2,algo-2:2")
    assert default_interface(hosts, routes=ROUTES, resolve=resolve) == "eth0"  # /24 beats default
    assert default_interface(parse_hosts("web"), routes=ROUTES, resolve=resolve) == "ens5"
    # Loopback and unresolvable names are skipped; nothing left: Open MPI chooses.
    assert default_interface(parse_hosts("localhost,nowhere"), routes=ROUTES,
                             resolve=resolve) is None
    assert default_interface(parse_hosts("nowhere,algo-2"), routes=ROUTES,
                             resolve=resolve) == "eth0"


def test_interface_names_are_checked() -> None:
    assert check_interface("eth0") == "eth0"
    assert check_interface("eth0,eth1") == "eth0,eth1"
    assert check_interface("10.0.0.0/8") == "10.0.0.0/8"
    with pytest.raises(ConfigError, match=r"the network interface must be an interface name.*"
                                          r"Received: network_interface='eth0 -x'"):
        check_interface("eth0 -x")


def test_builder_puts_both_tcp_channels_on_the_interface() -> None:
    argv = build_mpirun_command(4, ["t.py"], hosts="a:2,b:2", python="/py", as_root=False,
                                network_interface="eth0", mpirun="mpirun")
    assert argv == [
        "mpirun", "-np", "4", "--bind-to", "none", "--map-by", "slot", "--tag-output",
        "--host", "a:2,b:2", "--mca", "btl_tcp_if_include", "eth0",
        "--mca", "oob_tcp_if_include", "eth0", "/py", "-m", "mpi4py", "t.py"]


def _dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert cli.main(["run", *args, "--dry-run", "train.py", "--epochs", "1"]) == 0
    return shlex.split(capsys.readouterr().out)


def _exported(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]


@pytest.fixture
def launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("SM_", "TFSMP_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", "/repo")
    monkeypatch.setenv("TFSMP_TRACE", "/tmp/trace")
    monkeypatch.setenv("SM_CURRENT_HOST", "algo-1")


def test_tfsmp_run_hosts_sets_np_host_env_and_interface(
        capsys: pytest.CaptureFixture[str], launcher_env: None) -> None:
    argv = _dry_run(capsys, "--hosts", "algo-1:2,algo-2:2", "--config", '{"partitions": 2}',
                    "--network-interface", "eth0")
    assert argv[1:3] == ["-np", "4"]
    assert argv[argv.index("--host") + 1] == "algo-1:2,algo-2:2"
    i = argv.index("btl_tcp_if_include")
    assert argv[i - 1:i + 5] == ["--mca", "btl_tcp_if_include", "eth0",
                                 "--mca", "oob_tcp_if_include", "eth0"]
    exported = _exported(argv)
    for name in ("PATH", "PYTHONPATH", "TFSMP_TRACE", "SM_CURRENT_HOST"):
        assert name in exported, exported
    assert 'SM_HP_MP_PARAMETERS={"partitions": 2}' in exported
    # An absolute interpreter: the remote login PATH need not know this Python.
    assert argv[-6:] == [sys.executable, "-m", "mpi4py", "train.py", "--epochs", "1"]
    assert os.path.isabs(argv[-6])


def test_tfsmp_run_on_one_host_forwards_nothing_extra(
        capsys: pytest.CaptureFixture[str], launcher_env: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    argv = _dry_run(capsys, "-np", "2")
    # only malloc's huge pages ([Note: huge pages] in tfsmp/launch/mpirun.py)
    assert _exported(argv) == [f"GLIBC_TUNABLES={HUGE_PAGE_TUNABLE}"]
    assert "--host" not in argv and "btl_tcp_if_include" not in argv


def test_tfsmp_run_hostfile_takes_np_from_slots_and_sm_interface(
        capsys: pytest.CaptureFixture[str], launcher_env: None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("hostA slots=1\nhostB slots=1\n")
    monkeypatch.setenv("SM_NETWORK_INTERFACE_NAME", "ens5")
    argv = _dry_run(capsys, "--hostfile", str(hostfile))
    assert argv[1:3] == ["-np", "2"]
    assert argv[argv.index("--hostfile") + 1] == str(hostfile)
    assert argv[argv.index("btl_tcp_if_include") + 1] == "ens5"
    assert "SM_NETWORK_INTERFACE_NAME" in _exported(argv)


def test_tfsmp_run_default_interface_is_the_routes(
        capsys: pytest.CaptureFixture[str], launcher_env: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import tfsmp.launch.hosts as hosts

    monkeypatch.setattr(hosts, "_resolve", ADDRESSES.get)
    monkeypatch.setattr(hosts, "_read_routes", lambda: ROUTES)
    argv = _dry_run(capsys, "--hosts", "algo-1:1,algo-2:1")
    assert argv[argv.index("btl_tcp_if_include") + 1] == "eth0"


def test_tfsmp_run_distribution_runs_processes_per_host_on_every_host(
        capsys: pytest.CaptureFixture[str], launcher_env: None) -> None:
    dist = ('{"smdistributed": {"modelparallel": {"enabled": true, "parameters": '
            '{"partitions": 2}}}, "mpi": {"enabled": true, "processes_per_host": 2}}')
    argv = _dry_run(capsys, "--distribution", dist, "--hosts", "algo-1:2,algo-2:2",
                    "--network-interface", "eth0")
    assert argv[1:3] == ["-np", "4"]


@pytest.mark.parametrize(("args", "message"), [
    (["--hosts", "a:2:1"], "tfsmp run: error: hosts must be HOST[:SLOTS] items separated by "
                           "commas. Received: item 'a:2:1'"),
    (["--hosts", "a:two"], "the slots of a host must be a positive integer. Received: "
                           "slots='two' for host 'a'"),
    (["--hosts", "a:1,b:1", "-np", "3"], "-np must not exceed the slots of the hosts. Received: "
                                         "np=3, slots=2 (a:1,b:1). Fix:"),
    (["--hosts", "a:1", "--hostfile", "h"], "--hostfile and --hosts are mutually exclusive"),
    (["--hosts", "a:1,b:1", "--network-interface", "eth0;rm"],
     "the network interface must be an interface name"),
    (["--hosts", "a:1,b:2", "--config", '{"partitions": 2}', "--network-interface", "eth0"],
     "world size must be a multiple of partitions"),
])
def test_tfsmp_run_rejects_bad_host_input_with_exit_2(
        capsys: pytest.CaptureFixture[str], launcher_env: None, args: list[str],
        message: str) -> None:
    assert cli.main(["run", *args, "--dry-run", "t.py"]) == 2
    assert message in capsys.readouterr().err


def test_a_failing_rank_names_its_host_before_the_tagged_traceback(
        capsys: pytest.CaptureFixture[str]) -> None:
    failure.install(lambda: "rank 3 | pp_rank 1")
    try:
        try:
            raise ValueError("bad batch")
        except ValueError as e:
            failure._report(type(e), e, e.__traceback__)  # no MPI job here: nothing to abort
    finally:
        failure.uninstall()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (f"[rank 3 | pp_rank 1] failed on host {socket.gethostname()} "
                        f"(pid {os.getpid()}); aborting the job")
    assert lines[1] == "[rank 3 | pp_rank 1] Traceback (most recent call last):"
    assert lines[-1] == "[rank 3 | pp_rank 1] ValueError: bad batch"


def test_multi_host_ranks_run_under_the_guard_one_host_ranks_do_not(
        capsys: pytest.CaptureFixture[str], launcher_env: None) -> None:
    argv = _dry_run(capsys, "--hosts", "a:1,b:1", "--network-interface", "eth0")
    assert argv[-9:-6] == [sys.executable, "-m", "tfsmp.launch.rankguard"]
    assert "tfsmp.launch.rankguard" not in _dry_run(capsys, "-np", "2")


def _guard(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tfsmp.launch.rankguard", sys.executable, "-c",
                           code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMPI_COMM_WORLD_RANK": "3"})


def test_the_guard_passes_exit_codes_and_names_a_rank_killed_by_a_signal() -> None:
    assert _guard("import sys; sys.exit(7)").returncode == 7
    res = _guard("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert res.returncode == -signal.SIGKILL  # the guard dies the same way: mpirun sees it
    assert re.fullmatch(rf"\[rank 3\] killed by signal 9 \(SIGKILL\) on host "
                        rf"{re.escape(socket.gethostname())} \(pid \d+\); the job ends\n",
                        res.stderr), res.stderr
    assert message("0", 250, "h", 1) == ("[rank 0] killed by signal 250 (unknown signal) on "
                                         "host h (pid 1); the job ends\n")

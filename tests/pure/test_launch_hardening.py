"""Issue 27's launcher-side promises that need no TensorFlow: one-host exposure, early checks,
disk-full wording, private folders, checksum plumbing, the session sweep, and a fresh machine
(the test extra covers the tests' imports; CI runs the README's command in a new environment)."""

from __future__ import annotations

import argparse
import ast
import errno
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tfsmp.launch.mpirun import LOCAL_ONLY_FLAGS, build_mpirun_command

REPO = Path(__file__).resolve().parents[2]


# -- one-host exposure ([Note: one-host exposure] in tfsmp/launch/mpirun.py) ----------------------

def _has_flags(argv: list[str], flags: tuple[str, ...]) -> bool:
    return any(tuple(argv[i:i + len(flags)]) == flags for i in range(len(argv)))


def test_a_one_host_job_keeps_mpi_in_shared_memory() -> None:
    argv = build_mpirun_command(2, ["t.py"], local_only=True, as_root=False, cores=2)
    assert _has_flags(argv, LOCAL_ONLY_FLAGS), argv
    assert LOCAL_ONLY_FLAGS == ("--mca", "btl", "self,sm")


def test_multi_host_jobs_and_the_users_own_btl_are_left_alone() -> None:
    hosts = build_mpirun_command(4, ["t.py"], hosts="a:2,b:2", local_only=True,
                                 network_interface="eth0", as_root=False)
    assert not _has_flags(hosts, LOCAL_ONLY_FLAGS) and "eth0" in hosts, hosts
    own = build_mpirun_command(2, ["t.py"], local_only=True, as_root=False,
                               extra_mpi_args=["--mca", "btl", "self,tcp"])
    assert not _has_flags(own, LOCAL_ONLY_FLAGS), own


def test_tfsmp_run_dry_run_shows_the_one_host_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from tfsmp.launch.cli import main

    assert main(["run", "-np", "2", "--dry-run", "train.py"]) == 0
    assert "--mca btl self,sm" in capsys.readouterr().out
    assert main(["run", "--hosts", "a:1,b:1", "--network-interface", "lo", "--dry-run",
                 "train.py"]) == 0
    assert "btl self,sm" not in capsys.readouterr().out


def test_after_a_stop_mpiruns_box_per_stopped_rank_is_dropped() -> None:
    from tfsmp.launch.output import OutputFilter

    box = ["-" * 74 + "\n",
           "prterun noticed that process rank 1 with PID 12744 on node vm exited on\n",
           "signal 10 (User defined signal 1).\n", "-" * 74 + "\n", "after\n"]

    def shown(keep: OutputFilter) -> list[str]:
        out = [line for raw in box for line in keep.feed(raw)]
        return out + keep.close()

    assert shown(OutputFilter()) == box  # a rank killed unasked: its box is news
    stopping = OutputFilter()
    stopping.stopping = True
    assert shown(stopping) == ["after\n"]


# -- checks before work ---------------------------------------------------------------------------

def test_tfsmp_run_checks_the_script_exists(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from tfsmp.launch.cli import main

    assert main(["run", "-np", "2", str(tmp_path / "nope.py")]) == 2
    err = capsys.readouterr().err
    assert "the script to run must be a file" in err and "nope.py" in err, err
    assert main(["run", "-np", "2", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_a_bad_stop_grace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tfsmp.launch.cli import main

    script = tmp_path / "t.py"
    script.write_text("pass\n")
    assert main(["run", "-np", "1", "--stop-grace", "-1", str(script)]) == 2
    assert "stop grace period must be a number of seconds >= 0" in capsys.readouterr().err


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec -> None: "not installed"


def test_drawing_without_matplotlib_names_the_viz_extra(
        no_matplotlib: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tfsmp.launch import cmd_plan, cmd_schedule, cmd_timeline

    assert cmd_plan.run(argparse.Namespace(out=["plan.svg"], model="nowhere:nothing")) == 2
    assert "pip install 'tfsmp[viz]'" in capsys.readouterr().err
    args = argparse.Namespace(directory=str(tmp_path), out="t.png", steps=1, skip=1)
    assert cmd_timeline.run(args) == 2
    assert "pip install 'tfsmp[viz]'" in capsys.readouterr().err
    assert cmd_schedule.run(argparse.Namespace(out="s.png")) == 2
    assert "pip install 'tfsmp[viz]'" in capsys.readouterr().err


def test_json_out_needs_no_matplotlib(no_matplotlib: None) -> None:
    from tfsmp.launch.viz import viz_missing

    assert viz_missing("tfsmp plan", ["plan.json", None]) is None


# -- disk full --------------------------------------------------------------------------------------

def test_disk_full_says_so_and_where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tfsmp.checkpoint import format as fmt

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np.lib.format, "write_array", full)
    with pytest.raises(OSError) as excinfo:
        fmt.write_array(str(tmp_path), "model/w.npy", np.zeros(3))
    assert excinfo.value.filename == str(tmp_path / "model" / "w.npy")
    text = fmt.describe_os_error(excinfo.value, str(tmp_path))
    assert "no space left on device" in text and "model/w.npy" in text, text
    assert "permission" not in text.lower(), text
    denied = fmt.describe_os_error(PermissionError(errno.EACCES, "Permission denied", "/x"), "/")
    assert "permissions" in denied and "space" not in denied


# -- private folders ([Note: private temp folders] in tfsmp/tempdirs.py) ------------------------------

def test_private_dir_is_0700_and_tightens_ours(tmp_path: Path) -> None:
    from tfsmp.tempdirs import private_dir

    new = tmp_path / "a" / "jobs"
    private_dir(str(new))
    assert stat.S_IMODE(new.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    private_dir(str(loose))
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_private_dir_refuses_a_symlink_and_another_users_folder(tmp_path: Path) -> None:
    from tfsmp.errors import ConfigError
    from tfsmp.tempdirs import private_dir

    (tmp_path / "theirs").mkdir()
    os.symlink(tmp_path / "theirs", tmp_path / "link")
    with pytest.raises(ConfigError, match="is a symlink"):
        private_dir(str(tmp_path / "link"))
    if os.geteuid() != 0:
        pytest.skip("only root can give a folder to another user")
    os.chown(tmp_path / "theirs", 4242, 4242)
    with pytest.raises(ConfigError, match="owned by user id 4242"):
        private_dir(str(tmp_path / "theirs"))


def test_the_estimators_default_folder_is_private(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from tfsmp.estimator.arguments import output_root

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = Path(output_root(None))
    assert root == tmp_path / "tfsmp-jobs"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


# -- checksums and unusable backups -----------------------------------------------------------------

class _Dataset:
    def __init__(self) -> None:
        self.attrs: dict[str, object] = {}
        self.name = "/layers/dense/vars/0"


def test_a_changed_array_fails_its_digest_with_an_oserror() -> None:
    from tfsmp.checkpoint import checksum
    from tfsmp.errors import CheckpointError

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    ds = _Dataset()
    checksum.stamp(ds, a)
    checksum.verify(ds, a.copy(), "f.weights.h5")  # unchanged: fine
    b = a.copy()
    b[1, 2] += 1
    with pytest.raises(OSError) as excinfo:
        checksum.verify(ds, b, "f.weights.h5")
    assert isinstance(excinfo.value, CheckpointError)
    assert "f.weights.h5" in str(excinfo.value) and "skip_mismatch" not in str(excinfo.value)
    checksum.verify(_Dataset(), b, "keras.weights.h5")  # a file Keras wrote: nothing to check
    assert checksum.dataset_options(a) == {"fletcher32": True}
    assert checksum.dataset_options(np.float32(1)) == {}


def test_a_corrupt_file_is_raised_alike_on_every_rank() -> None:
    from tfsmp.checkpoint import checksum

    gathered = ["other", checksum.gatherable(checksum.corrupt("f", "dataset 'x'", "broke"))]
    with pytest.raises(checksum.CorruptFileError, match="dataset 'x' broke"):
        checksum.raise_gathered(gathered)
    checksum.raise_gathered(["a shape mismatch"])  # not a corrupt file: nothing raised


def _checkpoint(root: Path, name: str, manifest: bool = True) -> None:
    from tfsmp.checkpoint import format as fmt

    (root / name).mkdir(parents=True)
    if manifest:
        fmt.write_manifest(str(root / name), {"variables": {}})


def test_the_newest_backup_without_its_manifest_is_reported(tmp_path: Path) -> None:
    from tfsmp.checkpoint import format as fmt

    _checkpoint(tmp_path, "backup-1")
    _checkpoint(tmp_path, "backup-2", manifest=False)
    with pytest.raises(OSError, match=r"'.*backup-2' has none.*restore the previous one by name "
                                      r"\('backup-1'\)"):
        fmt.read_latest(str(tmp_path), "backup")
    fmt.write_latest(str(tmp_path), "backup-2")
    with pytest.raises(OSError, match="backup-2' has none"):
        fmt.read_latest(str(tmp_path), "backup")


def test_an_older_damaged_folder_does_not_hide_the_latest(tmp_path: Path) -> None:
    from tfsmp.checkpoint import format as fmt

    _checkpoint(tmp_path, "backup-1", manifest=False)  # e.g. pruning killed part-way
    _checkpoint(tmp_path, "backup-2")
    _checkpoint(tmp_path, "backup-3.tmp", manifest=False)  # a save in progress: not a backup
    assert fmt.read_latest(str(tmp_path), "backup") == str(tmp_path / "backup-2")
    assert fmt.read_latest(str(tmp_path / "none"), "backup") is None


# -- the session sweep ([Note: the launcher owns its job] in tfsmp/launch/ownjob.py) -------------------

def test_sweep_ends_a_session_and_what_it_left_behind() -> None:
    from tfsmp.launch import ownjob

    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], **ownjob.popen_kwargs(
        die_with_parent=False))
    try:
        deadline = time.monotonic() + 20
        while len(ownjob.session_processes(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ownjob.session_processes(proc.pid)) == 2
        left = ownjob.sweep(proc.pid, kill_after=2.0)
        proc.wait(5)
        assert len(left) == 2 and not ownjob.session_processes(proc.pid)
    finally:
        ownjob.kill_session(proc.pid, signal.SIGKILL)


def test_grace_seconds() -> None:
    from tfsmp.launch.ownjob import DEFAULT_GRACE, GRACE_ENV, grace_seconds

    assert grace_seconds(None, {}) == DEFAULT_GRACE
    assert grace_seconds(None, {GRACE_ENV: "2.5"}) == 2.5
    assert grace_seconds(0, {GRACE_ENV: "9"}) == 0
    for bad in ("x", "-1", "nan"):
        with pytest.raises(ValueError, match="grace period"):
            grace_seconds(None, {GRACE_ENV: bad})


# -- a fresh machine -----------------------------------------------------------------------------------

# Modules the tests import that no pip extra provides, and why.
NOT_FROM_THE_EXTRAS = {
    "horovod": "built by `tfsmp install-horovod` (scripts/setup.sh --test)",
    "keras_hub": "installed --no-deps by scripts/setup.sh --test",
    "sagemaker_training": "tests/multihost/ompi4.py's own environment",
    "sklearn": "stubbed by tests/mpi/kerasio/kerasio_run.py",
    "torch": "the bench-torch extra: benchmarks/bench_torch.py skips without it",
}
# Import name -> the requirement (main or extra) that provides it, directly or as its dependency.
PROVIDED_BY = {
    "numpy": "numpy", "tensorflow": "tensorflow-cpu", "keras": "keras", "mpi4py": "mpi4py",
    "pymetis": "pymetis", "h5py": "keras", "ml_dtypes": "keras", "pytest": "pytest",
    "hypothesis": "hypothesis", "matplotlib": "matplotlib", "botocore": "boto3",
    "boto3": "boto3",
}


def _third_party_imports() -> set[str]:
    files = [p for d in ("tests", "benchmarks", "examples") for p in (REPO / d).rglob("*.py")]
    local = {p.stem for p in files} | {d.name for p in files for d in p.parents}
    found: set[str] = set()
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found - local - set(sys.stdlib_module_names) if m != "tfsmp"}


def _requirements() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["test"],
            *project["optional-dependencies"]["viz"]]
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}


def test_the_test_extra_installs_what_the_tests_import() -> None:
    requirements = _requirements()
    unknown = sorted(m for m in _third_party_imports()
                     if m not in NOT_FROM_THE_EXTRAS and m not in PROVIDED_BY)
    assert not unknown, (f"tests import {unknown}: add each to the `test` extra of "
                         f"pyproject.toml and to PROVIDED_BY here")
    missing = sorted({PROVIDED_BY[m] for m in _third_party_imports() if m in PROVIDED_BY}
                     - requirements)
    assert not missing, f"pyproject.toml's dependencies and test/viz extras lack {missing}"


def _readme_test_command() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text[text.index("# Tests:"):]
    block = block[:block.index("```")]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readmes_test_command_in_a_new_environment() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    commands = _readme_test_command()
    assert commands and commands[-1] == "bash scripts/setup.sh --test && python -m pytest -q"
    assert any("-m venv" in c for c in commands), commands  # the README makes one too
    for command in commands:
        assert command in ci, f".ci/run must run the README's `{command}`"
    assert ci.index("-m venv") < ci.index("bash scripts/setup.sh --test"), \
        "the environment must be new before setup runs in it"


# -- the Horovod wheel cache ([Note: Horovod wheel cache] in tfsmp/launch/cmd_horovod.py) ----------

def _fake_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    from tfsmp.launch import cmd_horovod

    calls: list[list[str]] = []

    def run(argv: list[str], log: object, env: object = None) -> int:
        calls.append(argv[3:])
        if argv[3] == "wheel":  # the build leaves its wheel in -w DIR
            out = Path(argv[argv.index("-w") + 1])
            (out / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl").write_text("")
        return 0

    monkeypatch.setattr(cmd_horovod, "_run_logged", run)
    monkeypatch.setattr(cmd_horovod, "_unpack_sdist", lambda d, v: tmp_path)
    monkeypatch.setattr(cmd_horovod, "patch_xla_sources", lambda d: "line")
    return calls


def test_a_horovod_build_is_kept_and_installed_from_the_cache_next_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tfsmp.launch.cmd_horovod import install_horovod, wheel_dir

    cache = wheel_dir("0.28.1", {"TFSMP_HOROVOD_WHEELS": str(tmp_path / "wheels")})
    assert cache.parent == tmp_path / "wheels" and "-tf" in cache.name and "openmpi" in cache.name
    calls = _fake_pip(monkeypatch, tmp_path)
    assert install_horovod(log_path=tmp_path / "log", workdir=tmp_path, cache=cache) is False
    assert [c[0] for c in calls] == ["install", "download", "wheel", "install"], calls
    assert len(list(cache.glob("horovod-*.whl"))) == 1
    calls.clear()
    assert install_horovod(log_path=tmp_path / "log", workdir=tmp_path, cache=cache) is True
    assert [c[0] for c in calls] == ["install", "install"], calls  # no download, no build
    assert calls[1][-1].endswith(".whl")

"""Checkpoints across jobs and partitionings, a save killed part-way, export to plain Keras.

Launches (files shared through one temporary directory):
  phase A, 4 ranks: 6 steps straight and 3 steps + checkpoint under p=2, d=2 (both pipelines);
      a 4-stage model saved as .keras / .weights.h5 / SavedModel / checkpoint.
  kill job, 2 ranks (p=2): ckpt-1, then a slowed-down ckpt-2 that the test SIGKILLs part-way.
  phase B, 4 ranks, a new job: restore under p=4, d=1 and train 3 more steps; restore the killed
      job's checkpoint under p=2, d=2; pretrained plain-Keras weights into frozen stages; bad
      files; fit interrupted and resumed by BackupAndRestore; ModelCheckpoint during fit.
  one plain-Keras process (no tfsmp): the exported files predict what the 4-stage model did;
      `tfsmp export` turns the checkpoint into a .keras file first.
  examples/finetune.py, 2 ranks, one epoch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.mpihelp import REPO_ROOT, SCRIPTS, base_env, run_cases, run_mpi
from tfsmp.launch.mpirun import build_mpirun_command, find_mpirun, fresh_session

pytestmark = pytest.mark.mpi
CASES = SCRIPTS / "checkpoint_cases.py"
PHASE_A = ["case_straight_interleaved", "case_straight_simple", "case_first_half_interleaved",
           "case_first_half_simple", "case_export_four_stages"]
PHASE_B = ["case_resume_interleaved", "case_resume_simple", "case_restore_after_kill",
           "case_load_pretrained_frozen", "case_load_mismatch_fails_everywhere",
           "case_bad_checkpoint_changes_nothing", "case_fit_backup_and_restore",
           "case_model_checkpoint_callback"]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def _env(directory: Path) -> dict[str, str]:
    return {"TFSMP_CKPT_DIR": str(directory)}


@pytest.fixture(scope="module")
def phase_a(ckpt_dir: Path) -> dict[str, dict[int, dict[str, Any]]]:
    return run_cases(4, CASES, PHASE_A, env=_env(ckpt_dir), timeout=300)


def _written(path: Path) -> int:
    return len(list(path.rglob("*.npy"))) if path.is_dir() else 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture(scope="module")
def killed(ckpt_dir: Path) -> dict[str, Any]:
    """Runs the kill job and SIGKILLs its rank processes (by PID) once ckpt-2 is part-written.

    mpirun (prterun) puts each rank in its own process group, so the ranks are killed one by
    one, then the launcher's group."""
    script = SCRIPTS / "checkpoint_kill_job.py"
    cmd = build_mpirun_command(2, [str(script), str(ckpt_dir)], config_json=None,
                               use_mpi4py_module=True, mpirun=find_mpirun())
    tmp = ckpt_dir / "kill" / "ckpt-2.tmp"
    pid_files = [ckpt_dir / "kill_pids" / f"rank{r}" for r in (0, 1)]
    job_tmp = ckpt_dir / "kill_tmp"  # what the killed ranks leave (autograph's sources) goes here
    job_tmp.mkdir(exist_ok=True)
    with open(ckpt_dir / "kill_job.log", "w") as log:
        proc = subprocess.Popen(fresh_session(cmd), stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env=base_env({"TFSMP_TEST_SLOW_SAVE": "2",
                                              "TMPDIR": str(job_tmp)}),
                                start_new_session=True)
        deadline = time.monotonic() + 150
        while _written(tmp) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        files_at_kill = _written(tmp)
        pids = [int(p.read_text()) for p in pid_files if p.is_file()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    end = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.1)
    kill_dir = ckpt_dir / "kill"
    return {"files_at_kill": files_at_kill, "pids": pids,
            "survivors": [pid for pid in pids if _alive(pid)],
            "log": (ckpt_dir / "kill_job.log").read_text(),
            "listing": sorted(os.listdir(kill_dir)) if kill_dir.is_dir() else [],
            "latest": (kill_dir / "latest").read_text().strip()
            if (kill_dir / "latest").is_file() else None}


@pytest.fixture(scope="module")
def phase_b(ckpt_dir: Path, phase_a: dict[str, Any], killed: dict[str, Any]
            ) -> dict[str, dict[int, dict[str, Any]]]:
    return run_cases(4, CASES, PHASE_B, env=_env(ckpt_dir), timeout=420)


@pytest.fixture(scope="module")
def verified(ckpt_dir: Path, phase_a: dict[str, Any]) -> dict[str, Any]:
    env = base_env()
    cli = subprocess.run(
        [sys.executable, "-m", "tfsmp", "export", str(ckpt_dir / "export_ckpt"),
         str(ckpt_dir / "cli_export.keras")],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    check = subprocess.run(
        [sys.executable, str(SCRIPTS / "checkpoint_verify.py"), str(ckpt_dir)],
        capture_output=True, text=True, env=env, cwd=SCRIPTS, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    result: dict[str, Any] = json.loads(check.stdout.strip().splitlines()[-1])
    result["cli_stdout"] = cli.stdout
    return result


def _per_rank(results: dict[str, dict[int, dict[str, Any]]], case: str) -> list[dict[str, Any]]:
    out = []
    for rank in sorted(results[case]):
        rec = results[case][rank]
        assert rec["ok"], f"{case} on rank {rank}:\n{rec['error']}"
        out.append(rec["result"])
    return out


def _strip(message: str | None) -> str:
    return (message or "").split("] ", 1)[-1]


# -- resume under another partitioning -----------------------------------------------------------

@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
def test_checkpoint_is_written_once_per_variable_under_p2_d2(
        phase_a: dict[str, Any], pipeline: str) -> None:
    for r in _per_rank(phase_a, f"case_straight_{pipeline}"):
        assert r["ref_err"] <= 1.0  # the straight run itself equals plain Keras (rtol 1e-5)
    first = _per_rank(phase_a, f"case_first_half_{pipeline}")
    assert all(r == first[0] for r in first)  # every rank returns the same path and manifest
    r = first[0]
    assert r["path"].endswith("resume_" + pipeline + "/ckpt-1") and r["step"] == 3
    assert r["topology"]["partitions"] == 2 and r["topology"]["dp_size"] == 2
    # one writer per variable: data-parallel rank 0 of each stage (world ranks 0 and 1)
    assert r["writers"] == [0, 1] and r["slot_writers"] == [0, 1]
    assert r["num_slots"] == 2 * r["num_variables"]  # Adam: momentum and velocity


@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
def test_resume_with_other_partitions_and_replicas_equals_straight_run(
        phase_b: dict[str, Any], pipeline: str) -> None:
    """p=2, d=2 for 3 steps, checkpoint; new job p=4, d=1 restores, 3 steps == 6 straight."""
    ranks = _per_rank(phase_b, f"case_resume_{pipeline}")
    held: set[str] = set()
    for r in ranks:
        assert r["restored"].endswith("ckpt-1")
        assert r["err"] <= 1.0, r["err"]      # all weights equal at rtol 1e-6
        assert r["iterations"] == 6           # optimizer iterations restored (3) + 3
        assert r["read_model"] == r["held"]   # each rank read exactly its own variables
        assert len(r["held"]) < len(r["all"])
        held |= set(r["held"])
    assert held == set(ranks[0]["all"])


# -- a save killed part-way ------------------------------------------------------------------------

def test_sigkill_during_save_leaves_previous_checkpoint(killed: dict[str, Any]) -> None:
    assert "SAVING 2" in killed["log"] and "SAVED 2" not in killed["log"], killed["log"]
    assert killed["files_at_kill"] >= 2
    assert len(killed["pids"]) == 2 and killed["survivors"] == []  # both writers really died
    assert "ckpt-1" in killed["listing"] and "ckpt-2" not in killed["listing"]
    assert "ckpt-2.tmp" in killed["listing"]  # the half-written one, never renamed
    assert killed["latest"] == "ckpt-1"


def test_new_job_restores_the_checkpoint_before_the_killed_save(phase_b: dict[str, Any]) -> None:
    for r in _per_rank(phase_b, "case_restore_after_kill"):
        assert r["before"]["latest"].endswith("kill/ckpt-1")
        assert r["restored"].endswith("kill/ckpt-1")
        assert r["exact"]  # bit-identical weights, now under p=2, d=2
        assert r["again"].endswith("kill/ckpt-2")
        # the stale .tmp is gone (mp_rank_<i>: [Note: SMP layout markers] in checkpoint/format.py)
        assert r["after"] == ["ckpt-1", "ckpt-2", "latest", "mp_rank_0", "mp_rank_1"]


# -- export ------------------------------------------------------------------------------------------

def test_exported_files_predict_like_the_four_stage_model(
        phase_a: dict[str, Any], verified: dict[str, Any]) -> None:
    ranks = _per_rank(phase_a, "case_export_four_stages")
    assert sorted(s for r in ranks for s in r["stages"]) == [0, 1, 2, 3]
    assert not verified["tfsmp_imported"]
    for what in ("keras_file", "cli_export", "weights_file", "savedmodel"):
        assert verified[what] <= 1.0, (what, verified)  # rtol 1e-6
    assert "exported" in verified["cli_stdout"]


# -- pretrained weights, frozen layers, mismatches ---------------------------------------------------

def test_pretrained_keras_weights_load_per_rank_and_frozen_layers_stay(
        phase_b: dict[str, Any]) -> None:
    ranks = _per_rank(phase_b, "case_load_pretrained_frozen")
    for r in ranks:
        assert r["frozen_same"] and r["head_changed"] and r["h5_same"]
        assert len(r["read"]) == r["held"] < r["total"]  # only this rank's datasets were read
    assert sum(len(r["read"]) for r in ranks) == 2 * ranks[0]["total"]  # 2 replicas


def test_legacy_h5_weights_load_into_a_distributed_model(phase_b: dict[str, Any]) -> None:
    # tf.keras's `.h5` through Keras's own load_weights: in order after partitioning, by layer
    # name into a deferred model before it; Keras's own check refuses by_name for `.keras`
    for r in _per_rank(phase_b, "case_load_pretrained_frozen"):
        assert r["legacy_same"] and r["by_name_same"]
        assert "`by_name` only supports loading legacy '.h5'" in r["by_name_keras"]


def test_mismatched_weights_file_fails_on_every_rank_before_any_change(
        phase_b: dict[str, Any]) -> None:
    ranks = _per_rank(phase_b, "case_load_mismatch_fails_everywhere")
    for r in ranks:
        assert r["unchanged"]
        assert "Weight shapes must match" in r["message"]
        assert "other_head.weights.h5" in r["message"] and "head/" in r["message"]
        assert "skip_mismatch=True" in r["message"]
    assert len({_strip(r["message"]) for r in ranks}) == 1


def test_corrupt_array_fails_on_every_rank_naming_file_and_variable(
        phase_b: dict[str, Any]) -> None:
    ranks = _per_rank(phase_b, "case_bad_checkpoint_changes_nothing")
    assert {r["holds_key"] for r in ranks} == {True, False}  # some ranks never read that file
    for r in ranks:
        assert r["unchanged"]
        assert "does not match its checksum" in r["message"]
        assert r["file"] in r["message"] and f"'{r['key']}'" in r["message"]
    assert len({r["message"] for r in ranks}) == 1


# -- fit -----------------------------------------------------------------------------------------------

def test_fit_resumes_exactly_with_backup_and_restore(phase_b: dict[str, Any]) -> None:
    for r in _per_rank(phase_b, "case_fit_backup_and_restore"):
        assert r["interrupted"]
        assert "backup-2" in r["saved"]  # after epochs 1 and 2; max_to_keep=1
        assert r["position"] == {"epoch": 2, "step": 0}
        assert r["epochs_run"] == [2], (
            "DistributedModel.fit must start at model._initial_epoch, which BackupAndRestore "
            "sets in on_train_begin (as keras.Model.fit does)")
        assert r["err"] <= 1.0, r["err"]  # weights, BN statistics, dropout masks: all equal
        assert r["deleted"]


def test_model_checkpoint_callback_writes_plain_keras_files(phase_b: dict[str, Any]) -> None:
    ranks = _per_rank(phase_b, "case_model_checkpoint_callback")
    assert ranks[0]["files"] == ["epoch1.keras", "epoch2.keras", "last.weights.h5"]
    assert ranks[0]["err"] is not None and ranks[0]["err"] <= 1e-6


# -- the fine-tuning example -------------------------------------------------------------------------

def test_finetune_example_runs(tmp_path: Path) -> None:
    result = run_mpi(2, [REPO_ROOT / "examples" / "finetune.py", "--out", str(tmp_path),
                         "--epochs", "1"], timeout=240)
    assert result.returncode == 0, result.describe()
    line = next(x for x in result.ranks[0].splitlines() if x.startswith("RESULT "))
    report = json.loads(line[len("RESULT "):])
    assert report["frozen_layers_unchanged"] and report["exported_predicts_the_same"]
    assert "logits/kernel" in result.stderr  # the new head was skipped, with a warning

"""Never lose work: a job that loses a rank, or is preempted, is relaunched and ends exactly where an
uninterrupted job ends (issue 21).

Every job is `tfsmp run` of tests/mpi/scripts/resume_train.py: 2 ranks (p=2, m=2), a tiny
MLP with Adam, 16 steps over 2 epochs, shuffled with a seeded order, and Keras's own
``keras.callbacks.BackupAndRestore(save_freq=3)``. The reference runs once without faults; every
other job must end with the reference's weights and optimizer state, bit for bit (the data order
is deterministic). Each trial records its seed, the killed rank, the step and where in the step
(printed: run pytest with -s, or read the assertion message).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.mpi.conftest import RESUME_CONFIG, RESUME_EPOCHS
from tests.mpihelp import REPO_ROOT, SCRIPTS, Result, base_env, run_mpi

pytestmark = pytest.mark.mpi

SCRIPT = SCRIPTS / "resume_train.py"
CONFIG = RESUME_CONFIG
EPOCHS, PER_EPOCH = RESUME_EPOCHS, 8
STEPS = EPOCHS * PER_EPOCH
BACKUPS = [2, 5, 8, 11, 14]  # global steps after which save_freq=3 backs up (Keras counts on)
POINTS = ["begin", "mid", "save", "meta"]  # where in the step the rank dies (resume_train.py)
RESTART = ["--max-restarts", "1", "--restart-backoff", "0.2"]
LAUNCH_BOUND = 400.0


def _job(out: Path, *args: str, restart: bool = True) -> Result:
    argv = [*(RESTART if restart else []), SCRIPT, out, "--epochs", str(EPOCHS), *args]
    return run_mpi(2, argv, config=CONFIG, launcher="tfsmp", timeout=LAUNCH_BOUND)


def _final(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "final.npz") as f:
        return {k: f[k] for k in f.files}


def _firsts(res: Result) -> list[dict[str, int]]:
    """Where each attempt started (rank 0's FIRST lines, in order)."""
    return [json.loads(line[6:]) for line in res.ranks.get(0, "").splitlines()
            if line.startswith("FIRST ")]


def _differences(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> list[str]:
    if sorted(got) != sorted(want):
        return [f"arrays {sorted(got)} vs {sorted(want)}"]
    return [k for k in sorted(want) if not np.array_equal(got[k], want[k])]


@pytest.fixture
def reference(resume_reference: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return resume_reference  # tests/mpi/conftest.py: one uninterrupted run per session


@dataclass(frozen=True)
class Trial:
    seed: int
    rank: int
    step: int
    point: str

    @classmethod
    def of(cls, seed: int) -> Trial:
        rng = random.Random(seed)
        point = rng.choice(POINTS)
        last = BACKUPS[-1] if point in ("save", "meta") else STEPS - 1  # a backup must follow
        return cls(seed, rng.randrange(2), rng.randrange(last + 1), point)

    def resumes_at(self) -> dict[str, int]:
        """Where the relaunch must start: after the last backup that was complete."""
        if self.point in ("save", "meta"):
            cut = min(s for s in BACKUPS if s >= self.step)  # the backup being written
            done = [s for s in BACKUPS if s < cut] + ([cut] if self.point == "meta" else [])
        else:
            done = [s for s in BACKUPS if s < self.step]
        start = max(done) + 1 if done else 0
        return {"epoch": start // PER_EPOCH, "step": start % PER_EPOCH}


def _run_trial(trial: Trial, out: Path, reference: dict[str, np.ndarray]) -> str:
    res = _job(out, "--kill", f"{trial.rank}:{trial.step}:{trial.point}")
    record = (f"trial seed={trial.seed} killed rank={trial.rank} step={trial.step} "
              f"point={trial.point}")
    assert res.returncode == 0, f"{record}\n{res.describe()}"
    assert re.search(rf"KILL rank {trial.rank} at step \d+", res.stdout), res.describe()
    stderr = " ".join(res.stderr.split())
    said = re.findall(r"tfsmp run: restart 1 of 1 in 0\.2 s: rank (\d) on host \S+ failed "
                      r"(?:after \d+ steps? of epoch \d|before its first step): killed by signal 9 "
                      r"\(SIGKILL\)", stderr)
    assert said == [str(trial.rank)], f"{record}\n{res.describe()}"
    firsts = _firsts(res)
    assert firsts == [{"epoch": 0, "step": 0}, trial.resumes_at()], f"{record}\n{res.describe()}"
    assert not _differences(_final(out), reference), f"{record}: {_differences(_final(out), reference)}"
    line = f"{record} resumed at {firsts[1]} in {res.elapsed:.1f} s: equal"
    print(line)
    return line


def _trials(seeds: list[int], tmp_path: Path, reference: dict[str, np.ndarray]) -> None:
    lines = [_run_trial(Trial.of(seed), tmp_path / f"seed{seed}", reference) for seed in seeds]
    print("\n".join(["fault trials:", *lines]))


@pytest.mark.timeout(2 * LAUNCH_BOUND + 60)
def test_a_seeded_random_kill_resumes_to_the_uninterrupted_weights(
        tmp_path: Path, reference: dict[str, np.ndarray]) -> None:
    _trials([0], tmp_path, reference)


@pytest.mark.fault_trials
@pytest.mark.timeout(10 * LAUNCH_BOUND + 60)
def test_ten_seeded_random_kills_resume_to_the_uninterrupted_weights(
        tmp_path: Path, reference: dict[str, np.ndarray]) -> None:
    _trials(list(range(10)), tmp_path, reference)


def test_the_trials_cover_every_point_of_a_step() -> None:
    trials = [Trial.of(seed) for seed in range(10)]
    assert {t.point for t in trials} == set(POINTS), trials
    assert {t.rank for t in trials} == {0, 1}, trials
    assert {t.point for t in (Trial.of(0), Trial.of(1))} <= set(POINTS)


@pytest.mark.timeout(LAUNCH_BOUND + 60)
def test_sigterm_mid_epoch_checkpoints_after_that_step_and_the_relaunch_resumes(
        tmp_path: Path, reference: dict[str, np.ndarray]) -> None:
    # Rank 1 alone gets SIGTERM before step 10 (epoch 1, batch 2); both ranks finish that step,
    # back up, exit 75; the launcher relaunches; the relaunch starts at batch 3 of epoch 1.
    res = _job(tmp_path, "--term", "1:10")
    assert res.returncode == 0, res.describe()
    text = " ".join(res.stderr.split())
    assert "[tfsmp] preempted by rank 1 (SIGTERM) after 3 steps of epoch 1: wrote " in text, \
        res.describe()
    assert re.search(r"tfsmp run: restart 1 of 1 in 0\.2 s: rank 1 on host \S+ stopped after 3 "
                     r"steps of epoch 1: preempted \(SIGTERM\); backup written", text), \
        res.describe()
    assert _firsts(res) == [{"epoch": 0, "step": 0}, {"epoch": 1, "step": 3}], res.describe()
    assert not _differences(_final(tmp_path), reference)


@pytest.mark.fault_trials  # a longer scenario: CI runs it (TFSMP_FAULT_TRIALS=1)
@pytest.mark.timeout(2 * LAUNCH_BOUND + 60)
def test_sigterm_to_the_launcher_checkpoints_and_a_new_launch_resumes(
        tmp_path: Path, reference: dict[str, np.ndarray]) -> None:
    # As SageMaker stops a spot job: SIGTERM to `tfsmp run`, which relays it to the ranks. They
    # back up after their current step and exit 75; the launcher does not relaunch (it is the
    # one being stopped). A new launch (the next attempt) resumes from that backup.
    ready = tmp_path / "ready"
    cmd = [sys.executable, "-m", "tfsmp", "run", "-np", "2", "--config", json.dumps(CONFIG), *RESTART,
           str(SCRIPT), str(tmp_path), "--epochs", str(EPOCHS), "--ready-file", f"{ready}:4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=base_env(), cwd=REPO_ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + LAUNCH_BOUND
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=LAUNCH_BOUND)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = " ".join(err.split())
    assert proc.returncode == 75, out + err
    assert re.search(r"\[tfsmp\] preempted by rank 0 \(SIGUSR1\), rank 1 \(SIGUSR1\) after \d "
                     r"steps of epoch 0", text), out + err
    assert "tfsmp run: restart" not in text
    stopped = int(re.search(r"after (\d) steps of epoch 0", text).group(1))  # type: ignore[union-attr]
    res = _job(tmp_path)
    assert res.returncode == 0, res.describe()
    assert _firsts(res) == [{"epoch": 0, "step": stopped}], res.describe()
    assert not _differences(_final(tmp_path), reference)


@pytest.mark.full  # the estimator's retry path; the default run resumes killed ranks under tfsmp run
@pytest.mark.timeout(2 * LAUNCH_BOUND + 60)
def test_the_estimator_retries_a_killed_rank_and_resumes_from_the_checkpoint_folder(
        tmp_path: Path, reference: dict[str, np.ndarray]) -> None:
    # max_retry_attempts=1: rank 1 is SIGKILLed mid-step in the first attempt; the second
    # attempt resumes from the backup Keras's BackupAndRestore wrote under /opt/ml/checkpoints,
    # which is the job's checkpoint folder (checkpoint_s3_uri here), kept across attempts.
    import warnings

    from tfsmp.estimator import LOCAL_ROLE, TensorFlow

    job_env = {k: v for k, v in base_env().items() if k.startswith(("TF_", "OMP", "OMPI_MCA"))}
    s3 = tmp_path / "s3-checkpoints"
    dist = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": CONFIG}},
            "mpi": {"enabled": True, "processes_per_host": 2}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = TensorFlow(
            entry_point="resume_train.py", source_dir=str(SCRIPTS), role=LOCAL_ROLE,
            instance_count=1, instance_type="local", framework_version="2.21",
            py_version="py311", distribution=dist, output_path=str(tmp_path / "jobs"),
            hyperparameters={"out": str(tmp_path), "epochs": EPOCHS, "kill": "1:9:mid",
                             "backup-dir": "/opt/ml/checkpoints/backup"},
            environment=job_env, max_retry_attempts=1, checkpoint_s3_uri=f"file://{s3}")
        est.fit(logs=False)
    job = est.latest_training_job
    assert job is not None and job.status == "Completed", est.logs()
    log = " ".join(est.logs().split())
    assert "tfsmp: training job" in log and "attempt 1 of 2" in log and "attempt 2 of 2" in log
    assert re.search(r"tfsmp: attempt 1 of 2 failed: rank 1 on host \S+ failed after 1 step of "
                     r"epoch 1: killed by signal 9 \(Killed\); retrying in 1 s "
                     r"\(max_retry_attempts=1\)", log), est.logs()
    assert job.describe()["RetryStrategy"] == {"MaximumRetryAttempts": 1}
    assert job.describe()["Attempts"] == 2
    firsts = [json.loads(m) for m in re.findall(r"FIRST (\{[^}]*\})", log)]
    assert firsts == [{"epoch": 0, "step": 0}, {"epoch": 1, "step": 1}], est.logs()
    assert not (s3 / "backup").exists()  # Keras deleted its backup when fit completed
    assert not _differences(_final(tmp_path), reference)
